"""Two copies of one pushed chunk (a re-send or a hedge) never both write: a
scripted sender speaks the wire protocol to a real receiving agent and plays
the hedge race, including a late, corrupt loser after the transfer completed."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from tests.waits import wait_for
from tests.wire_client import ACK as F_ACK
from tests.wire_client import NOTIFY as F_NOTIFY
from tests.wire_client import PING as F_PING
from tests.wire_client import PONG as F_PONG
from tests.wire_client import (
    SUPERSEDED,
    announce,
    connect,
    crc,
    data,
    end,
    frame,
    key_of,
    recv_frame,
    recv_until,
)

# every test twice: I/O on the engine thread, and on two I/O threads (conftest.py)
pytestmark = pytest.mark.usefixtures("io_threads_mode")

L = 1 << 20


def ack(s: socket.socket) -> tuple[int, int, int]:
    t, body = recv_frame(s)
    assert t == F_ACK
    _, chunk, attempt, status = struct.unpack_from("<QIII", body)
    return chunk, attempt, status


def test_late_corrupt_loser_never_lands(make_agent):
    rx = make_agent("rx-dup", nics="loopback:2")
    dst = np.zeros(L, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    key = key_of(rx.metadata(), rid)
    (h0, p0), (h1, p1) = rx.addresses
    ctrl, d0, d1 = connect((h0, p0), 0, 0), connect((h0, p0), 1, 0), connect((h1, p1), 1, 1)
    try:
        good = bytes([0x11]) * L
        # copy 1 (slow path): header and half of its payload arrive
        d0.sendall(announce(7, 2 * L, 2) + data(7, 0, 1, rid, L, key) + good[: L // 2])
        # copy 2 (the hedge) overtakes it and is verified
        d1.sendall(
            announce(7, 2 * L, 2) + data(7, 0, 2, rid, L, key) + good + struct.pack("<I", crc(good))
        )
        assert ack(d1) == (0, 2, 0)
        ctrl.sendall(frame(F_NOTIFY, struct.pack("<QII", 7, 1, 4) + b"done"))
        assert [n.tag for n in rx.notifications(timeout_s=5)] == [b"done"]
        dst[:] = 0xEE  # the application owns the buffer now
        # the rest of copy 1 arrives late and corrupt: drained, not placed
        d0.sendall(bytes([0x22]) * (L // 2) + struct.pack("<I", 0))
        chunk, attempt, status = ack(d0)
        assert (chunk, attempt) == (0, 1) and status in (0, SUPERSEDED)
        assert (dst == 0xEE).all(), "a superseded copy wrote into the destination"
        # after END even a brand-new copy of that transfer is drained
        ctrl.sendall(end(7) + frame(F_PING, struct.pack("<Q", 1)))
        recv_until(ctrl, F_PONG)  # END processed (same connection, in order)
        d1.sendall(data(7, 1, 9, rid, L, key) + good + struct.pack("<I", crc(good)))
        assert ack(d1)[2] == SUPERSEDED
        assert (dst == 0xEE).all()
    finally:
        for s in (ctrl, d0, d1):
            s.close()


def test_newer_copy_takes_over_and_older_stops_writing(make_agent):
    # small socket buffers: the receiver reads a payload in batches of a quarter of its
    # receive buffer (not all of it at once), so the newer copy's bytes land as they come
    rx = make_agent("rx-dup2", nics="loopback:2", sock_buf_bytes=64 << 10)
    dst = np.zeros(L, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    key = key_of(rx.metadata(), rid)
    (h0, p0), (h1, p1) = rx.addresses
    d0, d1 = connect((h0, p0), 1, 0), connect((h1, p1), 1, 1)
    try:
        good = bytes(range(256)) * (L // 256)
        d0.sendall(announce(8, L, 1) + data(8, 0, 1, rid, L, key) + good[: L // 4])  # a quarter in
        d1.sendall(announce(8, L, 1) + data(8, 0, 2, rid, L, key) + good[: L // 2])  # newer copy
        # bytes past the old copy's quarter in place: the receiver read the newer header
        # and placed its copy (the old one never sent those bytes)
        probe = slice(L // 4, L // 4 + (64 << 10))
        wait_for(lambda: dst[probe].tobytes() == good[probe], 10, "the newer copy's bytes land")
        d0.sendall(bytes([0x33]) * (3 * L // 4) + struct.pack("<I", 0))  # old copy: garbage
        assert ack(d0) == (0, 1, SUPERSEDED)  # drained: the newer copy owns the chunk
        # where the garbage would land: the newer copy's bytes, or none yet
        rest, want = dst[L // 4 :], np.frombuffer(good, np.uint8)[L // 4 :]
        assert ((rest == want) | (rest == 0)).all(), "the superseded copy wrote into dst"
        d1.sendall(good[L // 2 :] + struct.pack("<I", crc(good)))
        assert ack(d1) == (0, 2, 0)
        assert dst.tobytes() == good, "only the owning copy's bytes are in place"
    finally:
        d0.close()
        d1.close()
