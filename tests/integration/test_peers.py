"""Peers: the control connection over any path that works, remove_peer, and
peers replaced by a restarted agent of the same name."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvlink
from kvlink import _native
from kvlink.bench.measure import random_bytes as pattern
from tests.integration.test_transfer import digest
from tests.waits import wait_paths
from tests.wire_client import RewritingProxy

MiB = 1 << 20


def test_remove_peer_fails_its_transfers_and_frees_the_name(make_agent, spawn_peer):
    rx = spawn_peer("rx", nics="loopback:2")
    rx.call("alloc", key="kv", nbytes=256 * MiB, remote_write=True, name="kv")
    tx = make_agent("tx", nics="loopback:2")
    src = pattern(256 * MiB, seed=4)
    tx.register(src)
    tx.add_peer(rx.metadata)
    h = tx.push("rx", src=src, dst="kv")
    tx.remove_peer("rx")
    with pytest.raises(kvlink.ConnectionLostError, match="removed"):
        h.wait(timeout_s=30)
    assert tx.paths() == []
    with pytest.raises(kvlink.UnknownPeerError):
        tx.push("rx", src=src, dst="kv")
    with pytest.raises(kvlink.UnknownPeerError):
        tx.remove_peer("rx")
    # the name can be added again and works
    tx.add_peer(rx.metadata)
    tx.push("rx", src=src, dst="kv").wait(timeout_s=30)
    assert rx.call("digest", key="kv")["digest"] == digest(src)
    assert len(tx.paths()) == 2


def test_restarted_peer_replaces_the_old_one(make_agent, spawn_peer):
    tx = make_agent("tx", nics="loopback:2")
    src = np.full(MiB, 3, np.uint8)
    tx.register(src)
    for round_ in range(3):  # the same name, a new instance each time
        rx = spawn_peer("rx", nics="loopback:2")
        rx.call("alloc", key="kv", nbytes=MiB, remote_write=True, name="kv")
        tx.add_peer(rx.metadata)
        tx.push("rx", src=src, dst="kv").wait(timeout_s=30)
        assert rx.call("digest", key="kv")["digest"] == digest(src), round_
        rx.kill()
    # only the live peer's paths are listed: replaced ones are gone
    assert len(tx.paths()) == 2


def test_restart_is_recognised_before_the_engine_sees_the_old_one_die(make_agent, spawn_peer):
    """add_peer right after the old agent died: its paths still look up to
    the engine (no reconnect has failed yet), but nothing listens at its
    addresses any more, so the new instance replaces it."""
    tx = make_agent("tx", nics="loopback:2")
    src = np.full(MiB, 5, np.uint8)
    tx.register(src)
    old = spawn_peer("rx", nics="loopback:2")
    old.call("alloc", key="kv", nbytes=MiB, remote_write=True, name="kv")
    tx.add_peer(old.metadata)
    tx.push("rx", src=src, dst="kv").wait(timeout_s=30)
    new = spawn_peer("rx", nics="loopback:2")  # ready before the old one dies
    new.call("alloc", key="kv", nbytes=MiB, remote_write=True, name="kv")
    old.kill()
    tx.add_peer(new.metadata)
    tx.push("rx", src=src, dst="kv").wait(timeout_s=30)
    assert new.call("digest", key="kv")["digest"] == digest(src)


def test_two_live_agents_of_one_name_are_refused(make_agent, spawn_peer):
    tx = make_agent("tx", nics="loopback:2")
    first = spawn_peer("rx", nics="loopback:2")
    second = spawn_peer("rx", nics="loopback:2")
    tx.add_peer(first.metadata)
    with pytest.raises(kvlink.DuplicateNameError, match=r"two live agents.*remove_peer\('rx'\)"):
        tx.add_peer(second.metadata)
    assert len(tx.paths()) == 2  # the first one is untouched


def test_transfer_pinned_to_an_instance(make_agent):
    """push/pull(instance=...) move bytes only while the peer is that instance: a caller
    holding a restarted peer's old metadata (its blocks are gone) gets an error, not the new
    instance's memory."""

    rx = make_agent("rx", nics="loopback:2")
    tx = make_agent("tx", nics="loopback:2")
    dst = np.zeros(1 << 20, np.uint8)
    rx.register(dst, remote_write=True, remote_read=True, name="kv")
    src = np.full(1 << 20, 9, np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata())
    with pytest.raises(kvlink.PeerUnreachableError, match="it restarted"):
        tx.push("rx", src=src, dst="kv", instance=rx.instance_id ^ 1)
    with pytest.raises(kvlink.PeerUnreachableError, match="it restarted"):
        tx.pull("rx", src="kv", dst=src, instance=rx.instance_id ^ 1)
    assert not dst.any()  # nothing was sent
    with pytest.raises(kvlink.InvalidArgumentError, match="instance"):
        tx.push("rx", src=src, dst="kv", instance=-1)
    tx.push("rx", src=src, dst="kv", instance=rx.instance_id).wait(timeout_s=30)
    assert (dst == 9).all()


UP = (kvlink.PathState.UP, kvlink.PathState.DEGRADED)


