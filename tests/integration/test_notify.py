"""Notifications arrive exactly once: not lost when the sender closes right
after wait(), not duplicated when a copy is re-sent."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

import kvlink
from tests import wire_client as wc

# every test twice: I/O on the engine thread, and on two I/O threads (conftest.py)
pytestmark = pytest.mark.usefixtures("io_threads_mode")

MiB = 1 << 20


def test_close_right_after_wait_loses_no_notification(spawn_peer):
    # the usual `with Agent(...)` pattern: close() follows wait() at once.
    # Before close() lingered, about half of these notifications were lost.
    rx = spawn_peer("rx", nics="loopback:4")
    rx.call("alloc", key="kv", nbytes=16 * MiB, remote_write=True, name="kv")
    src = np.full(16 * MiB, 7, np.uint8)
    rounds = 20
    for i in range(rounds):
        with kvlink.Agent(f"tx{i}", kvlink.Config(nics="loopback:4")) as tx:
            tx.register(src)
            tx.add_peer(rx.metadata)
            tx.push("rx", src=src, dst="kv", notify=b"req-%d" % i).wait(timeout_s=30)
    got: list[dict[str, str]] = []
    while len(got) < rounds:
        batch = rx.call("notifications", wait_s=5)["notifications"]
        if not batch:
            break
        got += batch
    tags = sorted(bytes.fromhex(n["tag"]) for n in got)
    assert tags == sorted(b"req-%d" % i for i in range(rounds))


def test_resent_notification_is_delivered_once_and_acknowledged(make_agent):
    # A sender re-sends a NOTIFY whose acknowledgement it did not see (its
    # connection died); the receiver must acknowledge every copy and deliver
    # one.  A raw client plays the sender so the copy really is a copy.
    rx = make_agent("rx")
    host, port = rx.addresses[0]
    conn = wc.connect((host, port), wc.CONTROL, 0, "raw-sender", random.getrandbits(63))
    try:
        for _ in range(3):
            conn.sendall(wc.notify(41, b"only-once"))
            (xfer,) = struct.unpack("<Q", wc.recv_until(conn, wc.NOTIFY_ACK))
            assert xfer == 41
        conn.sendall(wc.notify(42, b"second"))
        wc.recv_until(conn, wc.NOTIFY_ACK)
    finally:
        conn.close()
    got = rx.notifications(timeout_s=2)
    more = rx.notifications(timeout_s=0.3)
    assert [(n.peer, n.tag) for n in got + more] == [
        ("raw-sender", b"only-once"),
        ("raw-sender", b"second"),
    ]


def test_notify_with_unknown_op_is_refused_not_delivered(make_agent):
    rx = make_agent("rx")
    host, port = rx.addresses[0]
    conn = wc.connect((host, port), wc.CONTROL, 0, "raw-sender", random.getrandbits(63))
    try:
        conn.sendall(wc.notify(5, b"x", op=99))
        try:  # a malformed frame closes the connection without an answer
            while conn.recv(4096):
                pass
        except ConnectionError:
            pass
    finally:
        conn.close()
    assert rx.notifications(timeout_s=0.3) == []
