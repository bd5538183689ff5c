"""Per-region access keys: a peer that knows a region's id but not its key
cannot touch it (docs/security.md)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import kvlink
from tests import wire_client as wc

MiB = 1 << 20


def test_metadata_carries_a_key_for_each_exposed_region_only(make_agent):
    rx = make_agent("rx")
    w = rx.register(np.zeros(MiB, np.uint8), remote_write=True)
    r = rx.register(np.zeros(MiB, np.uint8), remote_read=True)
    rx.register(np.zeros(MiB, np.uint8))  # local only
    keys = json.loads(rx.metadata())["keys"]
    assert sorted(keys) == sorted([str(w.id), str(r.id)])
    assert all(len(bytes.fromhex(k)) == 16 for k in keys.values())
    assert keys[str(w.id)] != keys[str(r.id)]


def test_metadata_from_before_a_registration_lacks_its_key(make_agent):
    rx = make_agent("rx")
    tx = make_agent("tx")
    early = rx.metadata()
    dst = np.zeros(MiB, np.uint8)
    rx.register(dst, name="kv", remote_write=True)
    src = np.full(MiB, 4, np.uint8)
    tx.register(src)
    tx.add_peer(early)
    with pytest.raises(kvlink.RemoteAccessError, match=r"'kv': no access key.*add_peer"):
        tx.push("rx", src=src, dst="kv")
    tx.add_peer(rx.metadata())  # the same peer again: it only learns the new keys
    tx.push("rx", src=src, dst="kv").wait(timeout_s=30)
    assert np.array_equal(dst, src)


def test_segments_into_a_region_registered_after_add_peer(make_agent):
    # the peer's table is the handshake's and lacks the region: the push refreshes it (in
    # the caller's thread; submit itself never waits for the peer) and goes ahead
    rx = make_agent("rx")
    tx = make_agent("tx")
    src = np.full(MiB, 6, np.uint8)
    sid = tx.register(src).id
    tx.add_peer(rx.metadata())
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    tx.add_peer(rx.metadata())  # its key; the region table stays the handshake's
    assert rid not in [r.id for r in tx.remote_regions("rx")]
    seg = np.zeros(1, kvlink.SEGMENT_DTYPE)
    seg[0] = (sid, 0, rid, 0, MiB, 0, 0)
    tx.push("rx", segments=seg).wait(timeout_s=30)
    assert np.array_equal(dst, src)
    assert rid in [r.id for r in tx.remote_regions("rx")]


@pytest.mark.parametrize("key", [None, bytes(16)], ids=["missing", "wrong"])
def test_data_without_the_right_key_is_refused(make_agent, key):
    """A connection that knows the region id (the table lists it) but not its
    key: every piece is refused and not one byte lands."""
    rx = make_agent("rx")
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    payload = b"\x07" * 64
    body = struct.pack("<QIII", 1, 0, 1, 1) + struct.pack("<QQQ", rid, 0, 64)
    if key is None:  # a key for another region only
        body += struct.pack("<IQ", 1, rid + 1) + bytes(16)
    else:
        body += struct.pack("<IQ", 1, rid) + key
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99)
    try:
        s.sendall(wc.announce(1, 64, 1) + wc.frame(wc.DATA, body, 64) + payload)
        s.sendall(struct.pack("<I", wc.crc(payload)))
        status = struct.unpack_from("<QIII", wc.recv_until(s, wc.ACK))[3]
    finally:
        s.close()
    assert status == kvlink.ErrorCode.ACCESS_DENIED
    assert not dst.any()


def test_pull_needs_the_key_too(make_agent):
    rx = make_agent("rx")
    src = np.arange(MiB, dtype=np.uint8)
    rid = rx.register(src, remote_read=True).id
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99)
    body = struct.pack("<QIII", 1, 0, 1, 1) + struct.pack("<QQQ", rid, 0, 64)
    try:
        s.sendall(wc.frame(wc.READ_REQ, body + struct.pack("<IQ", 1, rid) + bytes(16)))
        t, resp = wc.recv_frame(s)
    finally:
        s.close()
    assert t == wc.READ_RESP
    assert struct.unpack_from("<QIII", resp)[3] == kvlink.ErrorCode.ACCESS_DENIED
