"""Tests of the multi-NIC testbed against real namespaces, veths and tbf (no mocks).

Tests marked ``root`` build namespaces; the others check parsing and validation only.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

import kvlink.testbed as kt
from kvlink.bench import iperf3
from kvlink.cli.testbed import main as cli_main
from tests.conftest import require_tool


class Factory(Protocol):
    """The ``testbed`` fixture (conftest.TestbedFactory)."""

    def __call__(self, *, up: bool = True, **kwargs: Any) -> kt.Testbed: ...

    def reserve_tag(self) -> str: ...


# The checkout's root, so child processes (in namespaces, as another user) import this kvlink.
REPO_ROOT = Path(kt.__file__).resolve().parents[2]
PROBE_PORT = 7100
IPERF_SECONDS = 2

# Listens on every address of its namespace and answers each connection with the address the
# client connected from, which tells which link the connection used.
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
results = []
for addr in sys.argv[2:]:
    try:
        with socket.create_connection((addr, int(sys.argv[1])), timeout=1.0) as s:
            s.settimeout(1.0)
            results.append({"addr": addr, "ok": True, "seen_as": s.recv(64).decode()})
    except OSError as exc:
        results.append({"addr": addr, "ok": False, "error": repr(exc)})
print(json.dumps(results))
"""


@contextlib.contextmanager
def probe_server(tb: kt.Testbed) -> Iterator[subprocess.Popen[str]]:
    """Run PROBE_SERVER in side b while the block runs; stopped and reaped on exit."""
    server = tb.run(
        "b",
        [sys.executable, "-c", PROBE_SERVER, str(PROBE_PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    with server:  # closes the pipe and reaps the process on exit
        try:
            assert server.stdout is not None
            assert server.stdout.readline().strip() == "ready"
            yield server
        finally:
            server.kill()


def probe(tb: kt.Testbed, addresses: list[str]) -> list[dict[str, Any]]:
    """Try a TCP connection from side a to each address; one result dict per address."""
    done = subprocess.run(
        [*tb.exec_prefix("a"), sys.executable, "-c", PROBE_CLIENT, str(PROBE_PORT), *addresses],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


def iperf_bps(tb: kt.Testbed, link: int, seconds: int = IPERF_SECONDS) -> float:
    """Receiver-side throughput in bit/s of one iperf3 TCP stream from a to b over ``link``."""
    require_tool("iperf3")
    (res,) = iperf3.run(
        [iperf3.Stream(tb.address("b", link), tb.address("a", link), seconds=seconds,
                       server_prefix=tb.exec_prefix("b"), client_prefix=tb.exec_prefix("a"))],
        timeout_s=seconds + 20,
    )  # fmt: skip
    return res.received_bps


def namespaces_of(tag: str) -> list[str]:
    return sorted(ns for ns in kt._list_netns() if ns.startswith(f"kvl{tag}"))


# ----------------------------------------------------------------------------------------------
# Parsing and validation (no root needed)


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("2gbit", 2_000_000_000),
        ("500mbit", 500_000_000),
        ("1.5gbit", 1_500_000_000),
        (" 100Kbit ", 100_000),
        ("1000000", 1_000_000),
        ("1gibit", 2**30),
        (2_000_000_000, 2_000_000_000),
    ],
)
def test_parse_rate_accepts_tc_spellings(text: str | int, bps: int) -> None:
    assert kt.parse_rate(text) == bps


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("fast", "cannot parse"),
        ("", "cannot parse"),
        ("3gbps", "bytes per second"),
        ("2gbits", "unknown unit"),
        ("10kbit", "below the minimum"),
        ("1.2345kbit", "not a whole number"),
        (True, "expected a rate"),
        (-5, "below the minimum"),
    ],
)
def test_parse_rate_rejects_with_the_argument_named(value: Any, fragment: str) -> None:
    with pytest.raises(kt.TestbedConfigError, match=fragment) as info:
        kt.parse_rate(value, name="rates[1]")
    assert str(info.value).startswith("rates[1]: ")
    assert isinstance(info.value, kt.TestbedError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("bps", "text"),
    [
        (2_000_000_000, "2gbit"),
        (500_000_000, "500mbit"),
        (1_500_000_000, "1.5gbit"),
        (100_000, "100kbit"),
        (1_234_567, "1234.567kbit"),
        (1_234_567_891, "1234567.891kbit"),
        (999, "999bit"),
    ],
)
def test_format_rate_uses_tc_spelling_and_round_trips(bps: int, text: str) -> None:
    assert kt.format_rate(bps) == text
    if bps >= kt.MIN_RATE_BPS:
        assert kt.parse_rate(text) == bps


