"""``kvlink-bench loopback --mem cuda``: transfers between GPU buffers.

Both agents run in this process (the GPU is this process's), over loopback
paths; source and destination are CuPy arrays on device 0, registered as GPU
memory, so every payload goes device -> pinned host -> socket -> pinned host
-> device (docs/api.md, "GPU memory").
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from typing import Any

import kvlink

from .. import _cuda
from . import measure
from .runner import RunSpec, _segments, progress_label

TRANSFER_S = 300.0


def unavailable() -> str | None:
    """Why ``--mem cuda`` cannot run here (what is missing, what to do), or None."""
    try:
        import cupy
    except ImportError:
        return (
            "--mem cuda: needs CuPy and a CUDA GPU: cupy is not installed "
            "(pip install cupy-cuda12x); or use --mem host"
        )
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CuPy raises its own errors without a driver
        return f"--mem cuda: no usable CUDA GPU ({type(exc).__name__}: {exc}); use --mem host"
    if n == 0:
        return "--mem cuda: CUDA sees no GPU on this machine; use --mem host"
    try:
        _cuda.ensure_runtime("--mem cuda")
    except kvlink.RegistrationError as exc:
        return str(exc)
    return None


def run(
    nics: str, spec: RunSpec, progress: Callable[[str, int, int], None] | None = None
) -> Iterator[dict[str, Any]]:
    """One result row per (chunk, size), GPU buffer to GPU buffer.

    Raises:
        kvlink.TransferError: a transfer failed, or the destination differs.
    """
    import cupy

    need = spec.need_bytes
    with cupy.cuda.Device(0):
        a_buf = cupy.arange(need, dtype=cupy.uint32).astype(cupy.uint8)
        b_buf = cupy.zeros(need, dtype=cupy.uint8)
        cupy.cuda.runtime.deviceSynchronize()
    for chunk in spec.chunks:
        extra: dict[str, Any] = {}
        if chunk:  # 0: the planner's own choice; else every chunk exactly `chunk`
            extra = {"chunk_bytes": chunk, "min_chunk_bytes": chunk, "gpu_chunk_bytes": chunk}
        cfg = kvlink.Config.load(nics=nics, **extra)
        with kvlink.Agent(f"kvlink-bench-gpu-a-{chunk}", cfg) as a, kvlink.Agent(
            f"kvlink-bench-gpu-b-{chunk}", cfg
        ) as b:
            ra = a.register(a_buf, remote_read=True, remote_write=True)
            rb = b.register(b_buf, remote_read=True, remote_write=True)
            peer = a.add_peer(b.metadata())
            b.add_peer(a.metadata())
            for size in spec.sizes:
                yield _measure(a, peer, ra, rb, a_buf, b_buf, size, chunk, spec, progress)


def _measure(
    a: kvlink.Agent,
    peer: str,
    ra: kvlink.Region,
    rb: kvlink.Region,
    a_buf: Any,
    b_buf: Any,
    size: int,
    chunk: int,
    spec: RunSpec,
    progress: Callable[[str, int, int], None] | None,
) -> dict[str, Any]:
    push = spec.op == "push"
    seconds: list[float] = []
    durations: list[float] = []
    cpu: list[float] = []
    total = spec.warmup + spec.iters
    label = progress_label(spec.op, size, chunk) + " (cuda)"
    for it in range(total):
        if progress:
            progress(label, it, total)
        cpu0 = measure.cpu_seconds()
        handles = []
        for k in range(spec.concurrency):
            segs = _segments(size, spec.layers, ra.id, k * size, rb.id, k * size, push)
            handles.append((a.push if push else a.pull)(peer, segments=segs))
        for h in handles:
            h.wait(timeout_s=TRANSFER_S)
        infos = [h.info() for h in handles]
        cpu1 = measure.cpu_seconds()
        if it < spec.warmup:
            continue
        t0 = min(i.t_submit_ns for i in infos)
        t1 = max(i.t_done_ns for i in infos)
        seconds.append((t1 - t0) / 1e9)
        durations.extend((i.t_done_ns - i.t_submit_ns) / 1e9 for i in infos)
        cpu.append(cpu1 - cpu0)
    if progress:
        progress(label, total, total)
    if spec.verify:
        import cupy

        n = size * spec.concurrency
        if not bool(cupy.array_equal(a_buf[:n], b_buf[:n])):
            raise kvlink.TransferError(
                f"verification failed: the GPU bytes at the destination differ after {spec.op} "
                f"of {measure.fmt_size(size)} x {spec.concurrency}"
            )
    sec = statistics.median(seconds)
    durations.sort()
    return {
        "tool": "kvlink",
        "op": spec.op,
        "mem": "cuda",
        "size_bytes": size,
        "chunk_bytes": chunk,
        "paths": len(a.paths()),
        "concurrency": spec.concurrency,
        "layers": spec.layers,
        "seconds": sec,
        "gbps": size * spec.concurrency / sec / 1e9,
        "first_layer_s": None,
        "p50_s": statistics.median(durations),
        "p99_s": durations[min(len(durations) - 1, int(0.99 * len(durations)))],
        "cpu_s": statistics.median(cpu),
        "cpu_cores": statistics.median(cpu) / sec,
        "per_path_gbps": {},
        "verified": spec.verify,
        "limit_gbps": None,
        "ratio_to_limit": None,
    }
