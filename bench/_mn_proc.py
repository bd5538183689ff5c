"""kvlink agents in one process inside a testbed namespace, driven by bench/multinic.py.

Protocol: one JSON object per line.  Commands arrive on stdin, each is answered
by exactly one line on the original stdout: ``{"ok": true, ...}`` or
``{"ok": false, "error": "...", "type": "..."}``.  File descriptor 1 is pointed
at stderr at start-up so nothing else (a stray print, a C library) can corrupt
the protocol stream.

One process holds several agents (one per configuration under test: 4 paths,
1 path, round-robin ...) that share the process's buffers, so a scenario needs
only one 2 GiB buffer per side whatever the number of configurations.

Commands (``cmd`` field; ``agent`` names one of this process's agents):
    agent       name, nics, config: creates an agent; answers its metadata.
    alloc       key, nbytes, fill ("pattern": word i holds i; "zero": pre-faulted zeros).
    register    agent, key, remote_write, name: registers buffer ``key`` with the agent.
    add_peer    agent, metadata.
    layout      agent, key, layers, planes, num_blocks: the PagedLayout of buffer ``key``
                viewed as [layers][planes][num_blocks][block].
    push        agent, peer, key, remote, nbytes: submits a push, does not wait.
    push_kv     agent, peer, key, dst_layout, layers, planes, num_blocks: submits a push of
                every block of every layer (kv.block_segments), does not wait.
    wait        id, wait_s: waits for the transfer; answers its info, chunk events and the
                per-path counters it moved (deltas of paths() since the submit).
    paths       agent: paths() as dicts.
    zero        key: overwrites a buffer with zeros (before a transfer into it).
    verify      key, nbytes: counts bytes that differ from the pattern.
    exit        closes every agent and leaves.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

# Before anything that could write to stdout is imported.
from _worker_loop import serve

import kvlink
from kvlink import kv

_BLOCK = 1 << 20  # uint64 words per fill/verify step: 8 MiB temporaries
# Counters of paths() whose change over one transfer is reported.
_DELTA_FIELDS = ("bytes_sent", "chunks_done", "hedges", "reconnects")


def _fill(buf: np.ndarray[Any, Any]) -> None:
    """Word i holds i: a chunk landing at the wrong offset cannot go unseen."""
    words = buf.view(np.uint64)
    for lo in range(0, len(words), _BLOCK):
        hi = min(lo + _BLOCK, len(words))
        words[lo:hi] = np.arange(lo, hi, dtype=np.uint64)


def _corrupt_bytes(buf: np.ndarray[Any, Any], nbytes: int) -> tuple[int, int]:
    """(bytes that differ from the pattern in the first nbytes, offset of the first or -1)."""
    words = buf[:nbytes].view(np.uint64)
    bad_total, first = 0, -1
    for lo in range(0, len(words), _BLOCK):
        hi = min(lo + _BLOCK, len(words))
        want = np.arange(lo, hi, dtype=np.uint64)
        bad = np.flatnonzero(words[lo:hi] != want)
        if len(bad):
            got_b = words[lo:hi][bad].view(np.uint8)
            want_b = want[bad].view(np.uint8)
            bad_total += int(np.count_nonzero(got_b != want_b))
            if first < 0:
                first = (lo + int(bad[0])) * 8
    return bad_total, first


def _path_dict(p: kvlink.PathInfo) -> dict[str, Any]:
    return p.__dict__ | {"state": p.state.name}


class Worker:
    def __init__(self) -> None:
        self.agents: dict[str, kvlink.Agent] = {}
        self.bufs: dict[str, np.ndarray[Any, Any]] = {}
        self.xfers: dict[int, tuple[kvlink.Transfer, str, list[dict[str, Any]]]] = {}
        self.next_id = 1

    def agent(self, name: str, nics: str, config: dict[str, Any]) -> dict[str, Any]:
        a = kvlink.Agent(name, kvlink.Config(nics=nics, **config))
        self.agents[name] = a
        return {"metadata": a.metadata().decode(), "addresses": a.addresses, "pid": os.getpid()}

    def alloc(self, key: str, nbytes: int, fill: str) -> dict[str, Any]:
        if nbytes % 8:
            raise ValueError(f"nbytes: {nbytes} is not a multiple of 8")
        buf = np.empty(nbytes, np.uint8)
        if fill == "pattern":
            _fill(buf)
        elif fill == "zero":
            buf[:] = 0  # fault every page in now, not during a transfer
        else:
            raise ValueError(f"fill: expected 'pattern' or 'zero', got {fill!r}")
        self.bufs[key] = buf
        return {}

    def register(
        self, agent: str, key: str, remote_write: bool = False, name: str | None = None
    ) -> dict[str, Any]:
        r = self.agents[agent].register(self.bufs[key], remote_write=remote_write, name=name)
        return {"region": r.id}

    def add_peer(self, agent: str, metadata: str) -> dict[str, Any]:
        return {"peer": self.agents[agent].add_peer(metadata.encode())}

    def _view(self, key: str, layers: int, planes: int, num_blocks: int) -> list[Any]:
        return list(self.bufs[key].reshape(layers, planes, num_blocks, -1))

    def layout(
        self, agent: str, key: str, layers: int, planes: int, num_blocks: int
    ) -> dict[str, Any]:
        lay = kv.PagedLayout.from_tensors(
            self.agents[agent], self._view(key, layers, planes, num_blocks), planes=planes
        )
        return {"layout": lay.to_dict()}

    def _submit(self, agent: str, h: kvlink.Transfer) -> dict[str, Any]:
        before = [_path_dict(p) for p in self.agents[agent].paths()]
        xid = self.next_id
        self.next_id += 1
        self.xfers[xid] = (h, agent, before)
        return {"id": xid, "t_submit_ns": h.info().t_submit_ns}

    def push(self, agent: str, peer: str, key: str, remote: str, nbytes: int) -> dict[str, Any]:
        a = self.agents[agent]
        return self._submit(agent, a.push(peer, src=self.bufs[key], dst=remote, nbytes=nbytes))

    def push_kv(
        self,
        agent: str,
        peer: str,
        key: str,
        dst_layout: dict[str, Any],
        layers: int,
        planes: int,
        num_blocks: int,
    ) -> dict[str, Any]:
        a = self.agents[agent]
        src = kv.PagedLayout.from_tensors(
            a, self._view(key, layers, planes, num_blocks), planes=planes
        )
        dst = kv.PagedLayout.from_dict(dst_layout)
        blocks = np.arange(num_blocks)
        segs = kv.block_segments(src, dst, blocks, blocks)
        out = self._submit(agent, a.push(peer, segments=segs))
        out["segments"] = len(segs)
        return out

    def wait(self, id: int, wait_s: float) -> dict[str, Any]:
        h, agent, before = self.xfers.pop(id)
        t0 = time.monotonic()
        err = None
        try:
            h.wait(wait_s)
        except kvlink.KvlinkError as exc:
            err = f"{type(exc).__name__}: {exc}"
        waited = time.monotonic() - t0
        i = h.info()
        events = (
            [
                [e.index, e.path, e.nbytes, e.layers.start, e.layers.stop, e.t_ns]
                for e in h.chunks(timeout_s=0)
            ]
            if err is None
            else []
        )
        after = [_path_dict(p) for p in self.agents[agent].paths()]
        delta = [
            {k: b[k] - a[k] for k in _DELTA_FIELDS} for a, b in zip(before, after, strict=False)
        ]
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
            "events": events,
            "paths": after,
            "path_delta": delta,
        }

    def paths(self, agent: str) -> dict[str, Any]:
        return {"paths": [_path_dict(p) for p in self.agents[agent].paths()]}

    def zero(self, key: str) -> dict[str, Any]:
        self.bufs[key][:] = 0
        return {}

    def verify(self, key: str, nbytes: int) -> dict[str, Any]:
        bad, first = _corrupt_bytes(self.bufs[key], nbytes)
        return {"corrupt_bytes": bad, "first_bad_offset": first}

    def exit(self) -> dict[str, Any]:
        for a in self.agents.values():
            a.close()
        self.agents.clear()
        return {}


def main() -> int:
    return serve(Worker())


if __name__ == "__main__":
    sys.exit(main())
