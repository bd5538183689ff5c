"""GPU figures for docs/BENCHMARKS.md, on a machine with a CUDA GPU (bench/gpu/device_check.sh).

Prints one JSON row per measurement:
  - cudaMemcpy baselines (CuPy): device->device, device->pinned host, pinned host->device;
  - kvlink push of SIZE bytes over loopback TCP, GPU -> GPU and host -> host in the same run,
    and their ratio (target >= 0.9: staging through pinned host memory should cost little
    next to the sockets).

    python bench/gpu/device_bench.py [--size 1GiB] [--paths 4] [--iters 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

import kvlink
from kvlink._units import parse_size


def row(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def copy_baselines(cp: Any, n: int, iters: int) -> None:
    dev_a = cp.empty(n, cp.uint8)
    dev_b = cp.empty(n, cp.uint8)
    pinned_mem = cp.cuda.alloc_pinned_memory(n)
    host = np.frombuffer(pinned_mem, np.uint8, n)
    cases = {
        "D2D": lambda: dev_b.data.copy_from_device(dev_a.data, n),
        "D2H": lambda: dev_a.data.copy_to_host(host.ctypes.data, n),
        "H2D": lambda: dev_b.data.copy_from_host(host.ctypes.data, n),
    }
    for name, fn in cases.items():
        fn()
        cp.cuda.runtime.deviceSynchronize()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            cp.cuda.runtime.deviceSynchronize()
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        row(bench="cudaMemcpy", kind=name, size_bytes=n, seconds=s, gbps=n / s / 1e9)


def push_gbps(src: Any, dst: Any, n: int, paths: int, iters: int, tag: str) -> float:
    cfg = kvlink.Config(nics=f"loopback:{paths}")
    with kvlink.Agent(f"gpu-bench-a-{tag}", cfg) as a, kvlink.Agent(f"gpu-bench-b-{tag}", cfg) as b:
        a.register(src)
        b.register(dst, remote_write=True, name="dst")
        a.add_peer(b.metadata())
        a.push(b.name, src=src, dst="dst").wait(300)  # warm-up: connections, slots, page faults
        secs = []
        for _ in range(iters):
            info = a.push(b.name, src=src, dst="dst").wait(300).info()
            secs.append((info.t_done_ns - info.t_submit_ns) / 1e9)
    s = statistics.median(secs)
    row(bench="kvlink-push", mem=tag, size_bytes=n, paths=paths, seconds=s, gbps=n / s / 1e9)
    return n / s / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--paths", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    n = parse_size(args.size)
    import cupy as cp

    copy_baselines(cp, n, args.iters)
    host_src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    host_dst = np.zeros(n, np.uint8)
    host = push_gbps(host_src, host_dst, n, args.paths, args.iters, "host")
    assert np.array_equal(host_src, host_dst), "host -> host: bytes differ"
    dev_src = cp.asarray(host_src)
    dev_dst = cp.zeros(n, cp.uint8)
    gpu = push_gbps(dev_src, dev_dst, n, args.paths, args.iters, "cuda")
    assert bool(cp.array_equal(dev_src, dev_dst)), "GPU -> GPU: bytes differ"
    row(bench="ratio", what="GPU->GPU / host->host push", ratio=gpu / host, target=0.9,
        ok=gpu / host >= 0.9)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
