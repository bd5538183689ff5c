"""A stall is not a failure: a receiver that pauses (SIGSTOP, or a host whose
cores are busy) delays a push but does not fail it while its deadline has
time left."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvlink
from kvlink.bench import Worker
from kvlink.bench.measure import random_bytes as pattern
from tests.integration.test_transfer import digest

# every test twice: I/O on the engine thread, and on two I/O threads (conftest.py)
# the stall rule fires after silences of a given length: timing (pyproject.toml)
pytestmark = [pytest.mark.usefixtures("io_threads_mode"), pytest.mark.timing]

MiB = 1 << 20


@contextlib.contextmanager
def paused(peer: Worker) -> Iterator[None]:
    os.kill(peer.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(peer.pid, signal.SIGCONT)


def wait_started(h: kvlink.Transfer, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while h.bytes_done == 0 and not h.done:
        assert time.monotonic() < deadline, "the push did not start"
        time.sleep(0.005)


@pytest.mark.parametrize("paths", [1, 4])
def test_receiver_paused_mid_push_is_verified(make_agent, spawn_peer, paths):
    # Before: the path was cut 200 ms into the pause and the push failed
    # with "all 1 path(s) are down" and 59 s of its deadline left.
    size = 512 * MiB
    rx = spawn_peer("rx", nics=f"loopback:{paths}")
    rx.call("alloc", key="kv", nbytes=size, remote_write=True, name="kv")
    tx = make_agent("tx", nics=f"loopback:{paths}")
    src = pattern(size, seed=paths)
    tx.register(src)
    tx.add_peer(rx.metadata)
    h = tx.push("rx", src=src, dst="kv")
    wait_started(h)
    assert not h.done, "the push finished before the pause; nothing was tested"
    with paused(rx):
        time.sleep(1.5)
    h.wait(timeout_s=60)
    assert rx.call("digest", key="kv")["digest"] == digest(src)
    states = [p.state for p in tx.paths()]
    assert set(states) <= {kvlink.PathState.UP, kvlink.PathState.DEGRADED}, tx.paths()


def test_push_submitted_while_paths_are_reprobed_waits_for_them(make_agent, spawn_peer):
    # A pause long enough that the stalled path is cut and re-probed: a push
    # submitted meanwhile used to fail within 1 ms ("every path is down").
    # TCP: the stall shows as bytes the paused receiver's kernel holds; on a
    # same-host path the descriptor is out and nothing is cut (the push waits).
    rx = spawn_peer("rx", nics="loopback:1", transport="tcp")
    rx.call("alloc", key="kv", nbytes=256 * MiB, remote_write=True, name="kv")
    tx = make_agent("tx", nics="loopback:1", transport="tcp")
    src = pattern(256 * MiB, seed=5)
    small = np.full(MiB, 9, np.uint8)
    tx.register(src)
    tx.register(small)
    tx.add_peer(rx.metadata)
    first = tx.push("rx", src=src, dst="kv")
    wait_started(first)
    with paused(rx):
        deadline = time.monotonic() + 10
        while tx.paths()[0].state not in (kvlink.PathState.DOWN, kvlink.PathState.PROBING):
            assert time.monotonic() < deadline, f"the path was never cut: {tx.paths()}"
            time.sleep(0.02)
        second = tx.push("rx", src=small, dst="kv", nbytes=MiB)
        time.sleep(0.3)
        assert not second.done, f"failed while the path was re-probed: {second.error}"
    first.wait(timeout_s=30)
    second.wait(timeout_s=30)
    assert rx.call("digest", key="kv", nbytes=MiB)["digest"] == digest(small)
