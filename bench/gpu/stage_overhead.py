"""What staging costs without a GPU: a push between two in-process agents over loopback TCP,
host -> host, with ``stage_host_memory`` off (A) and on (B: every chunk copied into a host slot
at the sender and out of one at the receiver, memcpy for cudaMemcpy), interleaved A/B/A/B,
medians (docs/BENCHMARKS.md, "GPU memory").

    python bench/gpu/stage_overhead.py [--size 1GiB] [--paths 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

import kvlink
from kvlink._units import parse_size


def once(src: np.ndarray, dst: np.ndarray, paths: int, staged: bool, k: int) -> float:
    cfg = kvlink.Config(nics=f"loopback:{paths}", stage_host_memory=staged)
    with kvlink.Agent(f"so-a{k}", cfg) as a, kvlink.Agent(f"so-b{k}", cfg) as b:
        a.register(src)
        b.register(dst, remote_write=True, name="dst")
        a.add_peer(b.metadata())
        a.push(b.name, src=src[: 64 << 20], dst="dst").wait(120)  # connections, slots warm
        info = a.push(b.name, src=src, dst="dst").wait(300).info()
    return (info.t_done_ns - info.t_submit_ns) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--paths", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n = parse_size(args.size)
    src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    secs: dict[bool, list[float]] = {False: [], True: []}
    for k in range(args.rounds):
        for staged in (False, True):
            dst[:] = 0
            secs[staged].append(once(src, dst, args.paths, staged, 2 * k + staged))
            assert np.array_equal(src, dst)
    plain, staged = statistics.median(secs[False]), statistics.median(secs[True])
    print(json.dumps({"size_bytes": n, "paths": args.paths, "rounds": args.rounds,
                      "plain_gbps": n / plain / 1e9, "staged_gbps": n / staged / 1e9,
                      "staged_over_plain": plain / staged,
                      "plain_s": secs[False], "staged_s": secs[True]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
