"""One admitted peer misbehaving (issue 22): while it runs an attack of tests/attacks.py at full
speed against an agent, another peer that connects during the attack still pushes and pulls
with every byte verified, and what the attacker made the agent hold is bounded while it
attacks and given back once it has left.

The attacker is a process of its own (tests.attacks.AttackProcess) that holds the cluster
secret, as a buggy prefill engine would; the agent under attack runs in this process, so its
memory is this process's VmRSS (the test's own objects are made before the attack starts).
Issue 22's bounds are 64 MiB of growth per attacking peer and 8 MiB over the start once it has
left; RSS_SLACK_MIB is added to both for what the other agent and the interpreter add. The
speed figures (push latency, PING round trip) are bench/fairness.py's, not these tests'."""

from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests import attacks
from tests.waits import wait_for

MiB = 1 << 20
SIZE = 4 * MiB
SECRET = "kvlink-fairness-test-secret-0123456789"
RSS_DURING_MIB = 64  # issue 22: per attacking peer
RSS_AFTER_MIB = 8  # issue 22: over the start, once the attacker has left
RSS_SLACK_MIB = 16  # the legitimate agent, the interpreter, malloc's arenas
READY_S = 10.0  # for the attack to reach full pressure
TIMEOUT_S = 5.0  # each legitimate push and pull
ATTACK_S = 3.0  # how long the attack runs at full pressure before the attacker leaves


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


_LIBC = ctypes.CDLL(None)


def trimmed_rss_mib() -> float:
    """VmRSS once the memory already freed (by this test or an earlier one in this process)
    is given back to the kernel: what is left is what is held. The tests check that state is
    held and released; whether the allocator returns it on its own is bench/fairness.py's
    figure (its target runs in a process of its own and is never trimmed)."""
    gc.collect()
    _LIBC.malloc_trim(0)
    return rss_mib()


class PeakRss:
    """This process's highest VmRSS, sampled every 20 ms until stopped."""

    def __init__(self) -> None:
        self.peak = rss_mib()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_mib())

    def stop(self) -> float:
        self._stop.set()
        self._t.join(2)
        return self.peak


class Scene:
    """The agent under attack ("target", one region "kv" that peers may write and read), the
    legitimate side's buffers, and the attacker once started."""

    def __init__(self, make_agent: Callable[..., Any]) -> None:
        self.make_agent = make_agent
        self.target = make_agent("target", secret=SECRET)
        self.kv = np.zeros(SIZE, np.uint8)
        self.target.register(self.kv, name="kv", remote_read=True, remote_write=True)
        # what the attacker writes into and reads (an admitted peer with the keys may):
        # not "kv", whose bytes the legitimate peer compares
        self.attack_buf = np.zeros(1 << 20, np.uint8)
        self.target.register(self.attack_buf, name="attack", remote_read=True, remote_write=True)
        self.src = np.frombuffer(np.random.default_rng(22).bytes(SIZE), np.uint8).copy()
        self.back = np.zeros(SIZE, np.uint8)
        self.rounds = 0
        self.peers: list[Any] = []
        warm = self.peer("warm")  # the target's receive path is set up before RSS is read
        self.push_pull(warm)
        self.drop(warm)
        self.rss_start = trimmed_rss_mib()
        self.attack: attacks.AttackProcess | None = None
        self.peak: PeakRss | None = None

    def peer(self, name: str) -> Any:
        a = self.make_agent(name, secret=SECRET)
        a.register(self.src)
        a.register(self.back)
        a.add_peer(self.target.metadata())
        self.peers.append(a)
        return a

    def drop(self, a: Any) -> None:
        a.close()
        self.peers.remove(a)

    def push_pull(self, a: Any) -> None:
        """One push of new bytes into "kv" and a pull of them back, every byte compared."""
        self.rounds += 1
        self.src[::4096] = self.rounds % 251
        a.push("target", src=self.src, dst="kv", timeout_s=TIMEOUT_S).wait(TIMEOUT_S + 1)
        self.back.fill(0)
        a.pull("target", src="kv", dst=self.back, timeout_s=TIMEOUT_S).wait(TIMEOUT_S + 1)
        assert np.array_equal(self.back, self.src)

    def start(self, kind: str, **params: Any) -> None:
        self.peak = PeakRss()
        self.attack = attacks.AttackProcess(kind, self.target.metadata(), SECRET, params=params)
        self.attack.wait_ready(READY_S)  # at full pressure, or as far as it got by then
        self.t_ready = time.monotonic()

    def during(self, name: str = "legit") -> Any:
        """A peer that connects now (its handshake under attack) pushes and pulls, twice and
        until the attack has run ATTACK_S at full pressure; the peer."""
        legit = self.peer(name)
        for i in itertools.count():
            if i >= 2 and time.monotonic() - self.t_ready >= ATTACK_S:
                return legit
            self.push_pull(legit)

    def leave(self) -> float:
        """The attacker leaves; the RSS growth while it attacked (MiB)."""
        assert self.attack is not None and self.peak is not None
        self.attack.stop()
        return self.peak.stop() - self.rss_start

    def close(self) -> None:
        if self.attack is not None:
            self.attack.stop()
        if self.peak is not None:
            self.peak.stop()

    def still_serves_and_released(self) -> None:
        """After the attacker left: a new peer pushes and pulls, and, with the other peers
        closed, the target's RSS comes back to within the bound of its start."""
        for a in list(self.peers):
            self.drop(a)
        late = self.peer("late")
        self.push_pull(late)
        self.drop(late)
        try:
            wait_for(
                lambda: trimmed_rss_mib() - self.rss_start <= RSS_AFTER_MIB + RSS_SLACK_MIB,
                5.0,
                "the target's RSS back near its start after the attacker left",
            )
        except AssertionError:
            raise AssertionError(
                f"the target still holds {trimmed_rss_mib() - self.rss_start:.0f} MiB more than "
                f"before the attack, 5 s after the attacker left (bound {RSS_AFTER_MIB} + "
                f"{RSS_SLACK_MIB})"
            ) from None