def test_tbf_parameters_scale_with_rate() -> None:
    assert kt.tbf_parameters("2gbit") == kt.TbfParams(2_000_000_000, 1_000_000, 2_250_000)
    slow = kt.tbf_parameters("100mbit")  # both floors apply
    assert (slow.burst_bytes, slow.limit_bytes) == (65536, 65536 + 131072)
    assert slow.tc_args()[:3] == ["tbf", "rate", "100000000bit"]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"rate": "fast"}, "^rate: "),
        ({"links": 2, "rates": ["1gbit"]}, "^rates: "),
        ({"links": 2, "rates": ["1gbit", "x"]}, r"^rates\[1\]: "),
        ({"tag": "Bad!"}, "^tag: "),
        ({"tag": "waytoolongtag"}, "^tag: "),
        ({"links": 0}, "^links: "),
        ({"links": kt.MAX_LINKS + 1}, "^links: "),
        ({"links": 4, "subnet_base": 510}, "^subnet_base: "),
    ],
)
def test_config_errors_name_the_argument(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(kt.TestbedConfigError, match=fragment):
        kt.Testbed(**kwargs)


def test_names_and_addresses() -> None:
    tb = kt.Testbed(links=kt.MAX_LINKS, tag="abcdefgh", subnet_base=255, rate=None)
    assert tb.namespace("a") == "kvlabcdefgha"
    assert all(len(tb.device(side, i)) <= 15 for side in "ab" for i in range(tb.links))
    assert tb.address("a", 0) == "198.18.255.1"
    assert tb.address("b", 1) == "198.19.0.2"
    assert tb.subnet(1) == "198.19.0.0/24"
    assert tb.addresses("b")[:2] == ["198.18.255.2", "198.19.0.2"]
    assert tb.rates == [None] * kt.MAX_LINKS
    with pytest.raises(kt.TestbedConfigError, match="side"):
        tb.namespace("c")
    with pytest.raises(kt.TestbedConfigError, match="link"):
        tb.device("a", kt.MAX_LINKS)
    with pytest.raises(kt.TestbedConfigError, match="argv"):
        tb.run("a", "ip addr")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ((1.0, ("explode", 0)), "unknown action"),
        ((1.0, ("down", 5)), "link"),
        ((1.0, ("rate", 0)), "must look like"),
        ((1.0, ("rate", 0, "fast")), "cannot parse"),
        ((-1.0, ("down", 0)), "time"),
        (("soon",), "expected"),
    ],
)
def test_fault_schedule_validates(spec: Any, fragment: str) -> None:
    tb = kt.Testbed(links=2, tag="val")
    with pytest.raises(kt.TestbedConfigError, match=fragment) as info:
        kt.FaultSchedule(tb, [(0.5, ("up", 1)), spec])
    assert str(info.value).startswith("faults[1]: ")


# ----------------------------------------------------------------------------------------------
# Real namespaces


@pytest.mark.root
def test_up_down_idempotent_and_leaves_nothing(testbed: Factory) -> None:
    tb = testbed(links=2, rate="1gbit")
    tb.up()  # again: no error, same state
    state = tb.status()
    assert state["up"] and len(state["links"]) == 2
    for i, link in enumerate(state["links"]):
        assert link["subnet"] == f"198.18.{i}.0/24"
        for side in "ab":
            end = link[side]
            assert end["device"] == tb.device(side, i)
            assert end["address"] == tb.address(side, i) + "/24"
            assert end["admin_up"] and end["rate"] == "1gbit"
            assert end["burst_bytes"] == kt.tbf_parameters("1gbit").burst_bytes
    assert namespaces_of(tb.tag) == [tb.namespace("a"), tb.namespace("b")]
    # A process started outside run() is still stopped by down(), or the namespace would linger.
    stray = subprocess.Popen([*tb.exec_prefix("b"), "sleep", "60"])
    tb.down()
    tb.down()
    assert stray.wait(timeout=5) != 0
    assert namespaces_of(tb.tag) == []
    assert kt.inspect(tb.tag)["up"] is False


@pytest.mark.root
def test_up_repairs_partial_testbed_and_down_removes_half_of_one(testbed: Factory) -> None:
    tag = testbed.reserve_tag()
    subprocess.run(["ip", "netns", "add", f"kvl{tag}a"], check=True)
    big = testbed(links=3, rate=None, tag=tag)
    assert [link["link"] for link in big.status()["links"]] == [0, 1, 2]
    small = testbed(links=2, rate="300mbit", tag=tag)  # same tag, fewer links: extras removed
    links = small.status()["links"]
    assert [link["link"] for link in links] == [0, 1]
    assert {link["a"]["rate"] for link in links} == {"300mbit"}
    moved = testbed(links=2, rate=None, tag=tag, subnet_base=7)  # re-addressed, not doubled
    assert [link["b"]["addresses"] for link in moved.status()["links"]] == [
        ["198.18.7.2/24"],
        ["198.18.8.2/24"],
    ]
    assert kt.Testbed.attach(tag).address("a", 1) == "198.18.8.1"
    subprocess.run(["ip", "netns", "del", f"kvl{tag}b"], check=True)  # half torn down
    small.down()
    assert namespaces_of(tag) == []


