"""The two halves of ``kvlink-bench``: ``serve`` (a worker whose agent registers one buffer,
served on a TCP port) and ``run`` (the initiator, which times transfers against it).

``serve`` answers the worker commands of :mod:`kvlink.bench.worker` on its bootstrap port, so
``run`` fills, checks and reads the CPU clock of the far side with the same commands every
other benchmark uses. ``run`` yields one result dict per (chunk size, transfer size).
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvlink

from . import measure
from .protocol import Connection, serve_lines
from .worker import Agents

BUFFER = "bench"  # the key and region name of serve's buffer
# Longest one transfer may take before the run is called failed: 3 GiB at 10 MB/s.
TRANSFER_S = 300.0


@dataclass
class RunSpec:
    """What ``run`` measures; ``chunks`` holds 0 for the planner's own choice ("auto")."""

    sizes: list[int]
    chunks: list[int]
    op: str = "push"
    iters: int = 5
    warmup: int = 1
    concurrency: int = 1
    layers: int = 1
    verify: bool = True

    @property
    def need_bytes(self) -> int:
        return max(self.sizes) * self.concurrency


def serve(
    nics: str,
    nbytes: int,
    bootstrap: tuple[str, int],
    on_ready: Callable[[str], None],
    stop: threading.Event | None = None,
) -> None:
    """Serves a worker with one agent and one ``nbytes`` buffer until a client sends "exit"
    or ``stop`` is set; ``on_ready`` gets the bootstrap endpoint once it listens."""
    stop = stop or threading.Event()
    worker = Agents()
    try:
        worker.agent("kvlink-bench-serve", nics)
        worker.alloc(BUFFER, nbytes, fill="zero", remote_read=True, remote_write=True,
                     name=BUFFER)  # fmt: skip
        with socket.create_server(bootstrap) as srv:
            srv.settimeout(0.2)
            host, port = srv.getsockname()[:2]
            on_ready(f"{host}:{port}")
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                conn.settimeout(None)
                with conn, conn.makefile("r") as rf, conn.makefile("w") as wf:
                    if serve_lines(worker, rf, wf):
                        return
    finally:
        worker.exit()


