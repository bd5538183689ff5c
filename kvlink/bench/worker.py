"""One benchmark worker: kvlink agents in a process of their own, driven over JSON lines.

Every benchmark and every two-process test uses this worker: ``kvlink-bench`` (its ``serve``
side serves the same commands on a TCP port), ``kvlink-bench demo`` (the receiver), the
``bench/`` scenarios and the tests' ``spawn_peer``. The driver side is :class:`Worker` (a child
over a pipe, optionally inside a network namespace) or :class:`~kvlink.bench.protocol.Connection`
(a worker served on TCP).

A worker holds any number of agents (``agent`` names one; left out, the first) that share the
worker's buffers (``key`` names one), so a scenario needs one buffer per side whatever the number
of agent configurations it compares. Commands are the public methods of :class:`Agents`; the
protocol is in :mod:`kvlink.bench.protocol`. CPU time is ``getrusage(RUSAGE_SELF)``: every
thread of the process, at the kernel's precise resolution.

Run as ``python -m kvlink.bench``: file descriptor 1 is pointed at stderr first, so
nothing else (a stray print, a C library) can corrupt the answers.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import kvlink
from kvlink import kv

from . import measure
from .protocol import ChildProcess, WorkerError, serve_lines

if TYPE_CHECKING:
    from .tcp_limit import Receiver

# Counters of paths() whose change over one transfer ``wait`` reports.
_DELTA_FIELDS = ("bytes_sent", "chunks_done", "hedges", "reconnects")


def _path_dict(p: kvlink.PathInfo) -> dict[str, Any]:
    return p.__dict__ | {"state": p.state.name}


class Agents:
    """The commands a worker answers; each returns a JSON-able dict."""

    def __init__(self) -> None:
        self.agents: dict[str, kvlink.Agent] = {}
        self.bufs: dict[str, np.ndarray[Any, Any]] = {}
        self.regions: dict[str, kvlink.Region] = {}
        self.xfers: dict[int, tuple[kvlink.Transfer, str, list[dict[str, Any]]]] = {}
        self.armed: tuple[float, float, float] | None = None
        self.receiver: Receiver | None = None

    def _agent(self, name: str | None) -> tuple[str, kvlink.Agent]:
        if name is None:
            if not self.agents:
                raise ValueError("no agent yet: send 'agent' first")
            name = next(iter(self.agents))
        return name, self.agents[name]

    # ---- set-up ------------------------------------------------------------------------

    def agent(self, name: str, nics: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """Creates an agent; answers its metadata, addresses and the memory it took."""
        base = measure.memory()
        # Config.load: KVLINK_* settings apply to every agent, as in production.
        a = kvlink.Agent(name, kvlink.Config.load(nics=nics, **(config or {})))
        self.agents[name] = a
        return {
            "metadata": a.metadata().decode(),
            "addresses": a.addresses,
            "pid": os.getpid(),
            "kvlink_version": kvlink.__version__,
            "rss_base_kib": base["rss_kib"],
            "rss_agent_kib": measure.memory()["rss_kib"],
        }

    def alloc(
        self,
        key: str,
        nbytes: int,
        fill: str | None = None,
        seed: int | None = None,
        register: bool = True,
        agent: str | None = None,
        remote_read: bool = False,
        remote_write: bool = False,
        name: str | None = None,
    ) -> dict[str, Any]:
        """A buffer of ``nbytes``; ``fill``: "zero" (pre-faulted, the default without a seed),
        "random" (:func:`measure.random_bytes` of ``seed``, the default with one), "pattern"
        (:func:`measure.fill_pattern` of ``seed`` or 0) or "none" (untouched pages). Registered
        with ``agent`` unless ``register`` is false."""
        fill = fill or ("random" if seed is not None else "zero")
        if fill == "random":
            buf = measure.random_bytes(nbytes, seed or 0)
        else:
            buf = np.empty(nbytes, np.uint8)
            if fill == "pattern":
                measure.fill_pattern(buf, seed or 0)
            elif fill == "zero":
                buf.fill(0)  # fault every page in now, not during a transfer
            elif fill != "none":
                raise ValueError(f"fill: expected zero, random, pattern or none, got {fill!r}")
        self.bufs[key] = buf
        if not register:
            return {"nbytes": nbytes}
        return {
            "nbytes": nbytes,
            **self.register(key, agent, remote_read=remote_read, remote_write=remote_write,
                            name=name),
        }  # fmt: skip

    def register(
        self,
        key: str,
        agent: str | None = None,
        remote_read: bool = False,
        remote_write: bool = False,
        name: str | None = None,
    ) -> dict[str, Any]:
        _, a = self._agent(agent)
        r = a.register(self.bufs[key], remote_read=remote_read, remote_write=remote_write,
                       name=name)  # fmt: skip
        self.regions[key] = r
        # the metadata now carries the new region's access key: peers need this one
        return {"region": r.id, "metadata": a.metadata().decode()}

    def deregister(self, key: str, agent: str | None = None) -> dict[str, Any]:
        self._agent(agent)[1].deregister(self.regions.pop(key))
        return {}

    def hello(self, agent: str | None = None) -> dict[str, Any]:
        """What a remote initiator needs: the agent's metadata and the registered buffers."""
        _, a = self._agent(agent)
        return {
            "metadata": a.metadata().decode(),
            "regions": {k: {"id": r.id, "nbytes": int(self.bufs[k].nbytes)}
                        for k, r in self.regions.items()},
        }  # fmt: skip

    def add_peer(self, metadata: str, agent: str | None = None) -> dict[str, Any]:
        return {"peer": self._agent(agent)[1].add_peer(metadata.encode())}

    def _view(self, key: str, layers: int, planes: int, num_blocks: int) -> list[Any]:
        return list(self.bufs[key].reshape(layers, planes, num_blocks, -1))

    def layout(
        self, key: str, layers: int, planes: int, num_blocks: int, agent: str | None = None
    ) -> dict[str, Any]:
        """The PagedLayout of buffer ``key`` seen as [layers][planes][num_blocks][block]."""
        lay = kv.PagedLayout.from_tensors(
            self._agent(agent)[1], self._view(key, layers, planes, num_blocks), planes=planes
        )
        return {"layout": lay.to_dict()}

    # ---- transfers ---------------------------------------------------------------------

    def _submit(self, agent: str, h: kvlink.Transfer, wait: float | None) -> dict[str, Any]:
        before = [_path_dict(p) for p in self.agents[agent].paths()]
        self.xfers[h.id] = (h, agent, before)
        if wait is not None:
            h.wait(wait)
        return {"id": h.id, "state": h.state.name, "t_submit_ns": h.info().t_submit_ns}

    def _move(
        self,
        op: str,
        peer: str,
        agent: str | None = None,
        segments: Sequence[Sequence[int]] | None = None,
        local: str | None = None,
        remote: str | int | None = None,
        nbytes: int | None = None,
        notify: str | None = None,
        wait: float | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """``op`` is "push" or "pull": of ``segments`` (rows of kvlink.Segment), or between
        buffer ``local`` and the remote region ``remote``; ``notify`` is hex; waits ``wait``
        seconds if given; ``timeout_s``: the transfer's deadline (None: the config's).
        Answers the transfer's id."""
        name, a = self._agent(agent)
        kw: dict[str, Any] = {
            "notify": bytes.fromhex(notify) if notify else None,
            "timeout_s": timeout_s,
        }
        if segments is not None:
            kw["segments"] = [kvlink.Segment(*s) for s in segments]
        else:
            if local is None or remote is None:
                raise ValueError(f"{op}: give segments, or local and remote")
            buf = self.bufs[local]
            kw.update(src=buf, dst=remote) if op == "push" else kw.update(src=remote, dst=buf)
            kw["nbytes"] = nbytes
        fn = a.push if op == "push" else a.pull
        return self._submit(name, fn(peer, **kw), wait)

    push = functools.partialmethod(_move, "push")
    pull = functools.partialmethod(_move, "pull")

    def push_kv(
        self,
        peer: str,
        key: str,
        dst_layout: dict[str, Any],
        layers: int,
        planes: int,
        num_blocks: int,
        agent: str | None = None,
        notify: str | None = None,
    ) -> dict[str, Any]:
        """Submits a push of every block of every layer of buffer ``key`` (kv.block_segments)."""
        name, a = self._agent(agent)
        src = kv.PagedLayout.from_tensors(a, self._view(key, layers, planes, num_blocks),
                                          planes=planes)  # fmt: skip
        blocks = np.arange(num_blocks)
        segs = kv.block_segments(src, kv.PagedLayout.from_dict(dst_layout), blocks, blocks)
        tag = bytes.fromhex(notify) if notify else None
        out = self._submit(name, a.push(peer, segments=segs, notify=tag), None)
        out["segments"] = len(segs)
        out["bytes"] = int(segs["len"].sum())
        return out

    def wait(
        self, id: int, wait_s: float, capture: bool = False, events: bool = False
    ) -> dict[str, Any]:
        """Waits for transfer ``id``: its info, the per-path counters it moved and, with
        ``events``, its chunk events. A failure raises, or with ``capture`` is in ``error``."""
        h, agent, before = self.xfers[id]
        t0 = time.monotonic()
        err = None
        try:
            h.wait(wait_s)
        except kvlink.KvlinkError as exc:
            if not capture:
                raise
            err = f"{type(exc).__name__}: {exc}"
        waited = time.monotonic() - t0
        i = h.info()
        evs = []
        if events and err is None:
            evs = [
                [e.index, e.path, e.nbytes, e.layers.start, e.layers.stop, e.t_ns]
                for e in h.chunks(timeout_s=0)
            ]
        after = [_path_dict(p) for p in self.agents[agent].paths()]
        delta = [{k: b[k] - a[k] for k in _DELTA_FIELDS}
                 for a, b in zip(before, after, strict=False)]  # fmt: skip
        return {
            "error": err,
            "waited_s": waited,
            "state": i.state.name,
            "bytes_total": i.bytes_total,
            "t_submit_ns": i.t_submit_ns,
            "t_first_ns": i.t_first_byte_ns,
            "t_done_ns": i.t_done_ns,
            "retries": i.retries,
            "chunks": i.chunks_total,
            "events": evs,
            "paths": after,
            "path_delta": delta,
        }

    def chunks(self, id: int, wait_s: float) -> dict[str, Any]:
        """Every chunk event of transfer ``id`` until it ends (or ``wait_s`` passes)."""
        h = self.xfers[id][0]
        return {
            "events": [
                [e.index, e.path, e.nbytes, e.layers.start, e.layers.stop, e.t_ns]
                for e in h.chunks(timeout_s=wait_s)
            ],
            "t_submit_ns": h.info().t_submit_ns,
        }

    def push_timed(
        self,
        peer: str,
        local: str,
        remote: str,
        nbytes: int,
        reps: int,
        notify: bool,
        deadline_s: float,
        agent: str | None = None,
    ) -> dict[str, Any]:
        """``reps`` pushes one after the other, each timed here: wall times, CPU, path bytes."""
        _, a = self._agent(agent)
        tag = b"bench" if notify else None
        times, infos = [], []
        sent0 = [p.bytes_sent for p in a.paths()]
        u0, s0 = measure.cpu_times()
        for _ in range(reps):
            t0 = time.perf_counter()
            h = a.push(peer, src=self.bufs[local], dst=remote, nbytes=nbytes, notify=tag,
                       timeout_s=deadline_s)  # fmt: skip
            h.wait(deadline_s)
            times.append(time.perf_counter() - t0)
            infos.append(h.info())
        u1, s1 = measure.cpu_times()
        paths = a.paths()
        return {
            "times_s": times,
            "user_s": u1 - u0,
            "sys_s": s1 - s0,
            "chunks_total": infos[-1].chunks_total,
            "retries": sum(i.retries for i in infos),
            "engine_s": [(i.t_done_ns - i.t_submit_ns) / 1e9 for i in infos],
            "path_bytes": [p.bytes_sent for p in paths],
            "path_bytes_before": sent0,
            "paths_states": [
                f"{p.index}:{p.state.name}:{p.local}->{p.remote}:{p.last_error}" for p in paths
            ],
            "path_est_gbps": [p.est_gbps for p in paths],
        }

    def prepare(
        self, peer: str, wait_s: float, nbytes: int | None = None, agent: str | None = None
    ) -> dict[str, Any]:
        ps = self._agent(agent)[1].prepare(peer, nbytes=nbytes, timeout_s=wait_s)
        return {"states": [p.state.name for p in ps]}

    def notifications(self, wait_s: float = 0.0, agent: str | None = None) -> dict[str, Any]:
        ns = self._agent(agent)[1].notifications(timeout_s=wait_s)
        return {
            "notifications": [{"peer": n.peer, "tag": n.tag.hex(), "op": n.op.name} for n in ns]
        }

    def paths(self, agent: str | None = None) -> dict[str, Any]:
        return {"paths": [_path_dict(p) for p in self._agent(agent)[1].paths()]}

    def add_relay(self, metadata: str, agent: str | None = None) -> dict[str, Any]:
        return {"relay": self._agent(agent)[1].add_relay(metadata)}

    def relay_stats(self, agent: str | None = None) -> dict[str, Any]:
        return self._agent(agent)[1].relay_stats()

    # ---- data --------------------------------------------------------------------------

    def fill(self, key: str, seed: int = 0, nbytes: int | None = None) -> dict[str, Any]:
        """The first ``nbytes`` of buffer ``key`` := the pattern of ``seed``."""
        measure.fill_pattern(self.bufs[key][:nbytes], seed)
        return {}

    def zero(self, key: str) -> dict[str, Any]:
        self.bufs[key].fill(0)
        return {}

    def verify(self, key: str, nbytes: int | None = None, seed: int = 0) -> dict[str, Any]:
        """Bytes of buffer ``key`` that differ from the pattern of ``seed``."""
        bad, first = measure.check_pattern(self.bufs[key], nbytes, seed)
        return {"corrupt_bytes": bad, "first_bad_offset": first}

    def digest(self, key: str, offset: int = 0, nbytes: int | None = None) -> dict[str, Any]:
        buf = self.bufs[key]
        end = buf.nbytes if nbytes is None else offset + nbytes
        return {"digest": measure.digest(buf[offset:end])}

    def read(self, key: str, offset: int, nbytes: int) -> dict[str, Any]:
        return {"hex": self.bufs[key][offset : offset + nbytes].tobytes().hex()}

    # ---- the tcp-limit baseline (kvlink/bench/tcp_limit.py) ----------------------------

    def tcp_limit_listen(self, key: str, hosts: list[str], nbytes: int) -> dict[str, Any]:
        """Listens on each of ``hosts``; a thread then receives the first ``nbytes`` of buffer
        ``key`` over one connection to each (the baseline's plain TCP); answers the ports."""
        from .tcp_limit import Receiver

        if self.receiver is not None:
            raise ValueError("tcp_limit_listen: the previous move's result was not taken")
        self.receiver = Receiver(hosts, self.bufs[key][:nbytes])
        return {"ports": self.receiver.ports}

    def tcp_limit_result(self, timeout_s: float) -> dict[str, Any]:
        """Waits for the move :meth:`tcp_limit_listen` started: its wall and CPU seconds."""
        if self.receiver is None:
            raise ValueError("tcp_limit_result before tcp_limit_listen")
        rx, self.receiver = self.receiver, None
        return rx.result(timeout_s)

    # ---- clocks ------------------------------------------------------------------------

    def now(self) -> dict[str, Any]:
        return {"ns": time.monotonic_ns()}

    def cpu(self) -> dict[str, Any]:
        return {"cpu_s": measure.cpu_seconds()}

    def stats(self) -> dict[str, Any]:
        return dict(measure.memory())

    def arm(self) -> dict[str, Any]:
        """Starts the wall and CPU clocks that :meth:`collect` stops."""
        self.armed = (time.perf_counter(), *measure.cpu_times())
        return {}

    def collect(self, count: int, timeout_s: float, agent: str | None = None) -> dict[str, Any]:
        """Waits for ``count`` notifications, then stops the clocks :meth:`arm` started."""
        if self.armed is None:
            raise ValueError("collect before arm")
        _, a = self._agent(agent)
        got: list[kvlink.Notification] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"collect: {len(got)} of {count} notifications in {timeout_s} s")
            got += a.notifications(timeout_s=left)
        t1 = time.perf_counter()
        u1, s1 = measure.cpu_times()
        t0, u0, s0 = self.armed
        self.armed = None
        return {"wall_s": t1 - t0, "user_s": u1 - u0, "sys_s": s1 - s0, "count": len(got),
                **measure.memory()}  # fmt: skip

    def exit(self) -> dict[str, Any]:
        """Closes every agent; the worker leaves after answering."""
        for a in self.agents.values():
            a.close()
        self.agents.clear()
        return {}


