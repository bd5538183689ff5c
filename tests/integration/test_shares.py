"""Each admitted sender holds at most its share of a receiver's inbound state
(csrc/share.c): over it, it is refused with the reason; a flood from one
sender never refuses, drops or forgets another sender's pushes and
notifications."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import numpy as np

import kvlink
from tests import wire_client as wc
from tests.waits import wait_for

MiB = 1 << 20
SHARE_LIVE = 2048  # KVL_SHARE_LIVE
SHARE_NOTIFS = 8192  # KVL_SHARE_NOTIFS


def _ack(s: socket.socket) -> tuple[int, int, str]:
    """(xfer, status, message) of the next ACK on s."""
    body = wc.recv_until(s, wc.ACK)
    xfer, _, _, status = struct.unpack_from("<QIII", body)
    (n,) = struct.unpack_from("<H", body, 20)
    return xfer, status, body[22 : 22 + n].decode()


def _push_verifies(tx: kvlink.Agent, rx_name: str, dst: np.ndarray, fill: int) -> None:
    src = np.full(dst.size, fill, np.uint8)
    region = tx.register(src)
    try:
        tx.push(rx_name, src=src, dst="kv").wait(timeout_s=30)
        assert np.array_equal(dst, src)
    finally:
        tx.deregister(region)


def test_sender_over_its_share_is_refused_with_the_reason_others_are_not(make_agent):
    """2048 announced pushes are one sender's share: its next one is refused, and
    its DATA is answered with why (it used to take all 16384 entries, and then
    everyone's pushes failed with "was not announced")."""
    rx = make_agent("rx")
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, remote_write=True, name="kv").id
    key = wc.key_of(rx.metadata(), rid)
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "greedy", random.getrandbits(63))
    try:
        s.sendall(b"".join(wc.announce(x, 64, 1) for x in range(1, SHARE_LIVE + 2)))
        payload = b"\x05" * 64
        tail = struct.pack("<I", wc.crc(payload))
        s.sendall(wc.data(SHARE_LIVE + 1, 0, 1, rid, 64, key) + payload + tail)
        xfer, status, msg = _ack(s)
        assert (xfer, status) == (SHARE_LIVE + 1, kvlink.ErrorCode.BUSY), msg
        assert "inbound share (2048 pushes) is in use" in msg and "'rx'" in msg
        # within its share it still works
        s.sendall(wc.data(1, 0, 1, rid, 64, key) + payload + tail)
        assert _ack(s)[:2] == (1, 0)
        # another sender, meanwhile: unaffected
        tx = make_agent("tx")
        tx.add_peer(rx.metadata())
        _push_verifies(tx, "rx", dst, 7)
        st = wait_for(
            lambda: (lambda v: v if v.refused_pushes >= 1 else None)(rx.inbound_stats()),
            timeout_s=5,
            what="the refusal counted",
        )
        assert st.pushes >= SHARE_LIVE and st.senders >= 1
    finally:
        s.close()


def test_notification_flood_neither_drops_nor_delays_another_senders(make_agent):
    """A sender whose notifications the application does not read keeps at most
    its share queued; the rest are not acknowledged (its sender sends them
    again), and another sender's notification is still queued and delivered
    once.  Before shares, the 65,536-entry queue filled and other senders'
    notifications were dropped, acknowledged to their senders."""
    rx = make_agent("rx")
    dst = np.zeros(MiB, np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    conn = wc.connect(rx.addresses[0], wc.CONTROL, 0, "flood", random.getrandbits(63))
    n_flood = 70_000
    try:
        acks: list[int] = []

        def read_acks() -> None:  # the agent closes a peer that does not read its answers
            try:
                while True:
                    wc.recv_until(conn, wc.NOTIFY_ACK)
                    acks.append(1)
            except (TimeoutError, OSError):
                pass

        conn.settimeout(3)
        reader = threading.Thread(target=read_acks, daemon=True)
        reader.start()
        batch = 2000  # then wait for its ACKs: well under the 4096 answers a peer may leave unread
        for base in range(1, n_flood + 1, batch):
            conn.sendall(b"".join(wc.notify(x, b"f" * 16) for x in range(base, base + batch)))
            expect = min(base + batch - 1, SHARE_NOTIFS)
            wait_for(lambda e=expect: len(acks) >= e, timeout_s=30, what=f"{expect} NOTIFY_ACKs")
        reader.join(timeout=60)  # ends 3 s after the last ACK
        assert not reader.is_alive()
        acked = len(acks)
        assert acked == SHARE_NOTIFS, acked
        tx = make_agent("tx")
        tx.add_peer(rx.metadata())
        src = np.full(MiB, 3, np.uint8)
        tx.register(src)
        tx.push("rx", src=src, dst="kv", notify=b"mine").wait(timeout_s=30)
        got: list[kvlink.Notification] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(n.tag == b"mine" for n in got):
            got += rx.notifications(timeout_s=1)
        assert [n.peer for n in got if n.tag == b"mine"] == ["tx"]
        assert sum(n.peer == "flood" for n in got) <= SHARE_NOTIFS
        st = rx.inbound_stats()
        assert st.refused_notifications >= n_flood - SHARE_NOTIFS
    finally:
        conn.close()