@pytest.mark.root
def test_context_manager_downs_even_on_error(testbed: Factory) -> None:
    tag = testbed.reserve_tag()
    with pytest.raises(ZeroDivisionError), kt.Testbed(links=1, rate=None, tag=tag) as tb:
        assert tb.status()["up"]
        1 / 0  # noqa: B018
    assert namespaces_of(tag) == []


@pytest.mark.root
def test_every_link_carries_tcp_over_its_own_subnet(testbed: Factory) -> None:
    tb = testbed(links=3, rate="1gbit")
    with probe_server(tb) as server:
        results = probe(tb, tb.addresses("b"))
        assert [r["ok"] for r in results] == [True] * 3, results
        # The server saw each connection come from side a's address on that same link.
        assert [r["seen_as"] for r in results] == tb.addresses("a")
        tb.down()
        assert server.poll() is not None  # down() stopped what run() started


@pytest.mark.root
@pytest.mark.tools("iperf3")
def test_tbf_limits_rate_and_set_rate_changes_it(testbed: Factory) -> None:
    # Unshaped, a veth pair carries many Gbit/s, so the ceiling is what shows tbf at work; it
    # allows the shaper's burst at the start of a short run (a few %), and the floor a host
    # whose two cores are busy with other work (a loaded run fell outside 0.70..1.00 x).
    tb = testbed(links=1, rate="500mbit")
    measured = iperf_bps(tb, 0)
    assert 0.50 * 500e6 <= measured <= 1.05 * 500e6, f"{measured / 1e6:.1f} Mbit/s at 500mbit"
    tb.set_rate(0, "200mbit")
    assert {tb.status()["links"][0][s]["rate"] for s in "ab"} == {"200mbit"}
    measured = iperf_bps(tb, 0)
    assert 0.50 * 200e6 <= measured <= 1.05 * 200e6, f"{measured / 1e6:.1f} Mbit/s at 200mbit"
    tb.set_rate(0, None)
    assert tb.status()["links"][0]["a"]["rate"] is None and tb.rates == [None]


@pytest.mark.root
def test_link_down_cuts_only_that_link_and_link_up_restores_it(testbed: Factory) -> None:
    tb = testbed(links=2, rate="1gbit")
    with probe_server(tb):
        tb.link_down(0)
        link0 = tb.status()["links"][0]
        assert not link0["a"]["admin_up"] and not link0["b"]["admin_up"]
        down, other = probe(tb, tb.addresses("b"))
        assert not down["ok"], down
        assert other["ok"], other
        tb.link_up(0)
        deadline = time.monotonic() + 5  # carrier comes back within milliseconds; allow slack
        while not (result := probe(tb, [tb.address("b", 0)])[0])["ok"]:
            assert time.monotonic() < deadline, result
            time.sleep(0.1)
        assert result["seen_as"] == tb.address("a", 0)


@pytest.mark.root
def test_fault_schedule_fires_in_order_at_about_the_planned_times(testbed: Factory) -> None:
    tb = testbed(links=2, rate="1gbit")
    schedule = kt.FaultSchedule(
        tb, [(0.9, ("up", 0)), (0.3, ("down", 0)), (0.6, ("rate", 1, "100mbit"))]
    )
    started = schedule.start()
    time.sleep(max(0.0, started + 0.45 - time.monotonic()))
    assert not tb.status()["links"][0]["a"]["admin_up"]  # between "down" and "up"
    schedule.join(timeout_s=10)
    fired = schedule.fired
    assert [f.fault.action() for f in fired] == [("down", 0), ("rate", 1, "100mbit"), ("up", 0)]
    for f in fired:
        assert f.error is None
        assert 0 <= f.late_s < 0.25, f  # generous: the thread only sleeps on an Event
        assert f.fired_at <= f.done_at
    assert [round(r["planned_s"], 1) for r in schedule.records()] == [0.3, 0.6, 0.9]
    links = tb.status()["links"]
    assert links[0]["a"]["admin_up"] and links[0]["b"]["admin_up"]
    assert links[0]["a"]["rate"] == "1gbit" and links[1]["b"]["rate"] == "100mbit"
    with pytest.raises(kt.TestbedError, match="already started"):
        schedule.start()


