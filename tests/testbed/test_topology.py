"""Tests of multi-host topologies (kvlink.testbed.Topology) against real namespaces.

Tests marked ``root`` build namespaces (each with a tag of its own from the ``testbed``
fixture, which removes every namespace of it afterwards); the others check parsing only.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, Protocol

import pytest

import kvlink.testbed as kt
from kvlink.cli.testbed import main as cli_main


class Factory(Protocol):
    """The ``testbed`` fixture (conftest.TestbedFactory); only its tags are used here."""

    def reserve_tag(self) -> str: ...


RELAY = "a-b:2x2gbit,a-r:1x8gbit,r-b:2x2gbit"
PROBE_PORT = 7200

# Listens on every address of its namespace and answers each connection with the address the
# client came from, which tells which link it used.
PROBE_SERVER = r"""
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen(64)
print("ready", flush=True)
while True:
    conn, peer = srv.accept()
    conn.sendall(peer[0].encode())
    conn.close()
"""

PROBE_CLIENT = r"""
import json, socket, sys
out = []
for addr in sys.argv[2:]:
    try:
        with socket.create_connection((addr, int(sys.argv[1])), timeout=1.0) as s:
            s.settimeout(1.0)
            out.append({"ok": True, "seen_as": s.recv(64).decode()})
    except OSError as exc:
        out.append({"ok": False, "error": repr(exc)})
