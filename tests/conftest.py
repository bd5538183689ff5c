"""Shared fixtures: agents that always close, a peer agent in another process,
and the rule that a missing dependency skips with the reason, but fails in CI
(KVLINK_REQUIRE_ALL=1): Python modules through ``require``, system tools through
``require_tool`` or the ``tools`` marker, root and iproute2 through the ``root`` marker."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest

from tests import sysdeps

REQUIRE_ALL = os.environ.get("KVLINK_REQUIRE_ALL") == "1"


def unavailable(reason: str) -> NoReturn:
    """Skips the test with ``reason``; fails it instead under KVLINK_REQUIRE_ALL=1 (CI)."""
    if REQUIRE_ALL:
        pytest.fail(f"{reason} (KVLINK_REQUIRE_ALL=1: nothing may skip)")
    pytest.skip(reason)


def require(module: str) -> Any:
    """Imports ``module``; skips the test without it, fails under KVLINK_REQUIRE_ALL=1."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        unavailable(f"{module} is not installed: {exc}")


def require_tool(name: str) -> str:
    """Path of system tool ``name``; skips the test without it, fails under KVLINK_REQUIRE_ALL=1.

    ``name`` must be listed in tests/sysdeps.py, which is what `make sysdeps` installs.
    """
    assert name in sysdeps.TOOLS, f"add {name!r} to tests/sysdeps.py TOOLS so it is installed"
    path = sysdeps.find_tool(name)
    if path is None:
        unavailable(f"`{name}` is not installed: {sysdeps.install_hint([name])}")
    return path


@pytest.fixture(autouse=True)
def _system_requirements(request: pytest.FixtureRequest) -> None:
    """Skip (fail, under KVLINK_REQUIRE_ALL=1) a test whose ``tools`` or ``root`` needs are
    not met, before any of its other fixtures build anything."""
    for mark in request.node.iter_markers("tools"):
        for name in mark.args:
            require_tool(name)
    if request.node.get_closest_marker("root") is not None:
        require_tool("ip")
        require_tool("tc")
        import kvlink.testbed as kt

        ok, reason = kt.is_available()
        if not ok:
            unavailable(reason)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "io_threads_mode" in metafunc.fixturenames:
        metafunc.parametrize("io_threads_mode", [0, 2], indirect=True, ids=["io0", "io2"])


@pytest.fixture
def io_threads_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Runs a module's tests (pytestmark = pytest.mark.usefixtures("io_threads_mode")) once
    with all I/O on the engine thread and once with two I/O threads, in every agent the
    test makes here or spawns (they read KVLINK_IO_THREADS)."""
    monkeypatch.setenv("KVLINK_IO_THREADS", str(request.param))
    return int(request.param)


@pytest.fixture
def make_agent() -> Iterator[Callable[..., Any]]:
    """Factory for in-process agents, all closed at teardown."""
    import kvlink

    agents: list[Any] = []

    def make(name: str, nics: str = "loopback:1", **cfg: Any) -> Any:
        # Config.load: KVLINK_* settings apply (io_threads_mode sets one), as in the workers
        a = kvlink.Agent(name, kvlink.Config.load(nics=nics, **cfg))
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.close()


@pytest.fixture
def etcd() -> Iterator[Any]:
    """A real etcd server on free ports in a temp folder, for this test only."""
    require_tool("etcd")
    from kvlink.bench.etcd import EtcdServer

    server = EtcdServer()
    yield server
    server.close()


@pytest.fixture
def spawn_peer() -> Iterator[Callable[..., Any]]:
    """Factory for agents in child processes (kvlink.bench.worker), closed at teardown."""
    from kvlink.bench import Worker

    procs: list[Worker] = []

    def spawn(name: str, nics: str = "loopback:1", **cfg: Any) -> Worker:
        p = Worker(name, name=name, nics=nics, config=cfg)
        procs.append(p)
        return p

    yield spawn
    for p in procs:
        p.close()


@pytest.fixture
def scripted_receiver() -> Iterator[Callable[..., Any]]:
    """Factory for tests/wire_client.ScriptedReceiver (a receiver that withholds its ACKs
    until released), every one closed at teardown."""
    from tests.wire_client import ScriptedReceiver

    made: list[ScriptedReceiver] = []

    def make(
        name: str = "rx",
        paths: int = 1,
        region: str = "kv",
        nbytes: int = 1 << 20,
        answer_regions: bool = True,
    ) -> Any:
        r = ScriptedReceiver(name, paths, region, nbytes, answer_regions)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


# ---- time per suite (make test reports it: tests/phase_times.py) ---------------------------

_SUITE_S: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Adds each test's set-up, call and tear-down time to its suite (tests/<suite>/...)."""
    parts = report.nodeid.split("::")[0].split("/")
    suite = parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]
    _SUITE_S[suite] = _SUITE_S.get(suite, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _SUITE_S:
        return
    terminalreporter.write_sep("-", "time per suite (set-up + call + tear-down)")
    for suite, s in sorted(_SUITE_S.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{suite:<14} {s / 60:6.1f} min")
    path = os.environ.get("KVLINK_PHASE_TIMES")
    if path:  # `make test`'s phase table: one line a suite, inside the pytest phase
        with open(path, "a") as f:
            for suite, s in sorted(_SUITE_S.items()):
                f.write(f"pytest: tests/{suite}\t{s:.0f}\tpart\n")
