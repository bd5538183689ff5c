"""The two halves of `kvlink-bench`: `serve` (the target agent) and `run` (the
initiator that times transfers), plus the small bootstrap protocol between them.

`serve` registers one buffer (remote read and write) and answers JSON lines on a
bootstrap TCP port: its metadata, its CPU usage, and digests of its buffer so
`run` can verify every byte it moved.  `run` connects, moves data with the
requested sizes, chunk sizes, concurrency and layers, and yields one result
dict per configuration.
"""

from __future__ import annotations

import hashlib
import json
import resource
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvlink

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def fill(buf: np.ndarray[Any, Any], seed: int) -> None:
    """Deterministic, cheap pattern: every 8-byte word differs."""
    words = buf.view(np.uint64)
    step = 8 << 20
    for lo in range(0, words.size, step):
        hi = min(lo + step, words.size)
        np.multiply(np.arange(lo + seed, hi + seed, dtype=np.uint64), GOLDEN, out=words[lo:hi])


def digest(buf: np.ndarray[Any, Any]) -> str:
    return hashlib.blake2b(buf.data).hexdigest()


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return float(ru.ru_utime + ru.ru_stime)


# ---- serve -----------------------------------------------------------------


def serve(
    nics: str,
    nbytes: int,
    bootstrap: tuple[str, int],
    on_ready: Callable[[str], None],
    stop: threading.Event | None = None,
) -> None:
    """Runs the target agent until a client says "exit" or ``stop`` is set."""
    stop = stop or threading.Event()
    # Config.load: KVLINK_* settings in the environment apply to both sides, as in production
    with kvlink.Agent("kvlink-bench-serve", kvlink.Config.load(nics=nics)) as agent:
        buf = np.empty(nbytes, np.uint8)
        buf.fill(0)
        region = agent.register(buf, remote_read=True, remote_write=True, name="bench")
        srv = socket.create_server(bootstrap)
        srv.settimeout(0.2)
        host, port = srv.getsockname()[:2]
        on_ready(f"{host}:{port}")
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn, conn.makefile("rw") as f:
                for line in f:
                    req = json.loads(line)
                    cmd = req.get("cmd")
                    if cmd == "hello":
                        rep: dict[str, Any] = {
                            "metadata": agent.metadata().decode(),
                            "region": region.id,
                            "nbytes": nbytes,
                        }
                    elif cmd == "fill":
                        fill(buf[: req["nbytes"]], req["seed"])
                        rep = {}
                    elif cmd == "digest":
                        off, n = req["offset"], req["nbytes"]
                        rep = {"digest": digest(buf[off : off + n])}
                    elif cmd == "cpu":
                        rep = {"cpu_s": cpu_seconds()}
                    elif cmd == "exit":
                        f.write(json.dumps({"ok": True}) + "\n")
                        f.flush()
                        return
                    else:
                        rep = {"error": f"unknown command {cmd!r}"}
                    f.write(json.dumps({"ok": True, **rep}) + "\n")
                    f.flush()
        srv.close()


# ---- run -------------------------------------------------------------------