print(json.dumps(out))
"""


def namespaces_of(tag: str) -> list[str]:
    return sorted(ns for ns in kt._list_netns() if ns.startswith(f"kvl{tag}"))


@contextlib.contextmanager
def probe_server(topo: kt.Topology, host: str) -> Iterator[None]:
    server = topo.run(
        host,
        [sys.executable, "-c", PROBE_SERVER, str(PROBE_PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    with server:
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            yield
        finally:
            server.kill()


def probe(topo: kt.Topology, host: str, addresses: list[str]) -> list[dict[str, Any]]:
    """A TCP connection from ``host`` to each address; one result dict each."""
    done = subprocess.run(
        [*topo.exec_prefix(host), sys.executable, "-c", PROBE_CLIENT, str(PROBE_PORT), *addresses],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


@pytest.fixture
def topology(testbed: Factory) -> Iterator[Any]:
    """Factory: ``topology(spec)`` returns an up Topology with a tag the ``testbed`` fixture
    removes after the test; every one is also brought down here."""
    made: list[kt.Topology] = []

    def make(spec: str, tag: str | None = None) -> kt.Topology:
        topo = kt.Topology(spec, tag=tag or testbed.reserve_tag())
        made.append(topo)
        topo.up()
        return topo

    try:
        yield make
    finally:
        for topo in reversed(made):
            topo.down()


# ----------------------------------------------------------------------------------------------
# Parsing and naming (no root needed)


def test_relay_spec_numbers_links_in_order_and_addresses_them() -> None:
    topo = kt.Topology(RELAY, tag="x")
    assert topo.hosts == ("a", "b", "r") and len(topo) == 5
    assert topo.spec == "a-b:2x2gbit,a-r:1x8gbit,b-r:2x2gbit"  # hosts of an item sorted
    assert kt.Topology("relay3", tag="x").spec == topo.spec
    assert [(link.ends, link.rate) for link in topo.links()] == [
        (("a", "b"), "2gbit"),
        (("a", "b"), "2gbit"),
        (("a", "r"), "8gbit"),
        (("b", "r"), "2gbit"),
        (("b", "r"), "2gbit"),
    ]
    r_b = topo.link(3)
    assert r_b.subnet == "198.18.3.0/24"
    assert r_b.addrs == {"b": "198.18.3.1", "r": "198.18.3.2"}  # b sorts first: .1
    assert r_b.devs == {"b": "kvlxb3", "r": "kvlxr3"} and r_b.peer("r") == "b"
    assert topo.namespace("r") == "kvlxr"
    assert topo.addresses("b") == ["198.18.0.2", "198.18.1.2", "198.18.3.1", "198.18.4.1"]
    assert topo.addresses("b", "r") == ["198.18.3.1", "198.18.4.1"]
    assert topo.addresses("a", "r") == ["198.18.2.1"]
    assert [link.index for link in topo.links("r")] == [2, 3, 4]
    groups = [kt.LinkGroup(("b", "a"), 2, "2gbit"), ("a", "r", 1, "8gbit"), ("r", "b", 2, 2e9)]
    groups[2] = ("r", "b", 2, 2_000_000_000)  # rates as ints in bit/s, as parse_rate takes them
    assert kt.Topology(groups, tag="x").spec == topo.spec


def test_two_host_spec_matches_the_testbed() -> None:
    topo = kt.Topology("a-b:4x2gbit", tag="tb", subnet_base=254)
    tb = kt.Testbed(links=4, rate="2gbit", tag="tb", subnet_base=254)
    for side in "ab":
        assert topo.namespace(side) == tb.namespace(side)
        assert topo.addresses(side) == tb.addresses(side)
        assert [topo.device(side, i) for i in range(4)] == [tb.device(side, i) for i in range(4)]
    assert topo.subnet(3) == tb.subnet(3) == "198.19.1.0/24"
    assert topo.rates == tb.rates


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("", "empty spec"),
        ("a-b", r"item 0 'a-b': not understood; write it as X-Y:NxRATE"),
        ("a-b:2x2gbit,a-r", r"item 1 'a-r': not understood"),
        ("a-b:2x2gbit,,", r"item 1 '': not understood"),
        ("a-a:1x1gbit", "links host 'a' to itself"),
        ("A-b:1x1gbit", "host: 'A' must be a lowercase letter"),
        ("1a-b:1x1gbit", "host: '1a' must be a lowercase letter"),
        ("a-b:0x1gbit", "count: 0 links; give 1 to 64"),
        ("a-b:2x2gbt", "rate: unknown unit 'gbt'"),
        ("a-b:2x3gbps", "bytes per second"),
        ("a-b:1x10kbit", "below the minimum"),
    ],
)
def test_bad_specs_name_the_item_and_the_fix(spec: str, fragment: str) -> None:
    with pytest.raises(kt.TestbedConfigError, match=fragment) as info:
        kt.Topology(spec)
    assert str(info.value).startswith("topology")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("spec", "kwargs", "fragment"),
    [
        ("a-b:40x1gbit,a-r:30x1gbit", {}, "70 links in all; at most 64"),
        ("a-b:2xnone", {"subnet_base": 511}, "^subnet_base: "),
        ("a-b:1xnone,abcd-b:1xnone", {"tag": "abcdefgh"}, "'kvlabcdefghabcd1' .16 characters"),
        ("a1-c:1xnone,a-b:11xnone", {}, "'kvltba10' would be both host 'a1' link 0 and host 'a'"),
        ("a-b:1xnone", {"tag": "Bad!"}, "^tag: "),
        ([("a", "b", 1, "fast")], {}, r"^link_groups\[0\]: rate: cannot parse"),
        ([("a", "b")], {}, r"^link_groups\[0\]: expected a LinkGroup"),
        ([], {}, "no link groups"),
    ],
)
def test_config_errors_name_the_argument(spec: Any, kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(kt.TestbedConfigError, match=fragment):
        kt.Topology(spec, **kwargs)


def test_lookups_refuse_hosts_and_links_not_in_the_topology() -> None:
    topo = kt.Topology(RELAY, tag="x")
    with pytest.raises(kt.TestbedConfigError, match=r"'q' is not a host .*hosts: a, b, r"):
        topo.namespace("q")
    with pytest.raises(kt.TestbedConfigError, match="'r' is not an end of link 0"):
        topo.address("r", 0)
    with pytest.raises(kt.TestbedConfigError, match="link: 5 is not a link"):
        topo.link(5)
    with pytest.raises(kt.TestbedConfigError, match="peer"):
        topo.addresses("a", "a")
    with pytest.raises(kt.TestbedConfigError, match="argv"):
        topo.run("a", "ip addr")
    with pytest.raises(kt.TestbedConfigError, match=r"flows\[1\].*does not join a and b"):
        kt.iperf3_aggregate(topo, [("a", "b", 0), ("a", "b", 2)], seconds=1)


# ----------------------------------------------------------------------------------------------
# Real namespaces


@pytest.mark.root
def test_up_down_leaves_nothing_and_any_teardown_of_the_tag_removes_every_host(
    testbed: Factory,
) -> None:
    tag = testbed.reserve_tag()
    topo = kt.Topology(RELAY, tag=tag)
    topo.up()
    topo.up()  # again: no error, same state
    assert namespaces_of(tag) == [f"kvl{tag}a", f"kvl{tag}b", f"kvl{tag}r"]
    state = topo.status()
    assert state["up"] and [link["ends"] for link in state["links"]] == [
        ["a", "b"], ["a", "b"], ["a", "r"], ["b", "r"], ["b", "r"]
    ]  # fmt: skip
    for link in topo.links():
        for host in link.ends:
            end = state["links"][link.index]["hosts"][host]
            assert end["device"] == link.devs[host] and end["address"] == f"{link.addrs[host]}/24"
            assert end["admin_up"] and end["rate"] == link.rate
    for host in topo.hosts:
        forward = subprocess.run(
            [*topo.exec_prefix(host), "cat", "/proc/sys/net/ipv4/ip_forward"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert forward.stdout.strip() == "0", host
    assert kt.Topology.attach(tag).spec == topo.spec
    stray = subprocess.Popen([*topo.exec_prefix("r"), "sleep", "60"])
    assert kt.teardown(tag) is True  # the tag alone finds r, a host Testbed does not have
    assert stray.wait(timeout=5) != 0
    assert namespaces_of(tag) == [] and kt.inspect_topology(tag)["up"] is False
    topo.down()  # idempotent

    with kt.Topology("a-b:1xnone,b-c:1xnone", tag=tag) as again:
        assert again.status()["up"] and namespaces_of(tag) == [f"kvl{tag}{h}" for h in "abc"]
    assert namespaces_of(tag) == []


@pytest.mark.root
def test_a_reaches_b_directly_and_r_reaches_b_but_nothing_is_forwarded(topology: Any) -> None:
    topo: kt.Topology = topology(RELAY)
    with probe_server(topo, "b"):
        direct = probe(topo, "a", topo.addresses("b", "a"))
        assert [r.get("seen_as") for r in direct] == topo.addresses("a", "b"), direct
        relay_side = probe(topo, "r", topo.addresses("b", "r"))
        assert [r.get("seen_as") for r in relay_side] == topo.addresses("r", "b"), relay_side
        # a has no route to b's r-b subnets, and r none to a-b's.
        assert not any(r["ok"] for r in probe(topo, "a", topo.addresses("b", "r")))
        assert not any(r["ok"] for r in probe(topo, "r", topo.addresses("b", "a")))
        # Even routed through r, a cannot reach b: r does not forward at the IP layer.
        via_r, back_via_r = topo.address("r", 2), topo.address("r", 3)
        for host, subnet, gateway in (
            ("a", topo.subnet(3), via_r),
            ("b", topo.subnet(2), back_via_r),
        ):
            subprocess.run(
                [*topo.exec_prefix(host), "ip", "route", "add", subnet, "via", gateway], check=True
            )
        target = [topo.address("b", 3)]
        assert not probe(topo, "a", target)[0]["ok"]
        # The same probe gets through once r forwards: the check above can fail.
        sysctl = [*topo.exec_prefix("r"), "sysctl", "-q", "-w"]
        subprocess.run([*sysctl, "net.ipv4.ip_forward=1"], check=True)
        assert probe(topo, "a", target)[0].get("seen_as") == topo.address("a", 2)
        subprocess.run([*sysctl, "net.ipv4.ip_forward=0"], check=True)


@pytest.mark.root
def test_link_down_cuts_only_that_link_and_link_up_restores_it(topology: Any) -> None:
    topo: kt.Topology = topology(RELAY)
    with probe_server(topo, "b"):
        topo.link_down(3)
        ends = topo.status()["links"][3]["hosts"]
        assert not ends["b"]["admin_up"] and not ends["r"]["admin_up"]
        cut, other = probe(topo, "r", topo.addresses("b", "r"))
        assert not cut["ok"] and other["ok"], (cut, other)
        topo.link_up(3)
        deadline = time.monotonic() + 5  # carrier comes back within milliseconds; allow slack
        while not (result := probe(topo, "r", [topo.address("b", 3)])[0])["ok"]:
            assert time.monotonic() < deadline, result
            time.sleep(0.1)
        assert result["seen_as"] == topo.address("r", 3)
    topo.set_rate(2, "1gbit")
    topo.set_rate(0, None)
    rates = [link["hosts"][link["ends"][0]]["rate"] for link in topo.status()["links"]]
    assert rates == [None, "2gbit", "1gbit", "2gbit", "2gbit"] == topo.rates


@pytest.mark.root
def test_up_repairs_another_topology_and_refuses_another_tags_namespace(
    testbed: Factory, topology: Any
) -> None:
    tag = testbed.reserve_tag()
    topology(RELAY, tag)
    smaller = topology("a-r:1x1gbit,a-b:1xnone", tag)  # same tag: links re-joined, r kept
    assert [link["ends"] for link in smaller.status()["links"]] == [["a", "r"], ["a", "b"]]
    topology("a-b:2x300mbit", tag)  # r is gone
    assert namespaces_of(tag) == [f"kvl{tag}a", f"kvl{tag}b"]
    assert kt.Testbed.attach(tag).rates == ["300mbit", "300mbit"]

    # kvl{tag}xa is host "xa" of tag and host "a" of tag+"x": the second must not take it.
    mine = topology("b-xa:1xnone", tag)
    other = tag + "x"  # its names start with kvl{tag}: the fixture's leftover check sees them
    with pytest.raises(kt.TestbedError, match=f"kvl{tag}xa is host 'xa' of testbed '{tag}'"):
        kt.Topology("a-b:1xnone", tag=other).up()
    assert kt.teardown(other) is False  # kvl{tag}xa is not other's to remove
    assert mine.status()["up"] and namespaces_of(other) == [mine.namespace("xa")]


@pytest.mark.root
def test_cli_topology_round_trip(testbed: Factory, capsys: pytest.CaptureFixture[str]) -> None:
    tag = testbed.reserve_tag()
    assert cli_main(["up", "--tag", tag, "--topology", "relay3"]) == 0
    assert "b 198.18.3.1 <-> r 198.18.3.2  2gbit" in capsys.readouterr().out
    assert cli_main(["status", "--tag", tag]) == 0
    table = capsys.readouterr().out
    assert f"r kvl{tag}r2 198.18.2.2/24" in table and "8gbit" in table
    assert cli_main(["set", "--tag", tag, "--link", "3", "--down"]) == 0
    assert cli_main(["set", "--tag", tag, "--link", "2", "--rate", "1gbit"]) == 0
    capsys.readouterr()
    assert cli_main(["status", "--tag", tag, "--json"]) == 0
    links = json.loads(capsys.readouterr().out)["links"]
    assert not links[3]["hosts"]["r"]["admin_up"] and links[2]["hosts"]["a"]["rate"] == "1gbit"
    code = cli_main(["run", "--tag", tag, "--host", "r", "--", "ip", "-br", "-4", "addr"])
    assert code == 0
    assert cli_main(["run", "--tag", tag, "--host", "q", "--", "true"]) == 1
    assert "'q' is not a host" in capsys.readouterr().err
    assert cli_main(["up", "--tag", tag, "--topology", "a-b:2x2gbt"]) == 2
    assert "item 0 'a-b:2x2gbt': rate: unknown unit" in capsys.readouterr().err
    assert cli_main(["up", "--tag", tag, "--topology", "relay3", "--links", "2"]) == 2
    assert cli_main(["down", "--tag", tag]) == 0
    assert namespaces_of(tag) == []


@pytest.mark.root
@pytest.mark.timing
@pytest.mark.tools("iperf3")
def test_iperf3_aggregate_runs_one_stream_per_link_at_its_rate(topology: Any) -> None:
    # Low rates, so that two streams on two cores are held by tbf and not by the CPU; the
    # floor allows a loaded host, the ceiling the shaper's burst at the start of a short run.
    topo: kt.Topology = topology("a-b:1x300mbit,a-r:1xnone,r-b:1x200mbit")
    result = kt.iperf3_aggregate(topo, [("a", "b", 0), ("r", "b", 2)], seconds=2)
    (ab, rb) = result.flows
    assert (ab.src, ab.dst, ab.link, rb.src, rb.link) == ("a", "b", 0, "r", 2)
    for flow, rate_bps in ((ab, 300e6), (rb, 200e6)):
        assert 0.5 * rate_bps <= flow.bytes_per_s * 8 <= 1.05 * rate_bps, flow
        assert flow.bytes > 0 and flow.seconds > 1
    assert result.total_bytes_per_s == pytest.approx(ab.bytes_per_s + rb.bytes_per_s)
