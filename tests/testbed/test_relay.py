"""Relayed paths on a three-host topology (root): prefill a, decode b, neighbour r relaying.

Links a-b 300mbit, a-r 1gbit, r-b 300mbit: a reaches b directly over a-b and through r over
a-r then r-b (no IP forwarding in r: only kvlink's relay carries a -> r -> b).  Each agent in
its own process in its namespace (kvlink.bench.Worker), as in production.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

import kvlink.testbed as kt
from kvlink.bench import Worker, share_run_secret

pytestmark = [pytest.mark.root, pytest.mark.timeout(180), pytest.mark.tools("libcrypto", "iperf3")]

MiB = 1 << 20
TAG = "rlt"
SPEC = "a-b:1x300mbit,a-r:1x1gbit,r-b:1x300mbit"  # links 0 a-b, 1 a-r, 2 r-b


class Trio:
    def __init__(self, topo: kt.Topology, size: int) -> None:
        share_run_secret()
        self.topo = topo
        self.r = Worker("r", name="r", nics=",".join(topo.addresses("r")),
                        config={"relay": True, "accept_relayed": False,
                                "relay_yield_mbps": 20},
                        prefix=topo.exec_prefix("r"))  # fmt: skip
        self.b = Worker("b", name="b", nics=",".join(topo.addresses("b")),
                        prefix=topo.exec_prefix("b"))  # fmt: skip
        self.a = Worker("a", name="a", nics=",".join(topo.addresses("a")),
                        config={"relays": [self.r.call("hello")["metadata"]],
                                "chunk_bytes": 4 * MiB, "min_chunk_bytes": MiB},
                        prefix=topo.exec_prefix("a"))  # fmt: skip
        self.b.call("alloc", key="kv", nbytes=size, remote_write=True, name="kv")
        self.a.call("alloc", key="src", nbytes=size, seed=5)
        self.a.call("add_peer", metadata=self.b.call("hello")["metadata"])

    def paths(self) -> list[dict[str, Any]]:
        return list(self.a.call("paths")["paths"])

    def relayed_up(self, timeout_s: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            via = [p for p in self.paths() if p["relay"]]
            if via and via[0]["state"] == "UP":
                return via[0]
            assert time.monotonic() < deadline, f"relayed path not up: {self.paths()}"
            time.sleep(0.1)

    def push(self) -> dict[str, Any]:
        x = self.a.call("push", peer="b", local="src", remote="kv")
        w: dict[str, Any] = self.a.call("wait", id=x["id"], wait_s=90, answer_s=100)
        return w

    def verified(self) -> bool:
        return bool(self.a.call("digest", key="src")["digest"]
                    == self.b.call("digest", key="kv")["digest"])  # fmt: skip

    def close(self) -> None:
        for w in (self.a, self.b, self.r):
            w.close()


@pytest.fixture
def trio() -> Iterator[Any]:
    made: list[Trio] = []
    kt.teardown(TAG)
    with kt.Topology(SPEC, tag=TAG) as topo:

        def make(size: int = 96 * MiB) -> Trio:
            made.append(Trio(topo, size))
            return made[-1]

        yield make
        for t in made:
            t.close()


def test_the_relayed_path_goes_over_both_hops_and_carries_its_share(trio):
    t = trio()
    via = t.relayed_up()
    topo = t.topo
    # hop one: a's a-r address -> r's; hop two: r -> b's r-b address (its sealed port)
    assert via["local"] == topo.address("a", 1)
    assert via["relay_addr"].startswith(topo.address("r", 1) + ":")
    assert via["remote"].startswith(topo.address("b", 2) + ":")
    assert "sealed" in via["transport_note"]
    # a's a-r NIC has no direct path to b (its link leads to r only)
    direct = [p for p in t.paths() if not p["relay"]]
    assert [p["local"] for p in direct] == [topo.address("a", 0)]
    w = t.push()
    assert w["state"] == "DONE" and t.verified()
    sent = {bool(p["relay"]): d["bytes_sent"] for p, d in zip(w["paths"], w["path_delta"],
                                                               strict=True)}  # fmt: skip
    # two paths of equal rate: the relayed one carries a real share, not a token chunk
    assert sent[True] > 0.25 * 96 * MiB, sent
    assert sent[False] > 0.25 * 96 * MiB, sent
    assert t.r.call("relay_stats")["relayed_bytes"] >= sent[True]


def test_a_relay_killed_mid_transfer_costs_only_its_chunks(trio):
    t = trio(192 * MiB)
    t.relayed_up()
    x = t.a.call("push", peer="b", local="src", remote="kv", notify="6b696c6c6564")
    deadline = time.monotonic() + 30
    while t.r.call("relay_stats")["relayed_bytes"] < 8 * MiB:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t.r.kill()
    w = t.a.call("wait", id=x["id"], wait_s=90, answer_s=100)
    assert w["state"] == "DONE" and t.verified()
    via = next(p for p in t.paths() if p["relay"])
    assert via["state"] in ("DOWN", "PROBING")
    got = t.b.call("notifications", wait_s=5)["notifications"]
    time.sleep(1.5)  # a duplicate would be re-sent within a second
    got += t.b.call("notifications")["notifications"]
    assert [n["tag"] for n in got] == ["6b696c6c6564"]


def test_the_relay_takes_its_nic_back_for_its_own_traffic(trio):
    t = trio(192 * MiB)
    t.relayed_up()
    topo = t.topo
    # r's own traffic to b over the r-b link the relay lends: a plain TCP blast
    sink = topo.run("b", [sys.executable, "-c", _SINK, topo.address("b", 2)],
                    stdout=subprocess.DEVNULL)  # fmt: skip
    time.sleep(0.5)
    x = t.a.call("push", peer="b", local="src", remote="kv")
    time.sleep(0.3)
    blast = topo.run("r", [sys.executable, "-c", _BLAST, topo.address("b", 2), "6"],
                     stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            via = next(p for p in t.paths() if p["relay"])
            if via["state"] in ("DOWN", "PROBING"):
                break
            assert time.monotonic() < deadline, f"the relay kept lending: {via}"
            time.sleep(0.05)
        # its probes are refused, saying why, while the traffic lasts
        while "own traffic" not in via["last_error"]:
            assert time.monotonic() < deadline + 5, f"no refusal seen: {via}"
            time.sleep(0.05)
            via = next(p for p in t.paths() if p["relay"])
        w = t.a.call("wait", id=x["id"], wait_s=90, answer_s=100)
        assert w["state"] == "DONE" and t.verified()
        assert t.r.call("relay_stats")["yields"] >= 1
    finally:
        blast.kill()
        sink.kill()
        blast.wait()
        sink.wait()
    # quiet again: the path comes back (probes after the relay's hold of 1 s)
    t.relayed_up(timeout_s=20)


_SINK = """
import socket, sys
s = socket.create_server((sys.argv[1], 5599))
c, _ = s.accept()
while c.recv(1 << 20):
    pass
"""

_BLAST = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5599))
end = time.monotonic() + float(sys.argv[2])
buf = b"x" * (1 << 20)
while time.monotonic() < end:
    c.sendall(buf)
"""

