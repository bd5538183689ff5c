"""An admitted peer's own connection cannot make the TCP stream hold memory
or ignore it for long (issue 22 items 2, 3 and 5, inside the stream;
docs/security.md, "Stream budgets")."""

from __future__ import annotations

import os
import select
import socket
import struct
import time

import numpy as np

import kvlink
from tests import wire_client as wc

MiB = 1 << 20
PIECES = 8192  # the most a READ_REQ may name


def _rss() -> int:
    """Resident bytes of this process (the agents under test live in it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _read_req(xfer: int, rid: int, key: bytes) -> bytes:
    """A READ_REQ of 8192 one-byte pieces a byte apart (no two merge): its
    answer holds one iovec per piece."""
    pieces = b"".join(struct.pack("<QQQ", rid, 2 * i, 1) for i in range(PIECES))
    body = struct.pack("<QIII", xfer, 0, 1, PIECES) + pieces + struct.pack("<IQ", 1, rid) + key
    return wc.frame(wc.READ_REQ, body)


def test_unread_answers_stay_bounded_and_others_still_pull_and_push(make_agent):
    """A peer that sends READ_REQs of 8192 pieces and never reads the answers:
    each answer queued held a 128 KiB iovec array outside any bound (600 of
    them: +75 MiB).  Now the connection is not read once its answers hold
    8 MiB, so the sender blocks; another agent's pull and push still go."""
    rx = make_agent("rx")
    src = np.arange(4 * MiB, dtype=np.uint32).view(np.uint8)[: 4 * MiB].copy()
    rid = rx.register(src, name="src", remote_read=True).id
    dst = np.zeros(4 * MiB, np.uint8)
    rx.register(dst, name="dst", remote_write=True)
    key = wc.key_of(rx.metadata(), rid)
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    try:
        base = _rss()
        req = _read_req(1, rid, key)
        s.settimeout(0.5)
        sent = 0
        deadline = time.monotonic() + 20
        while sent < 600 and time.monotonic() < deadline:
            try:
                s.sendall(req)
            except TimeoutError:
                break  # the agent stopped reading us: what backpressure looks like
            sent += 1
        time.sleep(0.3)  # whatever it read is answered and queued by now
        grown = _rss() - base
        # meanwhile another agent pulls and pushes, and both verify
        tx = make_agent("tx")
        got = np.zeros(4 * MiB, np.uint8)
        tx.register(got)
        out = np.full(4 * MiB, 9, np.uint8)
        tx.register(out)
        tx.add_peer(rx.metadata())
        tx.pull("rx", src="src", dst=got).wait(timeout_s=30)
        assert np.array_equal(got, src)
        tx.push("rx", src=out, dst="dst").wait(timeout_s=30)
        assert np.array_equal(dst, out)
    finally:
        s.close()
    assert sent < 600, "the agent read every request although their answers pile up"
    assert grown <= 40 * MiB, f"{grown / MiB:.1f} MiB held for {sent} unread READ_RESPs"


def test_trickled_body_is_cut_at_its_deadline(make_agent):
    """A frame body sent a byte every 0.3 s never went silent long enough for
    the partial-frame cut (6 x connect_timeout), so it held its buffer for
    ever; now a body has connect_timeout + its length at 64 KiB/s."""
    rx = make_agent("rx", connect_timeout_s=1.0)
    rx.register(np.zeros(MiB, np.uint8), remote_write=True)
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99)
    closed = False
    try:
        body_len = 64 << 10  # a NOTIFY header announcing 64 KiB: 2 s to arrive in
        hdr = bytearray(wc.notify(7, b"")[:24])
        struct.pack_into("<I", hdr, 8, body_len)
        s.sendall(bytes(hdr) + bytes(100))
        deadline = time.monotonic() + 10
        while not closed and time.monotonic() < deadline:
            try:
                s.send(b"\0")
                r, _, _ = select.select([s], [], [], 0.3)
                closed = bool(r) and s.recv(4096) == b""
            except (BrokenPipeError, ConnectionResetError):
                closed = True
    finally:
        s.close()
    assert closed, "a trickled body kept its connection for 10 s"
    # the agent serves on
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw2", 98)
    try:
        s.sendall(wc.frame(wc.PING, struct.pack("<Q", 5)))
        assert struct.unpack("<Q", wc.recv_until(s, wc.PONG)) == (5,)
    finally:
        s.close()


def test_data_of_zero_length_pieces_is_answered(make_agent):
    """DATA whose pieces are all empty (payload_len 0, so no trailer) was never
    answered: its sender waited for an ACK that never came.  Now it is
    refused like any zero-length piece: ACK status PROTOCOL."""
    rx = make_agent("rx")
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    key = wc.key_of(rx.metadata(), rid)
    body = struct.pack("<QIII", 1, 0, 1, 1) + struct.pack("<QQQ", rid, 0, 0)
    body += struct.pack("<IQ", 1, rid) + key
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99)
    try:
        s.sendall(wc.announce(1, 64, 1) + wc.frame(wc.DATA, body, 0))
        s.settimeout(10)
        ack = wc.recv_until(s, wc.ACK)
        assert struct.unpack_from("<QIII", ack) == (1, 0, 1, kvlink.ErrorCode.PROTOCOL)
        # in step: the next frame is answered too
        s.sendall(wc.frame(wc.PING, struct.pack("<Q", 6)))
        assert struct.unpack("<Q", wc.recv_until(s, wc.PONG)) == (6,)
    finally:
        s.close()
    assert not dst.any()
