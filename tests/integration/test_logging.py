"""The engine's path state changes and failures reach the "kvlink" logger,
with the peer and path they concern."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import kvlink

MiB = 1 << 20


def test_path_down_and_failure_are_logged_with_peer_and_path(make_agent, spawn_peer, caplog):
    caplog.set_level(logging.DEBUG, logger="kvlink")
    rx = spawn_peer("rx", nics="loopback:2")
    rx.call("alloc", key="kv", nbytes=MiB, remote_write=True, name="kv")
    tx = make_agent("tx", nics="loopback:2")
    src = np.ones(MiB, np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata)
    rx.kill()
    with pytest.raises(kvlink.ConnectionLostError):  # at its deadline, every path down
        tx.push("rx", src=src, dst="kv", timeout_s=1.0).wait(timeout_s=30)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        downs = [
            r
            for r in caplog.records
            if r.name == "kvlink"
            and "-> DOWN" in r.getMessage()
            and getattr(r, "kvlink_path", None) is not None
        ]
        if {r.kvlink_path for r in downs} >= {0, 1}:
            break
        time.sleep(0.05)
    assert {r.kvlink_path for r in downs} >= {0, 1}, caplog.text
    assert all(r.kvlink_peer == "rx" and r.levelno >= logging.DEBUG for r in downs)
    assert any(r.levelno == logging.WARNING and "UP -> DOWN" in r.getMessage() for r in downs)


def test_every_kvlink_record_carries_the_context_fields(make_agent, caplog):
    # a format naming %(kvlink_peer)s must work for the library's own records too
    caplog.set_level(logging.INFO, logger="kvlink")
    make_agent("ctx")
    records = [r for r in caplog.records if r.name == "kvlink"]
    assert records
    for r in records:
        assert hasattr(r, "kvlink_peer") and hasattr(r, "kvlink_path")
        logging.Formatter("%(kvlink_peer)s %(kvlink_path)s %(message)s").format(r)
