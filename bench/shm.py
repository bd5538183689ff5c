"""Same-host paths against loopback TCP and memcpy, in one run (docs/BENCHMARKS.md,
"Same-host paths").

Each round: a single-threaded memcpy of SIZE on this machine (numpy, both buffers
faulted in), then `kvlink-bench loopback` between two processes with transport "auto"
(same host: the paths copy process to process, "shm") and with transport "tcp"
(loopback TCP), interleaved, every byte verified by the bench.  Prints one JSON row per
measurement and a summary row with the ratios of the medians.

    .venv/bin/python bench/shm.py --size 1GiB --paths 2 --rounds 3 [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kvlink._units import parse_size

SECRET = "kvlink-bench-shm-" + "0" * 32


def memcpy_gbps(nbytes: int) -> float:
    src = np.empty(nbytes, np.uint8)
    dst = np.empty(nbytes, np.uint8)
    src.fill(1)
    dst.fill(0)  # both faulted in before the clock starts
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return nbytes / (time.perf_counter() - t0) / 1e9


def kvlink_row(transport: str, size: str, paths: int, iters: int) -> dict[str, Any]:
    env = {**os.environ, "KVLINK_TRANSPORT": transport, "KVLINK_SECRET": SECRET}
    out = subprocess.run(
        [sys.executable, "-m", "kvlink.cli.bench", "loopback", "--paths", str(paths), "--size",
         size, "--iters", str(iters), "--compare", "none", "--json"],
        env=env, capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    row = next(r for r in rows if r.get("tool") == "kvlink")
    return {"tool": f"kvlink-{transport}", **{k: row[k] for k in
            ("gbps", "cpu_s", "transports", "verified", "per_path_gbps")}}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--paths", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json", help="append the rows to this file")
    args = ap.parse_args()
    nbytes = parse_size(args.size)
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        row = {"round": row.pop("round", None), "load": os.getloadavg()[0], **row}
        rows.append(row)
        print(json.dumps(row), flush=True)

    for rnd in range(args.rounds):
        emit({"round": rnd, "tool": "memcpy", "gbps": memcpy_gbps(nbytes)})
        for transport in ("auto", "tcp"):
            emit({"round": rnd, **kvlink_row(transport, args.size, args.paths, args.iters)})

    def med(tool: str) -> float:
        return statistics.median(r["gbps"] for r in rows if r["tool"] == tool)

    shm, tcp, mem = med("kvlink-auto"), med("kvlink-tcp"), med("memcpy")
    summary = {"tool": "summary", "size_bytes": nbytes, "paths": args.paths,
               "shm_gbps": shm, "tcp_gbps": tcp, "memcpy_gbps": mem,
               "shm_over_tcp": shm / tcp, "shm_over_memcpy": shm / mem}  # fmt: skip
    emit(summary)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