@pytest.mark.root
def test_fault_schedule_stop_and_errors(testbed: Factory) -> None:
    tb = testbed(links=1, rate=None)
    with kt.FaultSchedule(tb, [(0.0, ("down", 0)), (30.0, ("up", 0))]) as schedule:
        deadline = time.monotonic() + 5
        while not schedule.fired:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert not schedule.running  # exit stopped it without waiting for the 30 s fault
    assert [f.fault.kind for f in schedule.fired] == [kt.FaultKind.DOWN]

    absent = testbed(links=1, up=False)  # never brought up: the fault fails and is recorded
    failing = kt.FaultSchedule(absent, [(0.0, ("rate", 0, "1gbit"))])
    failing.start()
    with pytest.raises(kt.TestbedError, match="fault"):
        failing.join(timeout_s=10)
    assert failing.fired[0].error is not None
    failing.join(raise_errors=False)


@pytest.mark.root
def test_run_uses_the_namespace(testbed: Factory) -> None:
    tb = testbed(links=2, rate=None)
    proc = tb.run("b", ["ip", "-br", "-4", "addr"], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=10)
    assert tb.address("b", 1) in out and tb.address("a", 1) not in out


@pytest.mark.root
def test_cli_round_trip(testbed: Factory, capsys: pytest.CaptureFixture[str]) -> None:
    tag = testbed.reserve_tag()

    def status() -> dict[str, Any]:
        capsys.readouterr()
        code = cli_main(["status", "--tag", tag, "--json"])
        state: dict[str, Any] = json.loads(capsys.readouterr().out)
        assert code == (0 if state["up"] else 3)
        return state

    assert cli_main(["up", "--tag", tag, "--rates", "1gbit,300mbit"]) == 0
    state = status()
    assert state["up"] and [link["a"]["rate"] for link in state["links"]] == ["1gbit", "300mbit"]
    assert cli_main(["status", "--tag", tag]) == 0
    assert "300mbit" in capsys.readouterr().out

    assert cli_main(["set", "--tag", tag, "--link", "1", "--rate", "none"]) == 0
    assert cli_main(["set", "--tag", tag, "--link", "0", "--down"]) == 0
    links = status()["links"]
    assert links[1]["b"]["rate"] is None and not links[0]["b"]["admin_up"]
    assert cli_main(["set", "--tag", tag, "--link", "0", "--up"]) == 0
    assert status()["links"][0]["b"]["admin_up"]

    capsys.readouterr()
    assert cli_main(["set", "--tag", tag, "--link", "7", "--up"]) == 1
    assert "not a link" in capsys.readouterr().err
    assert cli_main(["up", "--tag", tag, "--rate", "3gbps"]) == 2
    assert "bytes per second" in capsys.readouterr().err

    code = cli_main(["run", "--tag", tag, "--side", "b", "--", sys.executable, "-c", "exit(3)"])
    assert code == 3

    assert cli_main(["down", "--tag", tag]) == 0
    assert cli_main(["down", "--tag", tag]) == 0
    assert namespaces_of(tag) == [] and status()["up"] is False


@pytest.mark.root
def test_cli_module_entry_point(testbed: Factory) -> None:
    tag = testbed.reserve_tag()
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvlink.cli.testbed", *args],
            env=env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip

    up = cli("up", "--tag", tag, "--links", "1", "--rate", "none")
    assert up.returncode == 0, up.stderr
    run = cli("run", "--tag", tag, "--side", "a", "--", "ip", "-br", "-4", "addr")
    assert run.returncode == 0 and "198.18.0.1/24" in run.stdout, run.stdout + run.stderr
    assert cli("down", "--tag", tag).returncode == 0
    assert namespaces_of(tag) == []


@pytest.mark.root
@pytest.mark.tools("setpriv")
def test_not_root_gets_a_message_saying_what_to_do() -> None:
    setpriv = require_tool("setpriv")
    drop = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
    # Python and this checkout must be readable by "nobody"; pyenv's often is not.
    python = next(
        (exe for exe in (sys.executable, "/usr/bin/python3")
         if subprocess.run([*drop, exe, "-c", "pass"], capture_output=True).returncode == 0),
        None,
    )  # fmt: skip
    if python is None:
        pytest.skip("no Python that the nobody user can run")
    with tempfile.TemporaryDirectory() as cwd:
        os.chmod(cwd, 0o755)
        code = (
            "import kvlink.testbed as kt\n"
            "print(kt.is_available()[1])\n"
            "try:\n    kt.Testbed(tag='nr').up()\nexcept kt.TestbedError as e:\n    print(e)\n"
        )
        done = subprocess.run(
            [*drop, python, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=30,
            env={"PYTHONPATH": str(REPO_ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )  # fmt: skip
    if "No module named" in done.stderr:
        pytest.skip(f"the nobody user cannot read {REPO_ROOT}")
    lines = done.stdout.splitlines()
    assert lines == ["the testbed needs root (CAP_NET_ADMIN): run as root"] * 2, done
