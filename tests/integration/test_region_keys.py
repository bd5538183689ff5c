"""Per-region access keys: a peer that knows a region's id but not its key
cannot touch it (docs/security.md)."""

from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest

import kvlink
from tests import wire_client as wc
from tests.waits import wait_for

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


def _chunk_body(region: int, offset: int, n: int, key: bytes) -> bytes:
    """DATA / READ_REQ body: push 1 chunk 0 attempt 1, one piece, one key (for region)."""
    return (
        struct.pack("<QIII", 1, 0, 1, 1)
        + struct.pack("<QQQ", region, offset, n)
        + struct.pack("<IQ", 1, region)
        + key
    )


def test_a_refusal_says_nothing_about_the_region(make_agent, caplog):
    """Without the right key a peer learns nothing of a region: whether it exists, is
    exposed, how large it is. Every refusal is the same ACK / READ_RESP, byte for byte;
    the reason is in the owner's log only."""
    caplog.set_level(logging.WARNING, logger="kvlink")
    rx = make_agent("rx")
    w = rx.register(np.zeros(MiB, np.uint8), remote_write=True, remote_read=True)
    ro = rx.register(np.zeros(MiB, np.uint8), remote_read=True)
    hidden = rx.register(np.zeros(4096, np.uint8), name="secret-name")
    meta = rx.metadata()
    wkey, rokey = wc.key_of(meta, w.id), wc.key_of(meta, ro.id)
    nowhere = max(w.id, ro.id, hidden.id) + 1000
    wrong = bytes(16)
    cases = {
        "nonexistent": (nowhere, 0, wrong),
        "unexposed": (hidden.id, 0, wrong),
        "wrong key": (w.id, 0, wrong),
        "out of bounds, wrong key": (w.id, MiB - 32, wrong),
        "out of bounds, right key": (w.id, MiB - 32, wkey),
        "far out of bounds": (w.id, 1 << 40, wrong),
    }
    n = 64
    payload = b"\x07" * n
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99)
    acks, resps = {}, {}
    try:
        for what, (region, off, key) in cases.items():
            s.sendall(wc.frame(wc.DATA, _chunk_body(region, off, n, key), n) + payload)
            s.sendall(struct.pack("<I", wc.crc(payload)))
            acks[what] = wc.recv_until(s, wc.ACK)
        # a push into a region exposed for reading only, with its own right key
        s.sendall(wc.frame(wc.DATA, _chunk_body(ro.id, 0, n, rokey), n) + payload)
        s.sendall(struct.pack("<I", wc.crc(payload)))
        acks["read-only for peers"] = wc.recv_until(s, wc.ACK)
        for what, (region, off, key) in cases.items():
            if region == w.id and key == wkey:
                continue  # w is readable: the out-of-bounds read is in the list with wrong keys
            s.sendall(wc.frame(wc.READ_REQ, _chunk_body(region, off, n, key)))
            t, resps[what] = wc.recv_frame(s)
            assert t == wc.READ_RESP
        s.sendall(wc.frame(wc.READ_REQ, _chunk_body(w.id, MiB - 32, n, wkey)))
        resps["out of bounds, right key"] = wc.recv_frame(s)[1]
    finally:
        s.close()
    assert len(set(acks.values())) == 1, acks
    assert len(set(resps.values())) == 1, resps
    body = next(iter(acks.values()))
    assert body == next(iter(resps.values()))
    assert struct.unpack_from("<QIII", body)[3] == kvlink.ErrorCode.ACCESS_DENIED
    assert b"secret-name" not in body and b"4096" not in body
    assert b"region access refused" in body
    wait_for(
        lambda: any("'secret-name'" in r.getMessage() for r in caplog.records),
        10,
        "the owner's log to name the unexposed region",
    )


def test_a_refused_push_tells_the_sender_what_to_check(make_agent):
    """The uniform answer still says what a legitimate sender should check; the owner's
    log has the details."""
    rx = make_agent("rx")
    tx = make_agent("tx")
    dst = np.zeros(MiB, np.uint8)
    region = rx.register(dst, name="kv", remote_write=True)
    src = np.full(MiB, 3, np.uint8)
    tx.register(src)
    meta = json.loads(rx.metadata())
    meta["keys"][str(region.id)] = bytes(16).hex()  # stale metadata: another key
    tx.add_peer(json.dumps(meta).encode())
    with pytest.raises(kvlink.RemoteRefusedError, match=r"wrong or missing region key.*log"):
        tx.push("rx", src=src, dst="kv").wait(timeout_s=30)
    assert not dst.any()
