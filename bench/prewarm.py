"""Push-to-first-byte with and without pre-warm (Agent.prepare), two processes.

Cold: when prefill finishes, the decode side learns what is coming, allocates and
registers its destination, the prefill side connects (add_peer) and pushes.
Prepared: the prefill side connects and calls prepare() when prefill *starts*;
the decode side allocates on the PREPARE notification while prefill runs; when
prefill finishes the push goes out at once.

Measured: from "prefill finished" to the first chunk verified at the destination,
and to the whole transfer verified.  Run:

    .venv/bin/python bench/prewarm.py --size 1GiB --paths 4 --iters 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from kvlink.bench import Worker
from kvlink.bench.measure import size_arg


def one_run(size: int, paths: int, prepared: bool, prefill_s: float) -> dict[str, float]:
    nics = f"loopback:{paths}"
    rx = Worker("decode", name="decode", nics=nics)
    tx = Worker("prefill", name="prefill", nics=nics)
    try:
        tx.call("alloc", key="src", nbytes=size, seed=1)
        if prepared:
            tx.call("add_peer", metadata=rx.metadata.decode())
            tx.call("prepare", peer="decode", nbytes=size, wait_s=10, answer_s=30)
            note = rx.call("notifications", wait_s=5)["notifications"]
            assert note and note[0]["op"] == "PREPARE", note
            md = rx.call("alloc", key="kv", nbytes=size, remote_write=True, name="kv",
                         answer_s=120)["metadata"]  # fmt: skip
            tx.call("add_peer", metadata=md)  # the new region's access key, handed back
            time.sleep(prefill_s)  # prefill still running; everything above overlapped it
        else:
            time.sleep(prefill_s)
        t0 = time.monotonic_ns()  # prefill finished
        if not prepared:
            rx.call("alloc", key="kv", nbytes=size, remote_write=True, name="kv", answer_s=120)
            tx.call("add_peer", metadata=rx.metadata.decode())
        xid = tx.call("push", peer="decode", local="src", remote="kv")["id"]
        info = tx.call("wait", id=xid, wait_s=120, answer_s=130)
        return {
            "first_byte_s": (info["t_first_ns"] - t0) / 1e9,
            "done_s": (info["t_done_ns"] - t0) / 1e9,
        }
    finally:
        tx.close()
        rx.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", type=size_arg, default="1GiB", help="bytes pushed (default: 1GiB)")
    ap.add_argument("--paths", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--prefill-s", type=float, default=2.0, help="simulated prefill time")
    ap.add_argument("--json", help="append one JSON line per result here")
    args = ap.parse_args()
    size = args.size
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.iters):  # interleaved: cold, prepared, cold, prepared ...
        for prepared in (False, True):
            runs[prepared].append(one_run(size, args.paths, prepared, args.prefill_s))
    rows = []
    for prepared, rs in runs.items():
        row = {
            "mode": "prepared" if prepared else "cold",
            "size_bytes": size,
            "paths": args.paths,
            "first_byte_s": statistics.median(r["first_byte_s"] for r in rs),
            "done_s": statistics.median(r["done_s"] for r in rs),
            "n": len(rs),
        }
        rows.append(row)
        print(
            f"{row['mode']:9s} push-to-first-byte {row['first_byte_s'] * 1e3:8.1f} ms   "
            f"push-to-done {row['done_s'] * 1e3:8.1f} ms   (median of {len(rs)})"
        )
    ratio = rows[1]["first_byte_s"] / rows[0]["first_byte_s"]
    print(f"prepared/cold first-byte ratio: {ratio:.3f}")
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
