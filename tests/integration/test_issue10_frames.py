"""Issue 10's hostile frames, rebuilt for wire protocol 3, as regression tests.

Covered elsewhere: item 1 (chunk index >= 2**31) in test_inbound.py
(test_data_without_announce_is_refused_and_huge_chunk_index_is_harmless), item 3 with the
victim's own name in test_bad_input.py and behind an unauthenticated HELLO in test_auth.py,
item 5 (NOTIFY op 99) in test_notify.py. Here: item 2 (memory on demand), item 3 with a
connected peer's name and another instance, item 4 (forged completion), and what the
hostile-client run (tests/c/hostile.c) and a probe of it found next (docs/security.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct

import numpy as np

import kvlink
from tests import wire_client as wc

MiB = 1 << 20


def _rss() -> int:
    """Resident bytes of this process (the agents under test live in it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _drain(s: socket.socket) -> None:
    """Reads whatever the agent answered so far, so its answers never back up."""
    s.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while s.recv(1 << 16):
            pass
    s.setblocking(True)


def _still_serves(s: socket.socket) -> None:
    """A PING on s is answered: the engine got through everything sent before it."""
    s.sendall(wc.frame(wc.PING, struct.pack("<Q", 5)))
    s.settimeout(10)
    assert struct.unpack("<Q", wc.recv_until(s, wc.PONG)) == (5,)


def _instance(agent: kvlink.Agent) -> int:
    """The instance id an agent publishes in its metadata (anyone it gives it to knows it)."""
    return int(json.loads(agent.metadata())["instance"], 16)


def _with_crc(payload: bytes) -> bytes:
    return payload + struct.pack("<I", wc.crc(payload))


def test_data_for_far_chunks_of_new_transfers_costs_no_memory(make_agent):
    """Item 2: DATA for chunk 2**22 of a new transfer id each time grew the
    receiver by 64 MiB per 97-byte frame; now DATA of an unannounced push is
    refused without a table, and announced chunk tables are bounded in total."""
    rx = make_agent("rx")
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    key = wc.key_of(rx.metadata(), rid)
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99)
    try:
        base = _rss()
        payload = _with_crc(b"\x01" * 64)
        for i in range(500):
            s.sendall(wc.data(1000 + i, 1 << 22, 1, rid, 64, key) + payload)
            if i % 50 == 0:
                _drain(s)
        # announced: the most chunks a push may have, a new transfer id each time
        chunks = 65536
        for i in range(40):
            body = struct.pack("<QQIIII", 5000 + i, 1 << 30, chunks, 1, 0, 0) + bytes(8 * chunks)
            s.sendall(wc.frame(wc.ANNOUNCE, body))
            _drain(s)
        _still_serves(s)
        grown = _rss() - base
    finally:
        s.close()
    assert grown <= 32 * MiB, f"{grown / MiB:.1f} MiB for 500 DATA and 40 ANNOUNCE frames"
    assert not dst.any()


def test_announce_with_many_layers_costs_bounded_memory(make_agent):
    rx = make_agent("rx")
    rx.register(np.zeros(MiB, np.uint8), remote_write=True)
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99)
    try:
        base = _rss()
        for i in range(2000):
            body = struct.pack("<QQIIII", 1000 + i, 64, 1, 65536, 0, 0)
            s.sendall(wc.frame(wc.ANNOUNCE, body + struct.pack("<II", 65535, 65535)))
            if i % 100 == 0:
                _drain(s)
        _still_serves(s)
        grown = _rss() - base
    finally:
        s.close()
    assert grown <= 64 * MiB, f"{grown / MiB:.1f} MiB for 2000 64-byte ANNOUNCE frames"


def test_announces_up_to_the_entry_bound_cost_bounded_memory(make_agent):
    rx = make_agent("rx")
    rx.register(np.zeros(MiB, np.uint8), remote_write=True)
    base = _rss()
    for c in range(16):  # 16 senders (instances) x 1000 transfers, nobody takes them
        s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, f"raw{c}", 1000 + c)
        try:
            for xfer in range(1, 1001):
                s.sendall(wc.announce(xfer, 64, 1))
                if xfer % 100 == 0:
                    _drain(s)
            _still_serves(s)
        finally:
            s.close()
    grown = _rss() - base
    assert grown <= 64 * MiB, f"{grown / MiB:.1f} MiB for 16000 64-byte ANNOUNCE frames"


