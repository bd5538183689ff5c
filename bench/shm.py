"""Same-host paths against loopback TCP and memcpy, in one run (docs/BENCHMARKS.md,
"Same-host paths").

Each round: a single-threaded memcpy of SIZE on this machine (numpy, both buffers
faulted in), the kernel's cross-memory copy itself (process_vm_readv of SIZE, 512 KiB
per call, from one thread and split over two: the mechanism's ceiling, without any
checksum or protocol), then `kvlink-bench loopback` between two processes with transport "auto"
(same host: the paths copy process to process, "shm") and with transport "tcp"
(loopback TCP), interleaved, every byte verified by the bench.  Prints one JSON row per
measurement and a summary row with the ratios of the medians.

    .venv/bin/python bench/shm.py --size 1GiB --paths 2 --rounds 3 [--json F]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
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


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [
    ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
    ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong,
]  # fmt: skip


def cma_gbps(nbytes: int, threads: int) -> float:
    """process_vm_readv of nbytes (from this process: the same kernel path as from another
    one) in 512 KiB calls, the range split over ``threads`` threads (ctypes drops the GIL)."""
    src = np.empty(nbytes, np.uint8)
    dst = np.empty(nbytes, np.uint8)
    src.fill(1)
    dst.fill(0)
    step, pid = 512 << 10, os.getpid()
    s0, d0 = src.ctypes.data, dst.ctypes.data

    def run(lo: int, hi: int) -> None:
        for off in range(lo, hi, step):
            n = min(step, hi - off)
            loc, rem = _Iovec(d0 + off, n), _Iovec(s0 + off, n)
            if _libc.process_vm_readv(pid, ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0) != n:
                raise OSError(ctypes.get_errno(), "process_vm_readv")

    share = nbytes // threads
    bounds = [(i * share, nbytes if i == threads - 1 else (i + 1) * share) for i in range(threads)]
    workers = [threading.Thread(target=run, args=b) for b in bounds]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
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
        for threads in (1, 2):
            gbps = cma_gbps(nbytes, threads)
            emit({"round": rnd, "tool": f"cma-{threads}thread", "gbps": gbps})
        for transport in ("auto", "tcp"):
            emit({"round": rnd, **kvlink_row(transport, args.size, args.paths, args.iters)})

    def med(tool: str) -> float:
        return statistics.median(r["gbps"] for r in rows if r["tool"] == tool)

    shm, tcp, mem = med("kvlink-auto"), med("kvlink-tcp"), med("memcpy")
    cma1, cma2 = med("cma-1thread"), med("cma-2thread")
    summary = {"tool": "summary", "size_bytes": nbytes, "paths": args.paths,
               "shm_gbps": shm, "tcp_gbps": tcp, "memcpy_gbps": mem,
               "cma_1thread_gbps": cma1, "cma_2thread_gbps": cma2,
               "shm_over_tcp": shm / tcp, "shm_over_memcpy": shm / mem,
               "cma_1thread_over_memcpy": cma1 / mem,
               "shm_over_cma_2thread": shm / cma2}  # fmt: skip
    emit(summary)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