def test_path_changes_wake_their_waiters(make_agent, scripted_receiver):
    """kvl_paths_wait, what prepare() sleeps in: the current generation at once, a timeout
    while nothing changes, woken by a path's (or the control connection's) state change and
    by close()."""
    rx = scripted_receiver("rx", paths=2)
    tx = make_agent("tx", nics="loopback:2")
    tx.add_peer(rx.metadata)
    wait_paths(tx, "rx", lambda mine: len(mine) == 2 and all(p.state in UP for p in mine))
    gen = _native.paths_wait(tx._using, 0, 0)
    assert gen, "seen=0 answers the current generation"
    assert _native.paths_wait(tx._using, gen, 0.3) is None  # nothing changed
    rx.kill()
    now = _native.paths_wait(tx._using, gen, 30)
    assert now is not None and now != gen
    # (that may have been the control connection's change, which paths() does not show)
    wait_paths(tx, "rx", lambda mine: any(p.state not in UP for p in mine))
    got: list[BaseException] = []

    def waiter() -> None:
        seen = now
        try:
            for _ in range(1000):  # the dead paths' re-probes change states meanwhile
                seen = _native.paths_wait(tx._using, seen, 60) or seen
        except BaseException as exc:  # handed to the test thread
            got.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    tx.close()
    t.join(10)
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], kvlink.ClosedError), got


def test_prepare_waits_for_paths_to_come_back(make_agent):
    """prepare() sleeps until the peer's paths are up again (re-probed by the monitor),
    then returns them; with none coming back it fails at timeout_s, and close() ends it."""
    rx = make_agent("rx", nics="loopback:2")
    tx = make_agent("tx", nics="loopback:2", connect_timeout_s=1.0)
    proxy = RewritingProxy(rx.metadata(), lambda body: body)
    try:
        tx.add_peer(proxy.metadata())
        assert all(p.state in UP for p in tx.prepare("rx", timeout_s=30))
        proxy.cut()  # every connection reset; new ones still go through
        wait_paths(tx, "rx", lambda mine: any(p.state not in UP for p in mine))
        paths = tx.prepare("rx", timeout_s=30)
        assert len(paths) == 2 and all(p.state in UP for p in paths)
        rx.close()  # now nothing comes back (the proxy cannot reach it)
        proxy.cut()
        wait_paths(tx, "rx", lambda mine: all(p.state not in UP for p in mine))
        with pytest.raises(kvlink.PeerUnreachableError, match=r"came up within 0\.3 s"):
            tx.prepare("rx", timeout_s=0.3)
        got: list[BaseException] = []

        def prepare() -> None:
            try:
                tx.prepare("rx", timeout_s=60)
            except BaseException as exc:  # handed to the test thread
                got.append(exc)

        t = threading.Thread(target=prepare)
        t.start()
        tx.close()
        t.join(10)
        assert not t.is_alive() and len(got) == 1 and isinstance(got[0], kvlink.ClosedError)
    finally:
        proxy.close()


def test_a_slow_add_peer_of_a_restarted_peer_stalls_no_other_call(make_agent):
    """add_peer of a known name (a restarted peer) connects while every other call of the
    agent goes on: before, it held the agent's lock for its whole connect (up to
    connect_timeout_s a path) and a push to a healthy peer waited all that time (issue 32,
    item 3)."""
    import json
    import socket

    tx = make_agent("tx", connect_timeout_s=3.0)
    c = make_agent("c")
    dst = np.zeros(MiB, np.uint8)
    c.register(dst, remote_write=True, name="kv")
    tx.add_peer(c.metadata())
    src = np.full(MiB, 7, np.uint8)
    tx.register(src)
    old = make_agent("rx")
    md = json.loads(old.metadata())
    tx.add_peer(old.metadata())
    old.close()
    wait_paths(tx, "rx", lambda ps: ps and all(p.state == kvlink.PathState.DOWN for p in ps))
    # "rx" restarted as a process that takes connections and never answers
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    arrived = threading.Event()

    def accept() -> None:
        while True:
            try:
                conn, _ = silent.accept()
            except OSError:
                return
            held.append(conn)
            arrived.set()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    md.update(instance=f"{0x5eed:016x}", addrs=[["127.0.0.1", silent.getsockname()[1]]])
    failed: list[BaseException] = []

    def add() -> None:
        try:
            tx.add_peer(md)
        except kvlink.KvlinkError as exc:
            failed.append(exc)

    adder = threading.Thread(target=add)
    try:
        adder.start()
        assert arrived.wait(timeout=10), "add_peer never reached the restarted peer"
        tx.push("c", src=src, dst="kv").wait(timeout_s=30)
        assert adder.is_alive(), "the push waited for the add_peer"
        assert np.array_equal(dst, src)
        adder.join(timeout=30)
        assert not adder.is_alive()
        assert failed and isinstance(failed[0], (kvlink.PeerUnreachableError,
                                                 kvlink.HandshakeError)), failed
        tx.push("c", src=src, dst="kv").wait(timeout_s=30)  # and the agent works on
    finally:
        silent.close()
        for conn in held:
            conn.close()
        adder.join(timeout=30)