def test_a_live_peers_name_with_another_instance_gets_nothing_through(make_agent):
    """Item 3: a HELLO naming a connected peer with another instance id is
    refused (DUPLICATE_NAME), and neither the DATA nor the NOTIFY behind it
    is processed (a NOTIFY used to be delivered, a DATA to land)."""
    rx = make_agent("rx")
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    tx = make_agent("tx")
    tx.add_peer(rx.metadata())  # rx now holds live connections from 'tx'
    s = socket.create_connection(rx.addresses[0], timeout=10)
    try:
        forged = (
            wc.hello("tx", _instance(tx) ^ 1, wc.DATA_CONN, 0)
            + wc.announce(7, 64, 1)
            + wc.data(7, 0, 1, rid, 64, wc.key_of(rx.metadata(), rid))
            + _with_crc(b"\xee" * 64)
            + wc.notify(7, b"forged")
        )
        s.sendall(forged)
        body = wc.recv_until(s, wc.HELLO_ACK)
        assert struct.unpack_from("<I", body)[0] == kvlink.ErrorCode.DUPLICATE_NAME
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(4096) == b"", "the refused connection is closed"
    finally:
        s.close()
    assert rx.notifications(timeout_s=0.5) == []
    assert not dst.any()


def test_a_client_declaring_a_peers_instance_cannot_complete_or_fail_its_pushes(make_agent):
    """Item 4: a client that declares the real sender's instance sends DATA
    for its transfer 1, chunk 0, attempt 1000 and END for its next transfer
    ids; the real pushes must still place the sender's bytes and succeed."""
    rx = make_agent("rx")
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, name="kv", remote_write=True).id
    tx = make_agent("tx")
    src = np.full(MiB, 7, np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata())
    s = socket.create_connection(rx.addresses[0], timeout=10)
    try:
        # it even holds rx's metadata (the region key); the instance id is public too:
        # what it lacks is tx's session token, so it cannot join tx's live connections
        key = wc.key_of(rx.metadata(), rid)
        s.sendall(
            wc.hello("tx", _instance(tx), wc.DATA_CONN, 0)
            + wc.announce(1, MiB, 1)
            + wc.data(1, 0, 1000, rid, 64, key)
            + _with_crc(b"\xee" * 64)
            + b"".join(wc.end(x, 17, b"forged") for x in range(2, 6))
        )
        body = wc.recv_until(s, wc.HELLO_ACK)
        assert struct.unpack_from("<I", body)[0] == kvlink.ErrorCode.DUPLICATE_NAME
    finally:
        s.close()
    failures = []
    for _ in range(3):  # transfer 1, then the ids the forged ENDs named
        src[:] += 1
        try:
            tx.push("rx", src=src, dst="kv").wait(timeout_s=10)
        except kvlink.KvlinkError as exc:
            failures.append(str(exc))
            continue
        if not np.array_equal(dst, src):
            failures.append("the push reported success but the destination differs")
    assert failures == [], "\n".join(failures)


def test_another_name_with_a_peers_instance_cannot_touch_its_pushes(make_agent):
    """The same attack as above under another name (so the name's session check does not
    apply): the client is admitted, but its ANNOUNCE, DATA and END belong to its own session
    and the real sender's pushes never see them (they used to be END-ed and hang)."""
    rx = make_agent("rx")
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, name="kv", remote_write=True).id
    tx = make_agent("tx")
    src = np.full(MiB, 7, np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata())
    key = wc.key_of(rx.metadata(), rid)
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "evil", _instance(tx))
    try:
        s.sendall(wc.announce(1, MiB, 1) + wc.data(1, 0, 1000, rid, 64, key))
        s.sendall(_with_crc(b"\xee" * 64))
        s.sendall(b"".join(wc.end(x, 17, b"forged") for x in range(1, 6)))
        _still_serves(s)
    finally:
        s.close()
    for _ in range(3):  # transfer 1 (whose id the client used), then the ids it ENDed
        src[:] += 1
        tx.push("rx", src=src, dst="kv").wait(timeout_s=10)
        assert np.array_equal(dst, src)


def test_ended_pushes_nobody_took_cost_only_their_tags(make_agent):
    """Handles of pushes that failed (END) before the application took them wait in the
    queue for 60 s; they used to keep their per-chunk and per-layer arrays (about 2.9 MiB for
    65536 chunks and layers each): 100 of them held ~290 MiB outside every budget."""
    rx = make_agent("rx")
    rx.register(np.zeros(MiB, np.uint8), remote_write=True)
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99)
    chunks, tag = 65536, b"t" * 4096
    try:
        base = _rss()
        for xfer in range(1, 101):
            body = struct.pack("<QQIIII", xfer, chunks, chunks, 65536, 0, len(tag)) + tag
            last = struct.pack("<II", 65535, 65535)
            s.sendall(wc.frame(wc.ANNOUNCE, body + struct.pack("<II", 0, 0) * (chunks - 1) + last))
            s.sendall(wc.end(xfer, 17, b"gone"))
            if xfer % 10 == 0:
                _drain(s)
        _still_serves(s)
        grown = _rss() - base
    finally:
        s.close()
    assert grown <= 64 * MiB, f"{grown / MiB:.1f} MiB for 100 ended pushes nobody took"
