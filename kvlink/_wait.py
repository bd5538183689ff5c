"""Blocking waits on the C core, in slices.

A C wait holds no Python lock (cffi releases the GIL), but it cannot see
Ctrl-C or a concurrent ``close()``; so every wait runs in slices of at most
``SLICE_S`` and starts again until it has an answer or its own time is up.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ._errors import ErrorCode, InvalidArgumentError

SLICE_S = 0.2  # blocking waits run in slices so Ctrl-C and close() get through
MAX_WAIT_MS = 2**31


def ms(timeout_s: float | None) -> int:
    """``timeout_s`` in whole milliseconds for the C core (None: the longest wait).

    Raises:
        InvalidArgumentError: a negative or non-numeric timeout.
    """
    if timeout_s is None:
        return MAX_WAIT_MS
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise InvalidArgumentError(f"timeout_s: expected seconds as a number, got {timeout_s!r}")
    if not timeout_s >= 0:
        raise InvalidArgumentError(f"timeout_s: must be >= 0, got {timeout_s}")
    return min(int(timeout_s * 1000), MAX_WAIT_MS)


def sliced(call: Callable[[int], int], timeout_s: float | None) -> int:
    """Calls ``call(slice_ms)`` until it answers something other than
    TIMEOUT or ``timeout_s`` has passed; returns its last return code."""
    ms(timeout_s)  # validates before the first call
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        step = SLICE_S if left is None else min(left, SLICE_S)
        rc = call(ms(step))
        if rc != ErrorCode.TIMEOUT or (left is not None and left <= step):
            return rc