@pytest.fixture
def scene(make_agent: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> Iterator[Scene]:
    # the attacks make the target log refusals by the thousand: none is kept in memory here
    caplog.set_level(logging.CRITICAL, logger="kvlink")
    s = Scene(make_agent)
    try:
        yield s
    finally:
        s.close()


def _bounded_during(grown_mib: float) -> None:
    assert grown_mib <= RSS_DURING_MIB + RSS_SLACK_MIB, (
        f"the target grew {grown_mib:.0f} MiB under one attacking peer "
        f"(bound {RSS_DURING_MIB} + {RSS_SLACK_MIB})"
    )


def test_announce_lockout_kept_alive_does_not_refuse_other_pushes(scene: Scene) -> None:
    """Four pushes of 65,536 chunks, each kept "active" by a 1-byte DATA every 0.3 s, held
    every inbound chunk slot of the agent: other peers' pushes were refused ("push 1 was not
    announced ... out of room for inbound transfers?")."""
    scene.start("announce-lockout")
    scene.during()
    _bounded_during(scene.leave())
    scene.still_serves_and_released()


def test_a_flood_of_65536_chunk_announces_does_not_refuse_other_pushes(scene: Scene) -> None:
    """65,536-chunk ANNOUNCEs at 100 per second (no key needed) kept the chunk slots full of
    pushes under 1 s old, which eviction spares."""
    scene.start("announce-big")
    scene.during()
    _bounded_during(scene.leave())
    scene.still_serves_and_released()


def test_a_flood_of_1_chunk_announces_starves_no_handshake_or_push(scene: Scene) -> None:
    """1-chunk ANNOUNCEs as fast as the agent takes them held its engine thread (every one
    walked the entry list and the handle queue): another peer's handshake timed out."""
    scene.start("announce-flood")
    scene.during()
    _bounded_during(scene.leave())
    scene.still_serves_and_released()


def test_a_notify_flood_neither_drops_other_notifications_nor_grows_unbounded(
    scene: Scene,
) -> None:
    """66,000 NOTIFYs with 4 KiB tags filled the 65,536-entry queue (+260 MiB), and another
    peer's notification was then dropped, though acknowledged to its sender."""
    scene.start("notify-flood")
    legit = scene.during()
    tag = b"legit-notification"
    legit.push("target", src=scene.src, dst="kv", notify=tag, timeout_s=TIMEOUT_S).wait(
        TIMEOUT_S + 1
    )
    scene.push_pull(legit)  # the flood goes on while the tagged push's NOTIFY goes out
    grown = scene.leave()
    got: list[bytes] = []
    deadline = time.monotonic() + 5  # a copy unanswered for 1 s is sent again
    while tag not in got and time.monotonic() < deadline:
        got += [n.tag for n in scene.target.notifications(timeout_s=0.5) if n.peer == "legit"]
    assert tag in got, "the legitimate peer's notification was not delivered"
    _bounded_during(grown)
    scene.still_serves_and_released()


def test_announced_tags_are_released_once_their_sender_left(scene: Scene) -> None:
    """16,384 ANNOUNCEs with 4 KiB tags, then the connection closed: +74 MiB held for up to
    300 s after the sender had gone."""
    scene.start("announce-tags")
    scene.during()
    _bounded_during(scene.leave())
    scene.still_serves_and_released()


def test_answers_a_peer_never_reads_are_bounded_and_released(scene: Scene) -> None:
    """READ_REQs of 8192 one-byte pieces whose answers are never read: each queued answer
    holds a 128 KiB iovec array the answer bound does not count (+200 MiB and more, most of
    it still held after the peer left)."""
    scene.start("unread-answers", conns=1)  # at most 4096 answers of 136 KiB held today
    scene.during()
    _bounded_during(scene.leave())
    scene.still_serves_and_released()


def test_trickled_bodies_are_bounded(scene: Scene) -> None:
    """100 connections, each a 1 MiB frame body arriving a byte every 4 s after most of it:
    the silence cut never fires and every body stays held (+100 MiB)."""
    scene.start("trickle", conns=100)
    scene.during()
    _bounded_during(scene.leave())
    scene.still_serves_and_released()
