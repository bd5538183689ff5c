"""Fault injection on a timetable: links taken down, brought up and reshaped at given times while
a benchmark runs, with when each fault actually fired."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeAlias

from ._errors import TestbedConfigError, TestbedError
from ._rates import RateLike, _optional_rate
from ._testbed import Testbed

log = logging.getLogger("kvlink.testbed")


class FaultKind(enum.Enum):
    """What a fault does to a link."""

    DOWN = "down"
    UP = "up"
    RATE = "rate"


@dataclass(frozen=True)
class Fault:
    """One scheduled change: at ``at_s`` seconds after start, do ``kind`` to ``link``."""

    at_s: float
    kind: FaultKind
    link: int
    rate: RateLike = None  # only for FaultKind.RATE; None removes shaping

    def action(self) -> tuple[Any, ...]:
        """The action tuple this fault was written as: ("down", 0), ("rate", 1, "200mbit")."""
        if self.kind is FaultKind.RATE:
            return (self.kind.value, self.link, self.rate)
        return (self.kind.value, self.link)


@dataclass(frozen=True)
class FiredFault:
    """When a fault actually happened, in time.monotonic() seconds."""

    fault: Fault
    planned_at: float  # start + fault.at_s
    fired_at: float  # just before the ip/tc commands ran
    done_at: float  # after they returned (the fault is in effect from here)
    error: str | None = None  # the TestbedError text if it failed

    @property
    def late_s(self) -> float:
        """How much later than planned the fault started firing."""
        return self.fired_at - self.planned_at

    def as_dict(self, started_at: float) -> dict[str, Any]:
        """A JSON-ready record with times relative to ``started_at`` (for benchmark logs)."""
        return {
            "action": list(self.fault.action()),
            "planned_s": self.fault.at_s,
            "fired_s": self.fired_at - started_at,
            "done_s": self.done_at - started_at,
            "error": self.error,
        }


FaultSpec: TypeAlias = Fault | tuple[float, tuple[Any, ...]]


def _to_fault(spec: FaultSpec, testbed: Testbed, index: int) -> Fault:
    where = f"faults[{index}]"
    if isinstance(spec, Fault):
        at_s, action = spec.at_s, spec.action()
    else:
        try:
            at_s, action = spec
        except (TypeError, ValueError):
            raise TestbedConfigError(
                f"{where}: expected (t_seconds, action) such as (1.0, ('down', 0)), got {spec!r}"
            ) from None
    if isinstance(at_s, bool) or not isinstance(at_s, (int, float)) or not at_s >= 0:
        raise TestbedConfigError(f"{where}: time {at_s!r} must be a number of seconds >= 0")
    if not isinstance(action, (tuple, list)) or not action:
        raise TestbedConfigError(f"{where}: action {action!r} must be a tuple like ('down', 0)")
    try:
        kind = FaultKind(action[0])
    except ValueError:
        raise TestbedConfigError(
            f"{where}: unknown action {action[0]!r}; use 'down', 'up' or 'rate'"
        ) from None
    expected = 3 if kind is FaultKind.RATE else 2
    if len(action) != expected:
        shape = "('rate', link, '200mbit')" if kind is FaultKind.RATE else f"('{kind.value}', link)"
        raise TestbedConfigError(f"{where}: action {tuple(action)!r} must look like {shape}")
    try:
        link = testbed._check_link(action[1])
    except TestbedConfigError as exc:
        raise TestbedConfigError(f"{where}: {exc}") from None
    rate: RateLike = None
    if kind is FaultKind.RATE:
        rate = action[2]
        _optional_rate(rate, name=f"{where}: rate")
    return Fault(at_s=float(at_s), kind=kind, link=link, rate=rate)


class FaultSchedule:
    """Apply link faults on a timetable in a background thread.

    ``faults`` are ``(t_seconds, action)`` pairs (or :class:`Fault`), with ``action`` one of
    ``("down", link)``, ``("up", link)``, ``("rate", link, "200mbit")``. Times are relative
    to :meth:`start`. Each fault's actual firing time is kept in :attr:`fired`.
    A fault that fails is recorded with its error and the schedule goes on; :meth:`join`
    raises the first failure. As a context manager it starts on entry and, on exit, skips the
    faults not yet due and waits for the thread.
    """

    def __init__(self, testbed: Testbed, faults: Iterable[FaultSpec]) -> None:
        """Validate the faults against ``testbed``.

        Raises:
            TestbedConfigError: a fault is malformed; the message names its index.
        """
        self.testbed = testbed
        parsed = [_to_fault(spec, testbed, i) for i, spec in enumerate(faults)]
        # Stable sort: faults at the same time fire in the order given.
        self.faults: tuple[Fault, ...] = tuple(sorted(parsed, key=lambda f: f.at_s))
        self.started_at: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._fired: list[FiredFault] = []
        self._errors: list[TestbedError] = []
        self._thread: threading.Thread | None = None

    @property
    def fired(self) -> list[FiredFault]:
        """The faults fired so far, in firing order."""
        with self._lock:
            return list(self._fired)

    @property
    def running(self) -> bool:
        """True while the background thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def records(self) -> list[dict[str, Any]]:
        """:attr:`fired` as JSON-ready dicts with times relative to start (empty before start)."""
        if self.started_at is None:
            return []
        return [f.as_dict(self.started_at) for f in self.fired]

    def start(self) -> float:
        """Start the clock and the thread.

        Returns:
            The start time (time.monotonic()) that fault times are relative to.

        Raises:
            TestbedError: the schedule was already started (make a new one to run it again).
        """
        if self._thread is not None:
            raise TestbedError("this FaultSchedule was already started; create a new one")
        self.started_at = time.monotonic()
        self._thread = threading.Thread(
            target=self._loop, args=(self.started_at,), name=f"kvlink-faults-{self.testbed.tag}",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        return self.started_at

    def _loop(self, started_at: float) -> None:
        for fault in self.faults:
            planned = started_at + fault.at_s
            if self._stop.wait(max(0.0, planned - time.monotonic())):
                return
            fired_at = time.monotonic()
            error: str | None = None
            try:
                if fault.kind is FaultKind.DOWN:
                    self.testbed.link_down(fault.link)
                elif fault.kind is FaultKind.UP:
                    self.testbed.link_up(fault.link)
                else:
                    self.testbed.set_rate(fault.link, fault.rate)
            except TestbedError as exc:
                error = str(exc)
                log.error("testbed %s: fault %s failed: %s", self.testbed.tag, fault.action(), exc)
                with self._lock:
                    self._errors.append(exc)
            record = FiredFault(fault, planned, fired_at, time.monotonic(), error)
            with self._lock:
                self._fired.append(record)
            log.info(
                "testbed %s: fault %s at +%.3f s (%.1f ms late)",
                self.testbed.tag, fault.action(), fired_at - started_at, record.late_s * 1e3,
            )  # fmt: skip

    def stop(self) -> None:
        """Skip the faults not yet fired (one firing now completes). Does not wait."""
        self._stop.set()

    def join(self, timeout_s: float | None = None, *, raise_errors: bool = True) -> None:
        """Wait for the thread to finish (all faults fired, or stopped).

        Raises:
            TestbedError: the thread is still running after ``timeout_s``, or (with
                raise_errors) a fault failed; the first failure is chained as the cause.
        """
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TestbedError(
                    f"fault schedule still running after {timeout_s} s; call stop() first "
                    "or wait longer"
                )
        with self._lock:
            errors = list(self._errors)
        if raise_errors and errors:
            raise TestbedError(f"{len(errors)} fault(s) failed; first: {errors[0]}") from errors[0]

    def __enter__(self) -> FaultSchedule:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self.join(raise_errors=False)
