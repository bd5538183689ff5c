"""A listening agent under resource pressure from the network: it sheds what
it cannot serve, says why, and keeps serving everyone else."""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import struct
import time

import numpy as np

import kvlink
from tests import wire_client as wc
from tests.waits import wait_for

MiB = 1 << 20


def _fill_descriptors() -> list[int]:
    """Opens /dev/null until the process is out of descriptors; returns them."""
    held: list[int] = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        assert exc.errno == errno.EMFILE, exc
    return held


def test_out_of_descriptors_sheds_connections_and_keeps_serving(make_agent, caplog):
    """At the fd limit the listener closes incoming connections unserved (the
    client sees the end at once; it used to sit in the backlog while the
    engine spun on the listener), logs why, and serves again once
    descriptors are free."""
    caplog.set_level(logging.ERROR, logger="kvlink")
    victim = make_agent("victim")
    kv = np.zeros(MiB, np.uint8)
    victim.register(kv, name="kv", remote_write=True)
    host, port = victim.addresses[0]
    client = socket.socket()
    client.settimeout(10)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
        held = _fill_descriptors()
        client.connect((host, port))  # the kernel queues it; accept() has no fd to give
        try:
            ended = client.recv(1) == b""
        except ConnectionResetError:
            ended = True
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        client.close()
    assert ended
    tx = make_agent("tx")
    src = np.full(MiB, 9, np.uint8)
    tx.register(src)
    tx.add_peer(victim.metadata())
    tx.push("victim", src=src, dst="kv").wait(timeout_s=30)
    assert np.array_equal(kv, src)
    assert _logged(caplog, "out of file descriptors")


def _tcp_state(s: socket.socket) -> int:
    """The kernel's TCP state of s (TCP_INFO's first byte: 1 is ESTABLISHED)."""
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]




def test_a_body_over_the_preauth_limit_is_refused_unread(make_agent):
    """Before the handshake ends a body is at most 256 bytes: a header that
    announces 64 KiB is refused on the spot, not buffered."""
    victim = make_agent("victim", connect_timeout_s=10)
    with socket.create_connection(victim.addresses[0], timeout=5) as s:
        s.sendall(struct.pack("<IBBHIIQ", wc.MAGIC, wc.VERSION, wc.HELLO, 0, 65536, 0, 0))
        assert wc.closed_by_peer(s, within_s=5)


def test_a_peer_that_does_not_read_its_answers_is_cut(make_agent, caplog):
    caplog.set_level(logging.WARNING, logger="kvlink")
    victim = make_agent("victim")
    for i in range(64):  # a region table of some size, answered to every REGIONS_REQ
        victim.register(np.zeros(4096, np.uint8), name=f"r{i}", remote_read=True)
    s = wc.connect(victim.addresses[0], wc.CONTROL, 0, "reader", 5)
    try:
        s.settimeout(10)
        req = wc.frame(wc.REGIONS_REQ, b"")
        try:
            for _ in range(20):  # ~6.5 MiB of answers per round, never read
                s.sendall(req * 1000)
        except (ConnectionResetError, BrokenPipeError):
            pass
        # its connection is not read while its answers wait (backpressure), and
        # closed once it took none of them for a while: with its receive window shut,
        # the agent's TCP_USER_TIMEOUT (5 s) ends it.  Reading here would take some.
        wait_for(lambda: _tcp_state(s) != 1, timeout_s=30, what="the connection closed")
    finally:
        s.close()
    _still_serves(make_agent, victim)


def test_connections_over_max_connections_are_closed_at_accept(make_agent, caplog):
    caplog.set_level(logging.WARNING, logger="kvlink")
    victim = make_agent("victim", max_connections=6)
    held = [wc.connect(victim.addresses[0], wc.DATA_CONN, 0, "many", 8) for _ in range(6)]
    try:
        extra = socket.create_connection(victim.addresses[0], timeout=5)
        assert wc.closed_by_peer(extra, within_s=3)
        extra.close()
    finally:
        for s in held:
            s.close()
    assert _logged(caplog, "max_connections")
    _still_serves(make_agent, victim)  # the count went down with the closes


def test_silent_connections_cannot_keep_a_peer_out(make_agent):
    """Connections that never send a HELLO cost nothing to open: when they fill the
    agent's connections, the oldest of them makes room for the next one, so a peer still
    gets in (it used to be closed at accept until the silent ones timed out)."""
    victim = make_agent("victim", max_connections=6, connect_timeout_s=30)
    silent = [socket.create_connection(victim.addresses[0], timeout=5) for _ in range(6)]
    try:
        _still_serves(make_agent, victim)  # control + 1 data connection of a real peer
        assert wc.closed_by_peer(silent[0], within_s=5)  # the oldest silent ones made room
    finally:
        for s in silent:
            s.close()


def test_one_peer_name_has_a_bounded_number_of_connections(make_agent):
    victim = make_agent("victim")
    limit = 4 * (64 + 1)
    socks = [wc.connect(victim.addresses[0], wc.DATA_CONN, 0, "greedy", 9) for _ in range(limit)]
    try:
        with socket.create_connection(victim.addresses[0], timeout=5) as s:
            s.sendall(wc.hello("greedy", 9, wc.DATA_CONN, 0))
            t, body = wc.recv_frame(s)
        assert t == wc.HELLO_ACK
        assert struct.unpack_from("<I", body)[0] == kvlink.ErrorCode.BUSY
    finally:
        for s in socks:
            s.close()


def test_a_frame_that_stops_arriving_is_cut(make_agent):
    victim = make_agent("victim", connect_timeout_s=0.5)
    s = wc.connect(victim.addresses[0], wc.DATA_CONN, 0, "slow", 3)
    try:
        body = struct.pack("<QIII", 1, 0, 1, 1)
        s.sendall(wc.frame(wc.DATA, body + bytes(48), 64)[:40])  # header and a bit of body
        assert wc.closed_by_peer(s, within_s=10)  # 6 x connect_timeout_s, checked each tick
    finally:
        s.close()


def _logged(caplog, text: str, within_s: float = 10) -> bool:
    """Whether a "kvlink" record containing ``text`` arrives (records are drained from the
    C core by a thread, so they come a little after the fact)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if any(text in r.getMessage() for r in caplog.records):
            return True
        time.sleep(0.05)
    return False


def _still_serves(make_agent, victim) -> None:
    dst = np.zeros(MiB, np.uint8)
    victim.register(dst, remote_write=True, name=f"kv{id(dst)}")
    tx = make_agent(f"tx{id(dst)}")
    src = np.full(MiB, 3, np.uint8)
    tx.register(src)
    tx.add_peer(victim.metadata())
    tx.push(victim.name, src=src, dst=f"kv{id(dst)}").wait(timeout_s=30)
    assert np.array_equal(dst, src)
