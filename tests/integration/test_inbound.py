"""The receiver's handle of a push (Agent.inbound): announced before the
first chunk, per-layer progress on the receiving side, one notification."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

import kvlink
from kvlink.bench.measure import random_bytes as pattern
from tests import wire_client as wc

# every test twice: I/O on the engine thread, and on two I/O threads (conftest.py)
pytestmark = pytest.mark.usefixtures("io_threads_mode")

MiB = 1 << 20
LAYERS = 8
LAYER_BYTES = 8 * MiB


@pytest.fixture
def pushed(make_agent, spawn_peer):
    """A receiver here and a sender in another process, 8 layers of 8 MiB."""
    rx = make_agent("rx", nics="loopback:4")
    dst = np.zeros(LAYERS * LAYER_BYTES, np.uint8)
    rid = rx.register(dst, remote_write=True, name="kv").id
    tx = spawn_peer("tx", nics="loopback:4")
    sid = tx.call("alloc", key="src", nbytes=dst.nbytes, seed=3)["region"]
    tx.call("add_peer", metadata=rx.metadata().decode())
    segs = [(sid, i * LAYER_BYTES, rid, i * LAYER_BYTES, LAYER_BYTES, i) for i in range(LAYERS)]

    def push(tag: bytes) -> int:
        return int(tx.call("push", peer="rx", segments=segs, notify=tag.hex())["id"])

    return rx, dst, tx, push


def test_layer_is_in_place_when_wait_layer_returns(pushed):
    rx, dst, tx, push = pushed
    want = pattern(dst.nbytes, seed=3)
    xid = push(b"req-7")
    h = rx.inbound(b"req-7", timeout_s=10)
    assert (h.peer, h.tag, h.nbytes, h.layers, h.transfer_id) == (
        "tx",
        b"req-7",
        dst.nbytes,
        LAYERS,
        xid,
    )
    for layer in range(LAYERS):
        h.wait_layer(layer, timeout_s=30)
        assert h.layer_done(layer)
        span = slice(layer * LAYER_BYTES, (layer + 1) * LAYER_BYTES)
        assert np.array_equal(dst[span], want[span]), f"layer {layer} not in place"
    h.wait(timeout_s=30)
    assert h.ok and h.done and h.layers_done() == LAYERS and h.bytes_done == dst.nbytes
    assert np.array_equal(dst, want)
    events = list(h.chunks(timeout_s=5))
    assert sum(e.nbytes for e in events) == dst.nbytes
    assert sorted(x for e in events for x in e.layers) == list(range(LAYERS))
    tx.call("wait", id=xid, wait_s=30)
    notes = rx.notifications(timeout_s=5) + rx.notifications(timeout_s=0.3)
    assert [(n.peer, n.tag) for n in notes] == [("tx", b"req-7")]


def test_tags_pick_their_push_and_none_takes_the_next(pushed):
    rx, _dst, _tx, push = pushed
    first, second = push(b"a"), push(b"b")
    hb = rx.inbound(b"b", timeout_s=10)
    ha = rx.inbound(timeout_s=10)
    assert (ha.tag, ha.transfer_id, hb.tag, hb.transfer_id) == (b"a", first, b"b", second)
    ha.wait(timeout_s=30)
    hb.wait(timeout_s=30)
    with pytest.raises(kvlink.TransferTimeoutError):  # each push is handed out once
        rx.inbound(b"a", timeout_s=0.2)


@pytest.mark.timing
def test_inbound_times_out_and_checks_its_arguments(make_agent):
    rx = make_agent("rx")
    t0 = time.monotonic()
    with pytest.raises(kvlink.TransferTimeoutError, match="no inbound push"):
        rx.inbound(timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    with pytest.raises(kvlink.InvalidArgumentError, match="tag"):
        rx.inbound("req-1", timeout_s=0)  # type: ignore[arg-type]
    with pytest.raises(kvlink.InvalidArgumentError, match="timeout_s"):
        rx.inbound(timeout_s=-1)


def test_sender_closing_mid_push_fails_the_inbound_handle(make_agent, spawn_peer):
    rx = make_agent("rx", nics="loopback:1")
    dst = np.zeros(1 << 30, np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    tx = spawn_peer("tx", nics="loopback:1")
    tx.call("alloc", key="src", nbytes=dst.nbytes)
    tx.call("add_peer", metadata=rx.metadata().decode())
    tx.call("push", peer="rx", local="src", remote="kv", notify=b"doomed".hex())
    h = rx.inbound(b"doomed", timeout_s=10)
    assert not h.done, "the push finished before the sender closed; nothing was tested"
    tx.close()  # closes the sender's agent: its push fails, END says so
    with pytest.raises(kvlink.TransferError, match="closed"):
        h.wait(timeout_s=30)


def test_data_without_announce_is_refused_and_huge_chunk_index_is_harmless(make_agent):
    # a DATA frame naming chunk 2**31 of an unannounced push used to spin the
    # engine forever (its chunk table grew by doubling a uint32 that wrapped)
    rx = make_agent("rx")
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    key = wc.key_of(rx.metadata(), rid)
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99)
    try:
        payload = b"\x01" * 64
        for chunk in (0, 1 << 31):
            s.sendall(
                wc.data(5, chunk, 1, rid, 64, key) + payload + struct.pack("<I", wc.crc(payload))
            )
            _, got_chunk, _, status = struct.unpack_from("<QIII", wc.recv_until(s, wc.ACK))
            assert (got_chunk, status) == (chunk, kvlink.ErrorCode.PROTOCOL)
        # announced: accepted; a chunk outside the announced count: refused
        s.sendall(wc.announce(6, 64, 1) + wc.data(6, 0, 1, rid, 64, key) + payload)
        s.sendall(struct.pack("<I", wc.crc(payload)))
        assert struct.unpack_from("<QIII", wc.recv_until(s, wc.ACK))[3] == 0
        s.sendall(wc.data(6, 1, 1, rid, 64, key) + payload + struct.pack("<I", wc.crc(payload)))
        assert struct.unpack_from("<QIII", wc.recv_until(s, wc.ACK))[3] == kvlink.ErrorCode.PROTOCOL
    finally:
        s.close()
    assert (dst[:64] == 1).all() and not dst[64:].any()
    h = rx.inbound(timeout_s=1)  # the announced one, done
    assert h.ok and h.peer == "raw"


def test_sender_closing_with_nothing_queued_fails_the_handle_at_once(make_agent):
    # close() used to stop before the failed push retired, so its END never
    # left and the receiver's handle waited for the push's deadline (60 s).
    # The receiver's ACKs are held back (a proxy), so the push is still
    # running at close(), whatever the timing: one chunk in flight, nothing queued.
    cfg = {"chunk_bytes": 4096, "min_chunk_bytes": 4096, "window_chunks": 1, "window_bytes": 0}
    rx = make_agent("rx", nics="loopback:2", **cfg)
    tx = make_agent("tx", nics="loopback:2", **cfg)
    dst = np.zeros(32 * MiB, np.uint8)
    src = np.full(32 * MiB, 3, np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    tx.register(src)
    proxy = wc.AckHoldingProxy(rx.metadata())
    try:
        tx.add_peer(proxy.metadata())
        h = tx.push("rx", src=src, dst="kv", notify=b"slow", timeout_s=60)
        ib = rx.inbound(b"slow", timeout_s=10)
        assert h.state == kvlink.TransferState.RUNNING  # no ACK came: it cannot be done
        tx.close()
        assert h.state == kvlink.TransferState.FAILED  # close() failed it, not finished it
        with pytest.raises(kvlink.TransferAbortedError, match="closed"):
            h.wait(timeout_s=0)
        with pytest.raises(kvlink.TransferAbortedError, match="closed"):
            ib.wait(timeout_s=20)
    finally:
        proxy.close()


def test_timeout_messages_name_the_whole_wait(make_agent):
    rx = make_agent("rx")
    with pytest.raises(kvlink.TransferTimeoutError) as ei:
        rx.inbound(b"never", timeout_s=0.7)
    assert "within 0.7 s" in str(ei.value) and "'never'" in str(ei.value)