# ---- the driver side -----------------------------------------------------------------------


class Worker(ChildProcess):
    """``python -m kvlink.bench`` (:func:`main`) in a child process (``prefix``: e.g. a testbed
    namespace's ``ip netns exec``), spoken to in JSON lines.

    With ``name`` and ``nics`` it also creates its first agent and keeps that agent's
    ``metadata`` (bytes) and ``addresses``.

    Raises:
        WorkerError: the child did not start or its agent could not be made.
    """

    def __init__(
        self,
        tag: str,
        name: str | None = None,
        nics: str | None = None,
        config: Mapping[str, Any] | None = None,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        answer_s: float = 60.0,
    ) -> None:
        err = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        p = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvlink.bench"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, **(env or {})},
        )
        super().__init__(tag, p, err)
        self._named = name is not None
        self.addresses: list[tuple[str, int]] = []
        if name is not None:
            try:
                rep = self.call("agent", answer_s=answer_s, name=name, nics=nics or "auto",
                                config=dict(config or {}))  # fmt: skip
            except WorkerError:
                self.close()
                raise
            self.addresses = [(str(h), int(p)) for h, p in rep["addresses"]]

    @property
    def metadata(self) -> bytes:
        """The first agent's metadata as of now: it carries the access keys of the regions
        registered so far (asked of the child each time)."""
        if not self._named:
            raise WorkerError(f"worker {self.tag!r} made no agent of its own")
        return str(self.call("hello")["metadata"]).encode()


def main() -> int:
    """Serves :class:`Agents` on stdin/stdout until "exit" or end of input."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # from here on a stray write to fd 1 lands on stderr, not in the answers
    serve_lines(Agents(), sys.stdin, proto)
    return 0
