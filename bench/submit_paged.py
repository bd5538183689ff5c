"""Submit cost of a paged KV push: 65,152 scattered 4 KiB segments (the planner
benchmark's size), pushed over loopback:1 between two agents in this process; prints the
median time push() takes to return (validation, key lookup, planning, queueing) over 7
pushes.  Run once per build, alternating, for an A/B (PYTHONPATH to the other build):

    .venv/bin/python bench/submit_paged.py
"""

import time

import numpy as np

import kvlink

cfg = kvlink.Config(nics="loopback:1")
with kvlink.Agent("sc-rx", cfg) as rx, kvlink.Agent("sc-tx", cfg) as tx:
    n = 65152
    dst = np.zeros(n * 4096, np.uint8)
    src = np.ones_like(dst)
    rid = rx.register(dst, remote_write=True).id
    sid = tx.register(src).id
    tx.add_peer(rx.metadata())
    segs = np.zeros(n, kvlink.SEGMENT_DTYPE)
    segs["src_region"] = sid
    segs["dst_region"] = rid
    idx = np.random.default_rng(1).permutation(n)
    segs["src_offset"] = idx * 4096
    segs["dst_offset"] = np.arange(n) * 4096
    segs["len"] = 4096
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        h = tx.push("sc-rx", segments=segs)
        ts.append(time.perf_counter() - t0)
        h.wait(timeout_s=60)
    print("submit ms (median of 7):", round(sorted(ts)[3] * 1e3, 2))
