"""One kvlink agent in its own process, driven by bench/loopback.py.

Protocol: one JSON object per line.  Commands arrive on stdin, each is
answered by exactly one line on the original stdout: ``{"ok": true, ...}`` or
``{"ok": false, "error": "...", "type": "..."}``.  File descriptor 1 is pointed
at stderr at start-up so that nothing else (a stray print, a C library) can
corrupt the protocol stream.

Commands (``cmd`` field):
    init      role ("tx"/"rx"), size, nics, config (dict of Config overrides),
              touch (pre-fault the buffer), name.  Allocates, fills and
              registers the buffer; answers metadata and memory figures.
    add_peer  metadata: connects to the other agent.
    warm      peer, nbytes: one untimed push (tx only).
    arm       starts the CPU clock (rx: before the sender pushes).
    push      peer, nbytes, reps, notify, deadline_s: timed pushes (tx only).
    collect   count, timeout_s: waits for ``count`` notifications and stops
              the CPU clock started by ``arm`` (rx only).
    verify    nbytes: checks the received pattern (rx only, untimed).
    stats     current and peak RSS.
    exit      closes the agent and leaves.

CPU is ``resource.getrusage(RUSAGE_SELF)``: every thread of the process,
including threads that exited, at the kernel's precise (not tick-sampled)
resolution.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any

import numpy as np

# Before anything that could write to stdout is imported.
from _worker_loop import serve

import kvlink

_BLOCK = 1 << 16  # uint64 words per fill/verify step: 512 KiB temporaries, lost in the RSS


def _cpu() -> tuple[float, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _mem() -> dict[str, Any]:
    return {
        "rss_kib": _status_kib("VmRSS"),
        "hwm_kib": _status_kib("VmHWM"),
        "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def _fill(buf: np.ndarray[Any, Any]) -> None:
    """Word i holds i: a chunk landing at the wrong offset cannot go unseen.
    Filled in blocks so the pattern never needs a second full-size array."""
    words = buf.view(np.uint64)
    for lo in range(0, len(words), _BLOCK):
        hi = min(lo + _BLOCK, len(words))
        words[lo:hi] = np.arange(lo, hi, dtype=np.uint64)


def _verify(buf: np.ndarray[Any, Any], nbytes: int) -> int:
    """Index of the first wrong uint64 word in the first nbytes, or -1."""
    words = buf[: nbytes - nbytes % 8].view(np.uint64)
    for lo in range(0, len(words), _BLOCK):
        hi = min(lo + _BLOCK, len(words))
        bad = np.flatnonzero(words[lo:hi] != np.arange(lo, hi, dtype=np.uint64))
        if len(bad):
            return lo + int(bad[0])
    return -1


class Worker:
    def __init__(self) -> None:
        self.agent: kvlink.Agent | None = None
        self.buf: np.ndarray[Any, Any] | None = None
        self.role = ""
        self.armed: tuple[float, float, float] | None = None

    def init(
        self, role: str, size: int, nics: str, config: dict[str, Any], touch: bool, name: str
    ) -> dict[str, Any]:
        base = _mem()
        self.role = role
        cfg = kvlink.Config(nics=nics, **config)
        self.agent = kvlink.Agent(name, cfg)
        after_agent = _mem()
        size = (size + 7) // 8 * 8
        if role == "tx":
            self.buf = np.empty(size, np.uint8)
            _fill(self.buf)
            self.agent.register(self.buf)
        elif role == "rx":
            self.buf = np.empty(size, np.uint8)
            if touch:
                self.buf[:] = 0  # fault every page in now, not during the transfer
            self.agent.register(self.buf, remote_write=True, name="kv")
        else:
            raise ValueError(f"role: expected 'tx' or 'rx', got {role!r}")
        return {
            "pid": os.getpid(),
            "metadata": self.agent.metadata().decode(),
            "registered_bytes": size,
            "rss_base_kib": base["rss_kib"],
            "rss_agent_kib": after_agent["rss_kib"],
            "kvlink_version": kvlink.__version__,
        }

    def add_peer(self, metadata: str) -> dict[str, Any]:
        assert self.agent is not None
        return {"peer": self.agent.add_peer(metadata.encode())}

    def warm(self, peer: str, nbytes: int) -> dict[str, Any]:
        assert self.agent is not None and self.buf is not None
        self.agent.push(peer, src=self.buf, dst="kv", nbytes=nbytes).wait(120)
        return {}

    def arm(self) -> dict[str, Any]:
        self.armed = (time.perf_counter(), *_cpu())
        return {}

    def push(
        self, peer: str, nbytes: int, reps: int, notify: bool, deadline_s: float
    ) -> dict[str, Any]:
        assert self.agent is not None and self.buf is not None
        tag = b"bench" if notify else None
        times = []
        infos = []
        sent0 = [p.bytes_sent for p in self.agent.paths()]
        u0, s0 = _cpu()
        for _ in range(reps):
            t0 = time.perf_counter()
            h = self.agent.push(
                peer, src=self.buf, dst="kv", nbytes=nbytes, notify=tag, timeout_s=deadline_s
            )
            h.wait(deadline_s)
            times.append(time.perf_counter() - t0)
            infos.append(h.info())
        u1, s1 = _cpu()
        paths = self.agent.paths()
        last = infos[-1]
        return {
            "times_s": times,
            "user_s": u1 - u0,
            "sys_s": s1 - s0,
            "chunks_total": last.chunks_total,
            "retries": sum(i.retries for i in infos),
            "engine_s": [(i.t_done_ns - i.t_submit_ns) / 1e9 for i in infos],
            "path_bytes": [p.bytes_sent for p in paths],
            "path_bytes_before": sent0,
            "paths_states": [
                f"{p.index}:{p.state.name}:{p.local}->{p.remote}:{p.last_error}" for p in paths
            ],
            "path_est_gbps": [p.est_gbps for p in paths],
        }

    def collect(self, count: int, timeout_s: float) -> dict[str, Any]:
        assert self.agent is not None and self.armed is not None
        got: list[kvlink.Notification] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"collect: {len(got)} of {count} notifications in {timeout_s} s")
            got += self.agent.notifications(timeout_s=left)
        t1 = time.perf_counter()
        u1, s1 = _cpu()
        t0, u0, s0 = self.armed
        self.armed = None
        return {"wall_s": t1 - t0, "user_s": u1 - u0, "sys_s": s1 - s0, "count": len(got), **_mem()}

    def verify(self, nbytes: int) -> dict[str, Any]:
        assert self.buf is not None
        return {"first_bad_word": _verify(self.buf, nbytes)}

    def stats(self) -> dict[str, Any]:
        return _mem()

    def exit(self) -> dict[str, Any]:
        if self.agent is not None:
            self.agent.close()
        return {}


def main() -> int:
    return serve(Worker())


if __name__ == "__main__":
    sys.exit(main())
