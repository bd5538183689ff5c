"""A/B helper: 1 GiB (or --size) pushes between two agents in this process over loopback:N,
printed as one JSON line of GB/s per timed push.  Run it once per build, alternating, with
PYTHONPATH pointing at the build under test (another worktree with its own compiled core):

    PYTHONPATH=/tmp/base .venv/bin/python bench/ab_push.py --paths 4   # before
    .venv/bin/python bench/ab_push.py --paths 4                        # after

GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import kvlink


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--paths", type=int, default=4, help="loopback paths (default 4)")
    ap.add_argument("--size", type=int, default=1 << 30, help="bytes per push (default 1 GiB)")
    ap.add_argument("--iters", type=int, default=3, help="timed pushes (default 3)")
    args = ap.parse_args()
    cfg = kvlink.Config(nics=f"loopback:{args.paths}")
    with kvlink.Agent("ab-rx", cfg) as rx, kvlink.Agent("ab-tx", cfg) as tx:
        dst = np.zeros(args.size, np.uint8)
        src = np.ones(args.size, np.uint8)
        rx.register(dst, remote_write=True, name="kv")
        tx.register(src)
        tx.add_peer(rx.metadata())
        tx.push("ab-rx", src=src, dst="kv").wait(timeout_s=120)  # warm-up
        gbps = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            tx.push("ab-rx", src=src, dst="kv").wait(timeout_s=120)
            gbps.append(args.size / (time.perf_counter() - t0) / 1e9)
    print(json.dumps({"kvlink": kvlink.__file__, "paths": args.paths, "gbps": gbps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
