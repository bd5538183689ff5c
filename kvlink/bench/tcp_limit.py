"""``kvlink-bench tcp-limit``: kvlink's TCP data path against plain TCP, in the same run.

The baseline ("tcp-limit") is what N TCP connections between the same two processes move
when nothing else is done: one native thread per connection on each side, each moving its own
slice of the same pre-faulted buffers kvlink moves, with blocking send/recv -- no framing, no
crc32c, no event loop (csrc/bench_tcp.c).  Connection i runs from 127.0.0.(i+1) to
127.0.0.(i+1), as kvlink's path i over ``loopback:N`` does.

Rounds alternate the order (baseline then kvlink, then kvlink then baseline) so that load
from elsewhere on the machine falls on both alike, and every kvlink figure is divided by the
baseline of its own round.  CPU is user + system seconds of both processes: every thread of
each (getrusage) for kvlink, the moving threads (RUSAGE_THREAD) for the baseline.  Both
destinations are zeroed before and checked byte by byte (blake2b) after every timed move.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

import kvlink

from .. import _native
from . import measure
from .protocol import BenchError, Connection
from .runner import BUFFER, RunSpec, _measure

GiB = 1 << 30
MOVE_S = 60.0  # a baseline socket that moves nothing this long has failed
ACCEPT_S = 10.0  # the driver connects at once; an accept that waits longer has failed


def hosts(paths: int) -> list[str]:
    """The loopback addresses of ``loopback:N``, path i on 127.0.0.(i+1)."""
    return [f"127.0.0.{i + 1}" for i in range(paths)]


class Receiver:
    """The receiving side of one baseline move, in a worker (``tcp_limit_listen``): one
    listener per address; a thread accepts one connection on each, in order, and receives
    into ``buf`` over them; :meth:`result` joins it."""

    def __init__(self, addrs: Sequence[str], buf: np.ndarray[Any, Any]) -> None:
        self.listeners = []
        try:
            for host in addrs:
                s = socket.create_server((host, 0))
                s.settimeout(ACCEPT_S)
                self.listeners.append(s)
        except OSError:
            self._close()
            raise
        self.ports = [int(s.getsockname()[1]) for s in self.listeners]
        self.buf = buf
        self.out: tuple[float, float] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="tcp-limit-rx", daemon=True)
        self.thread.start()

    def _close(self) -> None:
        for s in self.listeners:
            s.close()

    def _main(self) -> None:
        conns: list[socket.socket] = []
        try:
            for s in self.listeners:
                c, _ = s.accept()
                c.setblocking(True)
                conns.append(c)
            self.out = _native.bench_tcp_move([c.fileno() for c in conns], self.buf, False,
                                              MOVE_S)  # fmt: skip
        except BaseException as exc:  # reported by result()
            self.error = exc
        finally:
            for c in conns:
                c.close()
            self._close()

    def result(self, timeout_s: float) -> dict[str, Any]:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"tcp-limit: the receiving side did not finish in {timeout_s} s")
        if self.error is not None:
            raise self.error
        assert self.out is not None
        return {"wall_s": self.out[0], "cpu_s": self.out[1]}


def _connect(addrs: Sequence[str], ports: Sequence[int]) -> list[socket.socket]:
    socks = []
    try:
        for host, port in zip(addrs, ports, strict=True):
            s = socket.create_connection((host, port), timeout=ACCEPT_S, source_address=(host, 0))
            s.setblocking(True)
            socks.append(s)
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


def baseline(boot: Connection, paths: int, src: np.ndarray[Any, Any]) -> dict[str, float]:
    """One baseline move of ``src`` into serve's buffer: seconds (the sender's, up to the
    receiver's last answer) and CPU seconds of both sides' moving threads."""
    addrs = hosts(paths)
    ports = boot.call("tcp_limit_listen", key=BUFFER, hosts=addrs, nbytes=src.nbytes)["ports"]
    socks = _connect(addrs, ports)
    try:
        wall, cpu = _native.bench_tcp_move([s.fileno() for s in socks], src, True, MOVE_S)
    finally:
        for s in socks:
            s.close()
    far = boot.call("tcp_limit_result", answer_s=MOVE_S + 10, timeout_s=MOVE_S)
    return {"seconds": wall, "cpu_s": cpu + float(far["cpu_s"])}


def _row(tool: str, size: int, paths: int, seconds: float, cpu_s: float) -> dict[str, Any]:
    return {
        "tool": tool, "op": "push", "size_bytes": size, "chunk_bytes": None, "paths": paths,
        "seconds": seconds, "gbps": size / seconds / 1e9, "first_layer_s": None,
        "p50_s": seconds, "p99_s": seconds, "cpu_s": cpu_s, "cpu_cores": cpu_s / seconds,
        "cpu_s_per_gib": cpu_s * GiB / size, "verified": False,
    }  # fmt: skip


def run(
    endpoint: str,
    paths: int,
    size: int,
    rounds: int,
    warmup: int,
    verify: bool,
    progress: Callable[[str, int, int], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Connects to ``serve`` at ``endpoint`` (an agent on ``loopback:paths``) and yields, per
    round, a "tcp-limit" row and a "kvlink" row whose ``ratio_to_limit`` is kvlink's GB/s over
    the baseline's of that round.

    Raises:
        kvlink.bench.protocol.WorkerError: serve is unreachable or failed.
        kvlink.KvlinkError: a kvlink transfer or a baseline socket failed.
        BenchError: the bytes at a destination differ after a move.
    """
    boot = Connection(endpoint)
    try:
        hello = boot.call("hello")
        region = hello["regions"][BUFFER]
        cfg = kvlink.Config.load(nics=f"loopback:{paths}")
        spec = RunSpec(sizes=[size], chunks=[0], iters=1, warmup=0, verify=False)
        with kvlink.Agent("kvlink-bench-tcp-limit", cfg) as agent:
            local = np.empty(size, np.uint8)
            measure.fill_pattern(local, 1)
            want = measure.digest(local) if verify else ""
            reg = agent.register(local, remote_read=True, remote_write=True)
            peer = agent.add_peer(hello["metadata"].encode())

            def check(tool: str) -> None:
                got = boot.call("digest", answer_s=300, key=BUFFER, offset=0, nbytes=size)
                if got["digest"] != want:
                    raise BenchError(f"tcp-limit: {tool} left other bytes at the destination")

            def kv() -> dict[str, Any]:
                row = _measure(agent, peer, reg, region["id"], local, size, 0, spec, boot, None)
                return _row("kvlink", size, paths, row["seconds"], row["cpu_s"]) | {
                    "transports": row["transports"], "per_path_gbps": row["per_path_gbps"]
                }  # fmt: skip

            def base() -> dict[str, Any]:
                b = baseline(boot, paths, local)
                return _row("tcp-limit", size, paths, b["seconds"], b["cpu_s"])

            total = warmup + rounds
            for r in range(total):
                rows: dict[str, dict[str, Any]] = {}
                order = ("tcp-limit", "kvlink") if r % 2 == 0 else ("kvlink", "tcp-limit")
                for tool in order:
                    if progress:
                        progress(f"{tool} {measure.fmt_size(size)} over {paths} paths", r, total)
                    if verify:
                        boot.call("zero", answer_s=300, key=BUFFER)
                    rows[tool] = kv() if tool == "kvlink" else base()
                    if verify:
                        check(tool)
                        rows[tool]["verified"] = True
                if r < warmup:
                    continue
                lim = rows["tcp-limit"]
                for tool in ("tcp-limit", "kvlink"):
                    rows[tool] |= {"round": r - warmup, "limit_gbps": lim["gbps"],
                                   "ratio_to_limit": rows[tool]["gbps"] / lim["gbps"],
                                   "cpu_ratio": rows[tool]["cpu_s"] / lim["cpu_s"]}  # fmt: skip
                    yield rows[tool]
    finally:
        with contextlib.suppress(Exception):
            boot.close()