class Bootstrap:
    """Client side of the bootstrap connection."""

    def __init__(self, endpoint: str, timeout_s: float = 30.0) -> None:
        host, port = endpoint.rsplit(":", 1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.f = self.sock.makefile("rw")

    def call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        self.f.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.f.flush()
        line = self.f.readline()
        if not line:
            raise ConnectionError("kvlink-bench serve closed the bootstrap connection")
        rep: dict[str, Any] = json.loads(line)
        return rep

    def close(self) -> None:
        self.f.close()
        self.sock.close()


@dataclass
class RunSpec:
    sizes: list[int]
    chunks: list[int]  # 0 = the library's default planning
    op: str = "push"
    iters: int = 5
    warmup: int = 1
    concurrency: int = 1
    layers: int = 1
    verify: bool = True


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


def run(
    endpoint: str, nics: str, spec: RunSpec, progress: Callable[[str, int, int], None] | None = None
) -> Iterator[dict[str, Any]]:
    """Connects to `serve` at ``endpoint`` and yields one result per (size, chunk)."""
    boot = Bootstrap(endpoint)
    hello = boot.call("hello")
    peer_bytes = int(hello["nbytes"])
    need = max(spec.sizes) * spec.concurrency
    if need > peer_bytes:
        boot.close()
        raise kvlink.InvalidArgumentError(
            f"--size x --concurrency needs {need} bytes but the server registered {peer_bytes}; "
            "start serve with a larger --size"
        )
    try:
        for chunk in spec.chunks:
            # 0 = the library's own planning; otherwise every chunk is exactly `chunk`
            cfg = (
                kvlink.Config.load(nics=nics)
                if chunk == 0
                else kvlink.Config.load(nics=nics, chunk_bytes=chunk, min_chunk_bytes=chunk)
            )
            with kvlink.Agent(f"kvlink-bench-run-{chunk}", cfg) as agent:
                local = np.empty(need, np.uint8)
                fill(local, 1)
                region = agent.register(local, remote_read=True, remote_write=True)
                peer = agent.add_peer(hello["metadata"].encode())
                if spec.op == "pull":
                    boot.call("fill", nbytes=need, seed=2)
                for size in spec.sizes:
                    yield _measure(
                        agent,
                        peer,
                        region,
                        hello["region"],
                        local,
                        size,
                        chunk,
                        spec,
                        boot,
                        progress,
                    )
    finally:
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
    boot: Bootstrap,
    progress: Callable[[str, int, int], None] | None,
) -> dict[str, Any]:
    push = spec.op == "push"
    durations: list[float] = []
    seconds: list[float] = []
    first_layer: list[float] = []
    cpu: list[float] = []
    path_bytes_total: dict[int, int] = {}
    total_iters = spec.warmup + spec.iters
    for it in range(total_iters):
        before = {p.index: p.bytes_sent + p.bytes_recv for p in agent.paths() if p.peer == peer}
        cpu0 = cpu_seconds()
        peer_cpu0 = float(boot.call("cpu")["cpu_s"])
        handles = []
        for k in range(spec.concurrency):
            segs = _segments(size, spec.layers, region.id, k * size, remote, k * size, push)
            fn = agent.push if push else agent.pull
            handles.append(fn(peer, segments=segs))
        first = None
        if spec.layers > 1:
            for ev in handles[0].chunks(timeout_s=120):
                if first is None and 0 in ev.layers:
                    first = ev.t_ns
        for h in handles:
            h.wait(timeout_s=300)
        infos = [h.info() for h in handles]
        cpu1 = cpu_seconds()
        peer_cpu1 = float(boot.call("cpu")["cpu_s"])
        if progress:
            progress(f"{spec.op} {size} B chunk {chunk}", it + 1, total_iters)
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
        theirs = boot.call("digest", offset=0, nbytes=n)["digest"]
        if theirs != digest(local[:n]):
            raise kvlink.TransferError(
                f"verification failed: the bytes at the destination differ after {spec.op} of "
                f"{size} B x {spec.concurrency}"
            )
    sec = statistics.median(seconds)
    total_s = sum(seconds)
    moved = size * spec.concurrency
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
        "gbps": moved / sec / 1e9,
        "first_layer_s": statistics.median(first_layer) if first_layer else None,
        "p50_s": statistics.median(durations),
        "p99_s": durations[min(len(durations) - 1, int(0.99 * len(durations)))],
        "cpu_s": statistics.median(cpu),
        "cpu_cores": statistics.median(cpu) / sec,
        "per_path_gbps": {str(i): b / total_s / 1e9 for i, b in sorted(path_bytes_total.items())},
        "verified": spec.verify,
        "limit_gbps": None,
        "ratio_to_limit": None,
    }
