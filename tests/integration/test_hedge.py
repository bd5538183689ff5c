"""Hedging cancels the losing copy without resetting its connection."""

from __future__ import annotations

import pytest

import kvlink
from kvlink.bench.measure import random_bytes as pattern
from tests.integration.test_transfer import digest

# every test twice: I/O on the engine thread, and on two I/O threads (conftest.py)
pytestmark = pytest.mark.usefixtures("io_threads_mode")

MiB = 1 << 20


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_back_to_back_pushes_keep_every_path_up(make_agent, spawn_peer, transport):
    # Straggler hedging fires at the tail of most of these pushes over TCP.
    # The losing copy used to be cancelled with an RST: 37 reconnects in 100
    # pushes and paths left DOWN.  Now it is cancelled in the stream.  Same
    # host ("auto": shm paths) nothing is hedged; a stray late copy would
    # show in the digests all the same.
    rx = spawn_peer("rx", nics="loopback:4", transport=transport)
    rx.call("alloc", key="kv", nbytes=16 * MiB, remote_write=True, name="kv")
    tx = make_agent("tx", nics="loopback:4", transport=transport)
    srcs = [pattern(16 * MiB, seed) for seed in (1, 2)]
    for s in srcs:
        tx.register(s)
    tx.add_peer(rx.metadata)
    for i in range(100):
        src = srcs[i % 2]  # alternate contents: a stray late copy would show
        h = tx.push("rx", src=src, dst="kv")
        h.wait(timeout_s=30)
        if i % 10 == 9:
            assert rx.call("digest", key="kv")["digest"] == digest(src), f"push {i}"
    paths = tx.paths()
    # in service: DEGRADED is a rate verdict (a loaded host slows one path for a tick), not a cut
    in_service = {kvlink.PathState.UP, kvlink.PathState.DEGRADED}
    assert all(p.state in in_service for p in paths), paths
    assert sum(p.reconnects for p in paths) == 0, paths
    assert {p.transport for p in paths} == {"tcp" if transport == "tcp" else "shm"}, paths
    if transport == "tcp":
        assert all(not p.last_error for p in paths), paths
    else:  # a loaded receiver's copy may be slow for a tick ("stalled"), never cut
        assert sum(p.hedges for p in paths) == 0, paths
