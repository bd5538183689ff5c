"""A listening agent under resource pressure from the network: it sheds what
it cannot serve, says why, and keeps serving everyone else."""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket

import numpy as np

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
    assert any("out of file descriptors" in r.getMessage() for r in caplog.records)
