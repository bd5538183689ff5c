"""What an admitted peer may hold (docs/security.md, "Admitted peers: names, connections,
idle"): frames the docs say are empty must be, idle connections are closed, and one
session or one source address cannot take every name or connection."""

from __future__ import annotations

import logging
import socket
import struct
import time

import numpy as np
import pytest

import kvlink
from tests import wire_client as wc
from tests.waits import wait_for, wait_paths

MiB = 1 << 20




def _logged(caplog: pytest.LogCaptureFixture, text: str, timeout_s: float = 10) -> None:
    wait_for(lambda: any(text in r.getMessage() for r in caplog.records), timeout_s, f"log: {text}")


# ---- REGIONS_REQ ----


def test_regions_req_with_a_body_closes_the_connection(make_agent):
    rx = make_agent("rx")
    rx.register(np.zeros(4096, np.uint8), remote_read=True)
    s = wc.connect(rx.addresses[0], wc.CONTROL, 0, "asker", 3)
    try:
        s.sendall(wc.frame(wc.REGIONS_REQ, b""))  # as documented: answered
        assert wc.recv_until(s, wc.REGIONS)
        s.sendall(wc.frame(wc.REGIONS_REQ, b"\x00" * 16))
        s.settimeout(5)
        types = []
        with pytest.raises(ConnectionError):
            while True:
                types.append(wc.recv_frame(s)[0])
        assert wc.REGIONS not in types  # closed without an answer
    finally:
        s.close()


# ---- idle connections ----


def test_an_idle_admitted_connection_is_closed(make_agent, caplog):
    caplog.set_level(logging.INFO, logger="kvlink")
    rx = make_agent("rx", idle_conn_timeout_s=1.0)
    quiet = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "quiet", 4)
    chatty = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "chatty", 5)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:  # chatty pings as a live agent does
            chatty.sendall(wc.frame(wc.PING, struct.pack("<Q", 1)))
            assert wc.recv_until(chatty, wc.PONG)
            time.sleep(0.3)
        assert wc.closed_by_peer(quiet, within_s=0.1)
        chatty.sendall(wc.frame(wc.PING, struct.pack("<Q", 2)))
        chatty.settimeout(5)
        assert wc.recv_until(chatty, wc.PONG)  # still open
    finally:
        quiet.close()
        chatty.close()
    _logged(caplog, "carried nothing for 1000 ms")


