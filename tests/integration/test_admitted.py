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


def _closed_by_agent(s: socket.socket, within_s: float) -> bool:
    """True once the agent has closed s (EOF or reset) within ``within_s``; frames it sent
    before are read and dropped."""
    s.settimeout(within_s)
    try:
        while s.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


def _logged(caplog: pytest.LogCaptureFixture, text: str, timeout_s: float = 10) -> None:
    wait_for(
        lambda: any(text in r.getMessage() for r in caplog.records), timeout_s, f"log: {text}"
    )


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
        assert _closed_by_agent(quiet, within_s=0.1)
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
    with pytest.raises(kvlink.ConfigError, match="idle_conn_timeout_s.*between their pings"):
        kvlink.Config(nics="loopback:1", idle_conn_timeout_s=0.2)
    with pytest.raises(kvlink.ConfigError, match="idle_conn_timeout_s"):
        kvlink.Config(nics="loopback:1", idle_conn_timeout_s=-1)
    assert kvlink.Config(nics="loopback:1", idle_conn_timeout_s=0).idle_conn_timeout_s == 0
