"""An idle agent sleeps: after serving a push, with its 4 paths up, its engine thread wakes for
the monitor's tick and little else. The quarter-tick stall check used to wake it four times a
tick whether or not anything was in flight (~56 wakeups a second measured; a loaded vLLM
connector's idle CPU is mostly these wakeups). Wakeups are counted, not timed: each sleep in
epoll_wait is one voluntary context switch, and load on the machine does not add any."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvlink
from tests.waits import wait_for

pytestmark = pytest.mark.usefixtures("io_threads_mode")

MiB = 1 << 20


def _wakeups() -> dict[str, tuple[str, int]]:
    """Voluntary context switches of this process's kvlink threads, by thread id."""
    out: dict[str, tuple[str, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        if comm.startswith("kvl-"):
            (line,) = [x for x in status.splitlines() if x.startswith("voluntary_ctxt_switches")]
            out[tid] = (comm, int(line.split()[1]))
    return out


@pytest.mark.timing
def test_idle_engine_wakes_about_once_a_tick(make_agent: Callable[..., Any]) -> None:
    interval_ms = 100
    rx = make_agent("rx", nics="loopback:4", monitor_interval_ms=interval_ms)
    tx = make_agent("tx", nics="loopback:4", monitor_interval_ms=interval_ms)
    dst = np.zeros(16 * MiB, np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = np.full(16 * MiB, 3, np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata())
    tx.push("rx", src=src, dst="kv").wait(timeout_s=60)
    assert np.array_equal(dst, src)
    # the push's bookkeeping ends: no copy in flight (a hedge's loser), no path stalled.
    # The engine took the snapshot that shows it, and from then on nothing asks for the
    # quarter-tick stall check.
    wait_for(
        lambda: all(
            p.inflight_bytes == 0 and p.state != kvlink.PathState.STALLED for p in tx.paths()
        ),
        10,
        "every path idle after the push",
    )
    window_s = 3.0
    before = _wakeups()
    t0 = time.monotonic()
    time.sleep(window_s)
    elapsed = time.monotonic() - t0
    after = _wakeups()
    engines = {tid: after[tid][1] - n for tid, (comm, n) in before.items()
               if comm == "kvl-engine" and tid in after}
    assert len(engines) == 2, before  # one engine thread per agent, named
    ticks = elapsed * 1000 / interval_ms
    for tid, n in engines.items():
        # a tick, and the probe of an idle path now and then; never the four stall checks
        # a tick (4.5 a tick and more before the change)
        assert n <= 2.5 * ticks, f"engine thread {tid} woke {n} times in {elapsed:.1f} s"
    for tid, (comm, n) in after.items():
        if comm.startswith("kvl-io") and tid in before:
            # an I/O thread without jobs sleeps in poll() until the engine hands one over
            assert n - before[tid][1] <= 2, (comm, n - before[tid][1])