def test_a_connection_with_a_payload_in_flight_is_not_idle(make_agent):
    """Half a DATA payload sent, then silence past the idle time: the frame is work in
    flight; the rest completes it and it is acknowledged."""
    rx = make_agent("rx", idle_conn_timeout_s=1.0)
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    key = wc.key_of(rx.metadata(), rid)
    n = 4096
    payload = bytes(range(256)) * (n // 256)
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "slow", 6)
    try:
        s.sendall(wc.announce(1, n, 1) + wc.data(1, 0, 1, rid, n, key) + payload[: n // 2])
        time.sleep(2.5)
        s.sendall(payload[n // 2 :] + struct.pack("<I", wc.crc(payload)))
        s.settimeout(5)
        status = struct.unpack_from("<QIII", wc.recv_until(s, wc.ACK))[3]
    finally:
        s.close()
    assert status == 0
    assert bytes(dst[:n]) == payload


def test_live_agents_keep_their_connections(make_agent, caplog):
    """A sender pings its control connection as it does its data paths: a receiver's
    idle rule closes none of them."""
    caplog.set_level(logging.INFO, logger="kvlink")
    rx = make_agent("rx", nics="loopback:2", idle_conn_timeout_s=1.0)
    tx = make_agent("tx", nics="loopback:2")
    tx.add_peer(rx.metadata())
    time.sleep(3)
    assert not [r for r in caplog.records if "carried nothing" in r.getMessage()]
    assert all(p.reconnects == 0 for p in tx.paths() if p.peer == "rx")


def test_a_peer_whose_connections_went_idle_pushes_again(make_agent, caplog):
    """A sender that pings rarely (monitor_interval_ms 1000: every 5 s) loses its
    connections to a receiver's 1 s idle rule; it reconnects and its next push works."""
    caplog.set_level(logging.INFO, logger="kvlink")
    rx = make_agent("rx", nics="loopback:2", idle_conn_timeout_s=1.0)
    tx = make_agent("tx", nics="loopback:2", monitor_interval_ms=1000)
    dst = np.zeros(4 * MiB, np.uint8)
    rx.register(dst, name="kv", remote_write=True)
    src = np.arange(4 * MiB, dtype=np.uint32).astype(np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata())
    _logged(caplog, "closed a control connection from 'tx'")
    wait_paths(tx, "rx", lambda ps: all(p.reconnects >= 1 for p in ps), timeout_s=30)
    wait_paths(tx, "rx", lambda ps: any(p.state == kvlink.PathState.UP for p in ps))
    tx.push("rx", src=src, dst="kv").wait(timeout_s=30)
    assert np.array_equal(dst, src)


def test_idle_conn_timeout_is_validated():
    with pytest.raises(kvlink.ConfigError, match=r"idle_conn_timeout_s.*between their pings"):
        kvlink.Config(nics="loopback:1", idle_conn_timeout_s=0.2)
    with pytest.raises(kvlink.ConfigError, match="idle_conn_timeout_s"):
        kvlink.Config(nics="loopback:1", idle_conn_timeout_s=-1)
    assert kvlink.Config(nics="loopback:1", idle_conn_timeout_s=0).idle_conn_timeout_s == 0


# ---- names and connections ----


def _hello(
    addr: tuple[str, int], name: str, instance: int, source: str | None = None
) -> tuple[socket.socket, int, str]:
    """A connection that sent its HELLO: (socket, HELLO_ACK status, its message)."""
    s = socket.create_connection(addr, timeout=10, source_address=(source, 0) if source else None)
    s.sendall(wc.hello(name, instance, wc.DATA_CONN, 0))
    t, body = wc.recv_frame(s)
    assert t == wc.HELLO_ACK
    status, _ = struct.unpack_from("<IQ", body)
    (nlen,) = struct.unpack_from("<H", body, 12)
    (mlen,) = struct.unpack_from("<H", body, 14 + nlen)
    return s, status, body[16 + nlen : 16 + nlen + mlen].decode()


def _close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def test_one_session_holds_at_most_its_share_of_connections(make_agent):
    rx = make_agent("rx")
    held: list[socket.socket] = []
    try:
        for _ in range(4 * (64 + 1)):  # KVL_MAX_CONNS_PER_PEER: 4 per path, 64 paths + control
            s, status, msg = _hello(rx.addresses[0], "greedy", 7)
            held.append(s)
            assert status == 0, msg
        s, status, msg = _hello(rx.addresses[0], "greedy", 7)
        s.close()
        assert status == kvlink.ErrorCode.BUSY
        assert "the most one session may hold" in msg
        s, status, msg = _hello(rx.addresses[0], "other", 8)  # another session gets in
        s.close()
        assert status == 0, msg
    finally:
        _close_all(held)


def test_one_source_address_holds_at_most_64_live_names(make_agent):
    rx = make_agent("rx")
    held: list[socket.socket] = []
    try:
        for i in range(64):
            s, status, msg = _hello(rx.addresses[0], f"n{i}", 100 + i)
            held.append(s)
            assert status == 0, msg
        s, status, msg = _hello(rx.addresses[0], "n64", 164)
        s.close()
        assert status == kvlink.ErrorCode.BUSY
        assert "64 peer names at 127.0.0.1" in msg
        # another source address is not held back
        s, status, msg = _hello(rx.addresses[0], "elsewhere", 999, source="127.0.0.2")
        s.close()
        assert status == 0, msg
        # a name of the 64 may add connections to its session
        s, status, msg = _hello(rx.addresses[0], "n0", 100)
        held.append(s)
        assert status == 0, msg
        held.pop(1).close()  # n1 leaves: n64 gets in once that is seen

        def admitted() -> bool:
            s, status, _ = _hello(rx.addresses[0], "n64", 164)
            held.append(s)
            return status == 0

        wait_for(admitted, 10, "a newcomer's name admitted once a name left")
    finally:
        _close_all(held)


def test_one_source_address_holds_at_most_a_quarter_of_max_connections(make_agent):
    rx = make_agent("rx", max_connections=4 * 260)  # a quarter: one session's share, 260
    held: list[socket.socket] = []
    try:
        for i in range(260):
            s, status, msg = _hello(rx.addresses[0], "a" if i < 200 else "b", 1 if i < 200 else 2)
            held.append(s)
            assert status == 0, msg
        s, status, msg = _hello(rx.addresses[0], "c", 3)
        s.close()
        assert status == kvlink.ErrorCode.BUSY
        assert "260 connections from 127.0.0.1" in msg
        s, status, msg = _hello(rx.addresses[0], "d", 4, source="127.0.0.2")
        s.close()
        assert status == 0, msg
    finally:
        _close_all(held)


def test_a_full_name_table_of_gone_names_takes_a_newcomer(make_agent):
    """4096 names (KVL_MAX_PEER_NAMES) came and went: the table is full of names without
    a live connection, and a new one still gets in (one of them makes room)."""
    rx = make_agent("rx")
    for i in range(4096):
        while True:
            s, status, msg = _hello(rx.addresses[0], f"gone{i}", 10_000 + i)
            s.close()
            if status == 0:
                break
            assert "peer names at" in msg, msg  # closes not seen yet: try again
            time.sleep(0.01)
    s, status, msg = _hello(rx.addresses[0], "newcomer", 1)
    s.close()
    assert status == 0, msg


def test_a_refused_handshake_is_reported_by_the_peer(make_agent):
    """A real agent refused for want of room reports the listener's reason."""
    rx = make_agent("rx")
    held = []
    try:
        for i in range(64):
            s, status, msg = _hello(rx.addresses[0], f"n{i}", 100 + i)
            held.append(s)
            assert status == 0, msg
        tx = make_agent("tx")
        with pytest.raises(kvlink.HandshakeError, match=r"64 peer names at 127\.0\.0\.1"):
            tx.add_peer(rx.metadata())
    finally:
        _close_all(held)
