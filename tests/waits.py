"""Waits for a state, each with a timeout, instead of sleeps that hope an event came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvlink import _native


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Returns cond()'s first true answer, checking every 10 ms; fails the test
    (AssertionError naming ``what``) when none came within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.01)
    return got


def wait_paths(
    agent: Any, peer: str, cond: Callable[[list[Any]], bool], timeout_s: float = 30.0
) -> list[Any]:
    """``agent``'s paths to ``peer`` once cond(them) holds: sleeps in
    kvl_paths_wait (woken when a path changes state), not a poll."""
    deadline = time.monotonic() + timeout_s
    gen = 0
    while True:
        left = max(0.0, deadline - time.monotonic())
        gen = _native.paths_wait(agent._using, gen, left if gen else 0.0) or gen
        mine = [p for p in agent.paths() if p.peer == peer]
        if cond(mine):
            return mine
        if time.monotonic() >= deadline:
            raise AssertionError(f"paths to {peer!r}: not as wanted within {timeout_s} s: {mine}")