def _segments(
    size: int, layers: int, local: int, local_off: int, remote: int, remote_off: int, push: bool
) -> np.ndarray[Any, Any]:
    """``size`` bytes as ``layers`` contiguous layer segments."""
    segs = np.zeros(layers, dtype=kvlink.SEGMENT_DTYPE)
    bounds = [size * i // layers for i in range(layers + 1)]
    for i in range(layers):
        lo, n = bounds[i], bounds[i + 1] - bounds[i]
        src = (local, local_off + lo) if push else (remote, remote_off + lo)
        dst = (remote, remote_off + lo) if push else (local, local_off + lo)
        segs[i] = (src[0], src[1], dst[0], dst[1], n, i, 0)
    return segs


def progress_label(op: str, size: int, chunk: int) -> str:
    """What the progress bar says while one configuration runs: "push 64MiB, chunk auto"."""
    return f"{op} {measure.fmt_size(size)}, chunk {measure.chunk_label(chunk)}"


def run(
    endpoint: str, nics: str, spec: RunSpec, progress: Callable[[str, int, int], None] | None = None
) -> Iterator[dict[str, Any]]:
    """Connects to ``serve`` at ``endpoint`` and yields one result per (chunk, size).

    Raises:
        kvlink.bench.protocol.WorkerError: serve is unreachable or failed.
        kvlink.InvalidArgumentError: serve's buffer is smaller than the run needs.
        kvlink.TransferError: a transfer failed, or the bytes at the destination differ.
    """
    boot = Connection(endpoint)
    try:
        hello = boot.call("hello")
        region = hello["regions"][BUFFER]
        need = spec.need_bytes
        if need > region["nbytes"]:
            raise kvlink.InvalidArgumentError(
                f"--size x --concurrency needs {need} bytes but the server registered "
                f"{region['nbytes']}; start serve with a larger --size"
            )
        for chunk in spec.chunks:
            # 0 = the library's own planning; otherwise every chunk is exactly `chunk`
            cfg = (
                kvlink.Config.load(nics=nics)
                if chunk == 0
                else kvlink.Config.load(nics=nics, chunk_bytes=chunk, min_chunk_bytes=chunk)
            )
            with kvlink.Agent(f"kvlink-bench-run-{chunk}", cfg) as agent:
                local = np.empty(need, np.uint8)
                measure.fill_pattern(local, 1)
                reg = agent.register(local, remote_read=True, remote_write=True)
                peer = agent.add_peer(hello["metadata"].encode())
                if spec.op == "pull":
                    boot.call("fill", key=BUFFER, nbytes=need, seed=2)
                for size in spec.sizes:
                    yield _measure(agent, peer, reg, region["id"], local, size, chunk, spec, boot,
                                   progress)  # fmt: skip
    finally:
        with contextlib.suppress(Exception):
            boot.close()


def _measure(
    agent: kvlink.Agent,
    peer: str,
    region: kvlink.Region,
    remote: int,
    local: np.ndarray[Any, Any],
    size: int,
    chunk: int,
    spec: RunSpec,
    boot: Connection,
    progress: Callable[[str, int, int], None] | None,
) -> dict[str, Any]:
    push = spec.op == "push"
    durations: list[float] = []
    seconds: list[float] = []
    first_layer: list[float] = []
    cpu: list[float] = []
    path_bytes_total: dict[int, int] = {}
    total_iters = spec.warmup + spec.iters
    label = progress_label(spec.op, size, chunk)
    for it in range(total_iters):
        if progress:
            progress(label, it, total_iters)
        before = {p.index: p.bytes_sent + p.bytes_recv for p in agent.paths() if p.peer == peer}
        cpu0 = measure.cpu_seconds()
        peer_cpu0 = float(boot.call("cpu")["cpu_s"])
        handles = []
        for k in range(spec.concurrency):
            segs = _segments(size, spec.layers, region.id, k * size, remote, k * size, push)
            fn = agent.push if push else agent.pull
            handles.append(fn(peer, segments=segs))
        first = None
        if spec.layers > 1:
            for ev in handles[0].chunks(timeout_s=TRANSFER_S):
                if first is None and 0 in ev.layers:
                    first = ev.t_ns
        for h in handles:
            h.wait(timeout_s=TRANSFER_S)
        infos = [h.info() for h in handles]
        cpu1 = measure.cpu_seconds()
        peer_cpu1 = float(boot.call("cpu")["cpu_s"])
        if progress:
            progress(label, it + 1, total_iters)
        if it < spec.warmup:
            continue
        t0 = min(i.t_submit_ns for i in infos)
        t1 = max(i.t_done_ns for i in infos)
        seconds.append((t1 - t0) / 1e9)
        durations.extend((i.t_done_ns - i.t_submit_ns) / 1e9 for i in infos)
        if first is not None:
            first_layer.append((first - infos[0].t_submit_ns) / 1e9)
        cpu.append((cpu1 - cpu0) + (peer_cpu1 - peer_cpu0))
        for p in agent.paths():
            if p.peer == peer:
                moved = p.bytes_sent + p.bytes_recv - before.get(p.index, 0)
                path_bytes_total[p.index] = path_bytes_total.get(p.index, 0) + moved
    if spec.verify:
        n = size * spec.concurrency
        theirs = boot.call("digest", answer_s=300, key=BUFFER, offset=0, nbytes=n)["digest"]
        if theirs != measure.digest(local[:n]):
            raise kvlink.TransferError(
                f"verification failed: the bytes at the destination differ after {spec.op} of "
                f"{measure.fmt_size(size)} x {spec.concurrency}"
            )
    sec = statistics.median(seconds)
    total_s = sum(seconds)
    moved_bytes = size * spec.concurrency
    durations.sort()
    return {
        "tool": "kvlink",
        "op": spec.op,
        "size_bytes": size,
        "chunk_bytes": chunk,
        "paths": len(path_bytes_total),
        "concurrency": spec.concurrency,
        "layers": spec.layers,
        "seconds": sec,
        "gbps": moved_bytes / sec / 1e9,
        "first_layer_s": statistics.median(first_layer) if first_layer else None,
        "p50_s": statistics.median(durations),
        "p99_s": durations[min(len(durations) - 1, int(0.99 * len(durations)))],
        "cpu_s": statistics.median(cpu),
        "cpu_cores": statistics.median(cpu) / sec,
        "per_path_gbps": {str(i): b / total_s / 1e9 for i, b in sorted(path_bytes_total.items())},
        "transports": sorted({p.transport for p in agent.paths() if p.peer == peer}),
        "verified": spec.verify,
        "limit_gbps": None,
        "ratio_to_limit": None,
    }
