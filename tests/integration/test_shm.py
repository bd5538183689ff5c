"""Same-host paths: another process on this host gets its payloads copied process to
process (cross-memory attach, csrc/transport/tcp/cma.h; docs/ucx.md, "Same-host
peers"), every byte still verified by its crc32c; and what a hostile same-host client
can and cannot make the receiver copy."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import struct

import numpy as np
import pytest

import kvlink
from kvlink.bench import measure
from tests import wire_client as wc
from tests.waits import wait_paths

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
UP = (kvlink.PathState.UP, kvlink.PathState.DEGRADED)


def transports(agent: kvlink.Agent, peer: str) -> set[str]:
    return {p.transport for p in agent.paths() if p.peer == peer}


def test_push_and_pull_between_processes_go_process_to_process(make_agent, spawn_peer):
    n = 48 * MiB  # several chunks per path
    rx = spawn_peer("rx", nics="loopback:2")
    rx.call("alloc", key="kv", nbytes=n, remote_write=True, remote_read=True, name="kv")
    tx = make_agent("tx", nics="loopback:2", min_chunk_bytes=4 * MiB)
    src = measure.random_bytes(n, 7)
    back = np.zeros(n, np.uint8)
    rs, rb = tx.register(src), tx.register(back)
    tx.add_peer(rx.call("hello")["metadata"].encode())
    assert transports(tx, "rx") == {"shm"}, [p.transport_note for p in tx.paths()]
    assert all("CMA" in p.transport_note for p in tx.paths())
    sent0 = sum(p.bytes_sent for p in tx.paths())
    tx.push("rx", src=rs, dst="kv").wait(timeout_s=60)
    assert rx.call("digest", key="kv")["digest"] == measure.digest(src)
    assert sum(p.bytes_sent for p in tx.paths()) - sent0 == n
    assert sum(1 for p in tx.paths() if p.chunks_done) == 2, "both paths carried chunks"
    rx.call("fill", key="kv", seed=9)
    tx.pull("rx", src="kv", dst=rb).wait(timeout_s=60)
    assert measure.digest(back) == rx.call("digest", key="kv")["digest"]


@pytest.mark.parametrize("side", ["receiver", "initiator"])
def test_transport_tcp_on_either_side_keeps_tcp(make_agent, spawn_peer, side):
    rx = spawn_peer("rx", **({"transport": "tcp"} if side == "receiver" else {}))
    rx.call("alloc", key="kv", nbytes=MiB, remote_write=True, name="kv")
    tx = make_agent("tx", **({"transport": "tcp"} if side == "initiator" else {}))
    src = measure.random_bytes(MiB, 3)
    tx.add_peer(rx.call("hello")["metadata"].encode())
    assert transports(tx, "rx") == {"tcp"}
    tx.push("rx", src=tx.register(src), dst="kv").wait(timeout_s=30)
    assert rx.call("digest", key="kv")["digest"] == measure.digest(src)


def test_two_agents_of_one_process_run_tcp(make_agent):
    rx, tx = make_agent("rx"), make_agent("tx")
    tx.add_peer(rx.metadata())
    assert transports(tx, "rx") == {"tcp"}


def test_metadata_host_fields_are_checked(make_agent):
    tx = make_agent("tx")
    rx = make_agent("rx")
    md = json.loads(rx.metadata())
    for bad in ({"pid": "1"}, {"pid": -1}, {"shm": "yes"}, {"host": 5}, {"host": "x" * 300}):
        with pytest.raises(kvlink.InvalidArgumentError, match=r"metadata: '(pid|host)'"):
            tx.add_peer({**md, **bad})
    tx.add_peer(md)  # and the metadata as it is connects


# ---- a raw same-host client (tests/wire_client.py) against a receiving agent ----


@pytest.fixture
def target(make_agent):
    rx = make_agent("rx")
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    return rx, dst, rid, wc.key_of(rx.metadata(), rid)


def closed_by_agent(s: socket.socket) -> bool:
    """True when the agent closes the connection (any frames before that are read)."""
    try:
        while True:
            wc.recv_frame(s)
    except TimeoutError:
        return False  # still open after the socket's timeout
    except OSError:  # closed or reset
        return True


def test_cma_copies_from_the_process_that_owns_the_socket(target):
    rx, dst, rid, key = target
    src = (ctypes.c_uint8 * 4096).from_buffer(bytearray(os.urandom(4096)))
    addr = ctypes.addressof(src)
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99, movers=wc.MOVER_SHM)
    try:
        s.sendall(wc.announce(5, 4096, 1))
        ranges = [(addr, 1000), (addr + 1000, 3096)]
        s.sendall(wc.cma_data(5, 0, 1, rid, 4096, key, os.getpid(), ranges))
        s.sendall(struct.pack("<I", wc.crc(bytes(src))))
        assert struct.unpack_from("<QIII", wc.recv_until(s, wc.ACK))[3] == 0
    finally:
        s.close()
    assert dst[:4096].tobytes() == bytes(src) and not dst[4096:].any()


def test_cma_wrong_trailer_is_not_acknowledged(target):
    rx, _, rid, key = target
    src = (ctypes.c_uint8 * 4096).from_buffer(bytearray(b"\x05" * 4096))
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99, movers=wc.MOVER_SHM)
    try:
        s.sendall(wc.announce(5, 4096, 1))
        ranges = [(ctypes.addressof(src), 4096)]
        s.sendall(wc.cma_data(5, 0, 1, rid, 4096, key, os.getpid(), ranges))
        s.sendall(struct.pack("<I", wc.crc(bytes(src)) ^ 1))
        assert struct.unpack_from("<QIII", wc.recv_until(s, wc.ACK))[3] != 0
    finally:
        s.close()


@pytest.mark.parametrize(
    "case",
    ["no-hello-flag", "other-process", "short-ranges", "zero-ranges", "wrapping-range"],
)
def test_hostile_cma_frames_close_the_connection_and_copy_nothing(target, make_agent, case):
    rx, dst, rid, key = target
    secret = (ctypes.c_uint8 * 4096).from_buffer(bytearray(b"\x07" * 4096))
    addr = ctypes.addressof(secret)
    pid = os.getpid()
    ranges = [(addr, 4096)]
    if case == "other-process":
        pid = 1  # init owns no end of this connection: reading it is refused
    elif case == "short-ranges":
        ranges = [(addr, 4000)]
    elif case == "zero-ranges":
        ranges = []
    elif case == "wrapping-range":
        ranges = [(2**64 - 16, 4096)]
    movers = 0 if case == "no-hello-flag" else wc.MOVER_SHM
    s = wc.connect(rx.addresses[0], wc.DATA_CONN, 0, "raw", 99, movers=movers)
    s.settimeout(10)
    try:
        s.sendall(wc.announce(5, 4096, 1))
        s.sendall(wc.cma_data(5, 0, 1, rid, 4096, key, pid, ranges) + struct.pack("<I", 0))
        assert closed_by_agent(s)
    finally:
        s.close()
    assert not dst.any(), "nothing may be placed from a refused descriptor"
    # the agent goes on serving others
    tx = make_agent("tx")
    tx.add_peer(rx.metadata())
    src = measure.random_bytes(MiB, 1)
    tx.push("rx", src=tx.register(src), dst=rid).wait(timeout_s=30)
    assert dst.tobytes() == src.tobytes()


def test_tcp_listener_refuses_a_cma_hello(make_agent):
    rx = make_agent("rx", transport="tcp")
    s = socket.create_connection(rx.addresses[0], timeout=10)
    try:
        s.sendall(wc.hello("raw", 99, wc.DATA_CONN, 0, movers=wc.MOVER_SHM))
        t, body = wc.recv_frame(s)
        assert t == wc.HELLO_ACK and struct.unpack_from("<I", body)[0] != 0
        assert b"takes no same-host copies" in body
    finally:
        s.close()


@pytest.mark.parametrize("staged", ["sender", "receiver", "both"])
def test_staged_payloads_cross_a_same_host_path(make_agent, spawn_peer, staged):
    # staged frames (GPU memory; here stage_host_memory) go in-stream from the
    # sender's slot, never as a descriptor of a slot that is reused once the
    # frame left; a staged receiver copies into its slot and then places
    n = 48 * MiB
    rx = spawn_peer("rx", nics="loopback:2", stage_host_memory=staged != "sender")
    rx.call("alloc", key="kv", nbytes=n, remote_write=True, remote_read=True, name="kv")
    tx = make_agent("tx", nics="loopback:2", stage_host_memory=staged != "receiver")
    src = measure.random_bytes(n, 5)
    back = np.zeros(n, np.uint8)
    rs, rb = tx.register(src), tx.register(back)
    tx.add_peer(rx.call("hello")["metadata"].encode())
    assert transports(tx, "rx") == {"shm"}
    tx.push("rx", src=rs, dst="kv").wait(timeout_s=60)
    assert rx.call("digest", key="kv")["digest"] == measure.digest(src)
    tx.pull("rx", src="kv", dst=rb).wait(timeout_s=60)
    assert back.tobytes() == src.tobytes()


def test_sender_killed_mid_push_reports_nothing_more_done(make_agent, spawn_peer):
    # the receiver copies from the sender's memory: when that process dies mid-copy
    # (ESRCH / EFAULT, or its connections reset first) the receiver neither crashes nor
    # reports another chunk done, and goes on serving others.  (The push itself ends at
    # the sender's deadline or the caller's timeout, over TCP alike: no deadline here.)
    n = 1024 * MiB  # ~0.2 s over shm here: the kill lands mid-push
    rx = make_agent("rx", nics="loopback:2")
    dst = np.zeros(n, np.uint8)
    rid = rx.register(dst, remote_write=True, name="kv").id
    tx = spawn_peer("tx", nics="loopback:2")
    tx.call("alloc", key="src", nbytes=n, fill="pattern", seed=4)
    tx.call("add_peer", metadata=rx.metadata().decode())
    # rx's own paths to tx: they show when rx has seen tx's sockets close
    rx.add_peer(tx.call("hello")["metadata"].encode())
    tx.call("push", peer="rx", local="src", remote=rid, notify=b"dying".hex())
    h = rx.inbound(b"dying", timeout_s=10)
    assert not h.done, "the push finished before the kill; nothing was tested"
    tx.kill()  # returns once the process is reaped: its memory and sockets are gone
    # the copies in flight end as rx's engine meets the closed sockets: wait for it to
    # have met those of its own paths (the push's close with them)
    wait_paths(rx, "tx", lambda mine: all(p.state not in UP for p in mine))
    frozen = h.bytes_done
    with pytest.raises(kvlink.TransferTimeoutError):
        h.wait(timeout_s=1)
    assert h.bytes_done == frozen < n and not h.ok
    # the receiver goes on: another sender pushes into the same region
    tx2 = make_agent("tx2", nics="loopback:2")
    src = measure.random_bytes(MiB, 2)
    tx2.add_peer(rx.metadata())
    tx2.push("rx", src=tx2.register(src), dst=rid, nbytes=MiB).wait(timeout_s=30)
    assert dst[:MiB].tobytes() == src.tobytes()
