"""Shared fixtures: agents that always close, a peer agent in another process,
and the rule that a missing dependency fails in CI (KVLINK_REQUIRE_ALL=1)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

REQUIRE_ALL = os.environ.get("KVLINK_REQUIRE_ALL") == "1"


def require(module: str) -> Any:
    """Imports ``module``; skips the test without it, fails under KVLINK_REQUIRE_ALL=1."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if REQUIRE_ALL:
            pytest.fail(f"{module} is required in CI (KVLINK_REQUIRE_ALL=1): {exc}")
        pytest.skip(f"{module} is not installed")


@pytest.fixture
def make_agent() -> Iterator[Callable[..., Any]]:
    """Factory for in-process agents, all closed at teardown."""
    import kvlink

    agents: list[Any] = []

    def make(name: str, nics: str = "loopback:1", **cfg: Any) -> Any:
        a = kvlink.Agent(name, kvlink.Config(nics=nics, **cfg))
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.close()


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
