"""Transfer.cancel: a running push or pull fails at once with TransferCancelledError, the
receiver of a push is told (its handle fails, its destination never counts as received), and
once the wait returned the source is free (nothing reads it: it can be deregistered)."""

from __future__ import annotations

import numpy as np
import pytest

import kvlink
from kvlink.bench.measure import random_bytes as pattern

# every test twice: I/O on the engine thread, and on two I/O threads (conftest.py)
pytestmark = pytest.mark.usefixtures("io_threads_mode")

MiB = 1 << 20
SIZE = 256 * MiB  # far longer to move than the engine takes to see the cancel


@pytest.fixture
def pair(make_agent):
    rx = make_agent("rx", nics="loopback:2", chunk_bytes=MiB)
    tx = make_agent("tx", nics="loopback:2", chunk_bytes=MiB)
    dst = np.zeros(SIZE, np.uint8)
    rx.register(dst, remote_read=True, remote_write=True, name="kv")
    src = pattern(SIZE, seed=21)
    region = tx.register(src)
    tx.add_peer(rx.metadata())
    return tx, rx, src, dst, region


def test_a_cancelled_push_fails_on_both_sides_and_frees_its_source(pair):
    tx, rx, src, _dst, region = pair
    h = tx.push("rx", src=src, dst="kv", notify=b"req-1")
    # announced before its first chunk: the receiver knows of it (a push cancelled before it
    # was announced never reaches the receiver at all)
    inbound = rx.inbound(b"req-1", timeout_s=10)
    assert not h.done, "the push ended before the test could cancel it"
    h.cancel("the request ended")
    with pytest.raises(kvlink.TransferCancelledError, match="cancelled: the request ended"):
        h.wait(timeout_s=20)
    assert h.done and not h.ok and h.bytes_done < SIZE
    tx.deregister(region)  # the fence: no chunk of it is queued or being sent any more
    with pytest.raises(kvlink.TransferError, match="cancelled"):
        inbound.wait(timeout_s=20)
    assert not inbound.ok
    assert rx.notifications(timeout_s=0.2) == [], "a cancelled push delivered its notify"


def test_a_cancelled_pull_fails_and_frees_its_destination(make_agent):
    tx = make_agent("tx", nics="loopback:2", chunk_bytes=MiB)
    rx = make_agent("rx", nics="loopback:2", chunk_bytes=MiB)
    src = pattern(SIZE, seed=22)
    rx.register(src, remote_read=True, name="kv")
    dst = np.zeros(SIZE, np.uint8)
    region = tx.register(dst)
    tx.add_peer(rx.metadata())
    h = tx.pull("rx", src="kv", dst=dst)
    h.cancel()
    with pytest.raises(kvlink.TransferCancelledError, match="was cancelled"):
        h.wait(timeout_s=20)
    tx.deregister(region)  # nothing lands in it any more


def test_cancel_after_the_end_keeps_the_outcome(pair):
    tx, _rx, src, dst, _ = pair
    h = tx.push("rx", src=src[: 4 * MiB], dst="kv")
    h.wait(timeout_s=20)
    h.cancel("too late")
    assert h.wait(timeout_s=5).ok
    assert np.array_equal(dst[: 4 * MiB], src[: 4 * MiB])
    with pytest.raises(kvlink.ArgumentTypeError, match="why: expected a str"):
        h.cancel(3)  # type: ignore[arg-type]


def test_cancel_on_a_closed_agent_is_a_no_op(pair):
    tx, _rx, src, _dst, _ = pair
    h = tx.push("rx", src=src, dst="kv")
    tx.close()
    h.cancel("after close")
    with pytest.raises(kvlink.TransferError):
        h.wait(timeout_s=20)
