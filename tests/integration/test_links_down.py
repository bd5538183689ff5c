"""A moment with every link down is not a refusal (issue 22, item 6): a push or
pull submitted while every path to a peer is down and being re-probed is queued
and waits for a path until its deadline (paths() counts it, the log says so);
only a peer that stays unreachable until then fails it, naming each path's
reason; only a peer that is gone for good (it restarted) is to be added again."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest

import kvlink
from kvlink.bench.measure import random_bytes as pattern
from tests.integration.test_transfer import digest
from tests.waits import wait_for, wait_paths
from tests.wire_client import LinkProxy

MiB = 1 << 20
SIZE = 4 * MiB
DOWN = (kvlink.PathState.DOWN, kvlink.PathState.PROBING)


def _pair(make_agent: Any, name: str = "rx") -> tuple[Any, Any, LinkProxy, np.ndarray]:
    """tx -> proxy -> rx over two loopback paths each, TCP (every byte through the proxy).
    rx exposes "kv" (SIZE bytes, written and read remotely); its contents are returned."""
    rx = make_agent(name, nics="loopback:2", transport="tcp")
    kv = pattern(SIZE, seed=3)
    rx.register(kv, remote_write=True, remote_read=True, name="kv")
    tx = make_agent("tx", nics="loopback:2", transport="tcp", connect_timeout_s=1.0)
    proxy = LinkProxy(rx.metadata())
    tx.add_peer(proxy.metadata())
    return rx, tx, proxy, kv


def _all_links_down(tx: Any, proxy: LinkProxy) -> None:
    """Every link down, and every path has failed a reconnect since (what made submit refuse)."""
    proxy.down()
    wait_paths(
        tx, "rx", lambda mine: all(p.state in DOWN and p.reconnect_fails >= 1 for p in mine)
    )


def _submit(tx: Any, op: str, local: np.ndarray, timeout_s: float) -> kvlink.Transfer:
    if op == "push":
        return tx.push("rx", src=local, dst="kv", timeout_s=timeout_s)
    return tx.pull("rx", src="kv", dst=local, timeout_s=timeout_s)


@pytest.mark.parametrize("op", ["push", "pull"])
def test_transfer_submitted_with_every_link_down_waits_for_one(make_agent, caplog, op):
    # Before: refused at submit within 1 ms ("every path is down and failed to reconnect
    # ... add the peer again once it is back"), although the links came back by themselves.
    caplog.set_level(logging.INFO, logger="kvlink")
    _, tx, proxy, kv = _pair(make_agent)
    local = pattern(SIZE, seed=11) if op == "push" else np.zeros(SIZE, np.uint8)
    tx.register(local)
    try:
        _all_links_down(tx, proxy)
        h = _submit(tx, op, local, timeout_s=60)
        mine = wait_paths(tx, "rx", lambda mine: all(p.waiting == 1 for p in mine))
        assert all(p.state in DOWN and p.last_error for p in mine), mine
        assert not h.done, h.error
        wait_for(
            lambda: any("wait for a path" in r.getMessage() for r in caplog.records),
            10, "the log saying the transfer waits",
        )
        proxy.up()
        h.wait(timeout_s=30)
        assert digest(kv) == digest(local)
        mine = wait_paths(tx, "rx", lambda mine: all(p.waiting == 0 for p in mine))
        assert any(p.state not in DOWN for p in mine), mine
        assert any("go on" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        proxy.close()


@pytest.mark.parametrize("op", ["push", "pull"])
def test_peer_that_never_comes_back_fails_at_the_deadline(make_agent, op):
    _, tx, proxy, _ = _pair(make_agent)
    local = pattern(SIZE, seed=12) if op == "push" else np.zeros(SIZE, np.uint8)
    tx.register(local)
    try:
        _all_links_down(tx, proxy)
        h = _submit(tx, op, local, timeout_s=1.5)
        time.sleep(0.3)
        assert not h.done, f"failed before its deadline: {h.error}"
        with pytest.raises(kvlink.ConnectionLostError) as ei:
            h.wait(timeout_s=30)
        msg = str(ei.value)
        assert "missed its deadline" in msg and r"all 2 path(s) are down" in msg, msg
        for p in tx.paths():  # each path, by its addresses, with its reason
            assert f"path {p.index} {p.local}->{p.remote}: " in msg, (msg, p)
        assert "again" not in msg, msg  # nothing to re-add: the peer was never given up
        if op == "pull":
            assert not local.any()  # nothing was written
        # the peer is still there: it works once its links are back
        proxy.up()
        _submit(tx, op, local, timeout_s=30).wait(timeout_s=30)
    finally:
        proxy.close()


def test_waiting_transfer_ends_at_remove_peer_and_close(make_agent):
    _, tx, proxy, _ = _pair(make_agent)
    src = pattern(SIZE, seed=13)
    tx.register(src)
    try:
        _all_links_down(tx, proxy)
        h = tx.push("rx", src=src, dst="kv", timeout_s=60)
        wait_paths(tx, "rx", lambda mine: all(p.waiting == 1 for p in mine))
        tx.remove_peer("rx")
        with pytest.raises(kvlink.ConnectionLostError, match="removed"):
            h.wait(timeout_s=10)
        proxy.up()
        tx.add_peer(proxy.metadata())
        _all_links_down(tx, proxy)
        h = tx.push("rx", src=src, dst="kv", timeout_s=60)
        wait_paths(tx, "rx", lambda mine: all(p.waiting == 1 for p in mine))
        t0 = time.monotonic()
        tx.close()  # the waiting push holds no frame: close() does not linger for it
        assert time.monotonic() - t0 < 30
        with pytest.raises(kvlink.TransferAbortedError, match="closed"):
            h.wait(timeout_s=10)
    finally:
        proxy.close()


def test_restarted_peer_fails_waiting_transfers_and_says_to_add_it_again(make_agent):
    # a reconnect that meets another instance of the name: what the transfer was for is
    # gone, no path of this peer comes back: fail now, and only now say "add it again"
    rx, tx, proxy, _ = _pair(make_agent)
    src = pattern(SIZE, seed=14)
    tx.register(src)
    try:
        _all_links_down(tx, proxy)
        h = tx.push("rx", src=src, dst="kv", timeout_s=60)
        wait_paths(tx, "rx", lambda mine: all(p.waiting == 1 for p in mine))
        rx.close()  # it restarts: a new instance of the name
        new = make_agent("rx", nics="loopback:2", transport="tcp")
        kv = np.zeros(SIZE, np.uint8)
        new.register(kv, remote_write=True, name="kv")
        proxy.retarget(new.metadata())
        proxy.up()
        with pytest.raises(kvlink.ConnectionLostError, match="restarted") as ei:
            h.wait(timeout_s=30)
        assert "add it again" in str(ei.value), ei.value
        with pytest.raises(kvlink.PeerUnreachableError, match=r"restarted.*add it again"):
            tx.push("rx", src=src, dst="kv")
        tx.add_peer(new.metadata())  # the new instance replaces it
        tx.push("rx", src=src, dst="kv").wait(timeout_s=30)
        assert digest(kv) == digest(src)
    finally:
        proxy.close()
