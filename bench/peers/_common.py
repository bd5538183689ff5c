"""What every peer worker shares: the JSON-lines loop, the data pattern and CPU time.

A worker is one process in one of two roles. The *target* owns the destination buffer; the
*initiator* owns the source and writes it into the target's buffer. kvlink/bench/peers.py (for
compare.py and kvlink-bench) drives both over stdin/stdout, one JSON object per line each way:

    both:      (start)  -> {"ok": true, "event": "ready", "info": {...}} once memory is
               registered; the target's info is what the initiator needs to reach it
    initiator: {"cmd": "connect", "info": {...}, "warm_bytes": N}  -> {"ok": true, "warm_s": s}
               {"cmd": "fill", "seed": S} -> {"ok": true}  (the source := pattern S)
               {"cmd": "run", "tag": T} -> {"ok": true, "seconds": s, "cpu_s": c, "t0_ns", "t1_ns"}
    either:    {"cmd": "cpu"}     -> {"ok": true, "cpu_s": total so far (getrusage, all threads)}
    target:    {"cmd": "await_done", ...} -> {"ok": true, "t_ns": when the timed write's data
               was known to be here, "cpu_s": ...} (nixl and ucxx; sent before "run")
    target:    {"cmd": "verify", "seed": S} -> {"ok": true, "verified": bool, "bad_at": off|None}
    either:    {"cmd": "exit"}    -> {"ok": true} and the process exits

Errors come back as {"ok": false, "error": "<type>", "message": "..."}; library logs go to
stderr so they never corrupt stdout. This file runs inside each peer's own virtual
environment, so it needs only the standard library and numpy.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

# Verify and fill in slices of this many bytes so the check needs no second 1 GiB array.
_SLICE = 64 << 20


def cpu_s() -> float:
    """User + system CPU seconds of this process so far, all threads included."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def timed_result(nbytes: int, t0: int, t1: int, cpu0: float, cpu1: float) -> dict[str, Any]:
    """The answer to "run": one timed write of ``nbytes`` between t0 and t1 (ns)."""
    s = (t1 - t0) / 1e9
    return {"seconds": s, "gbps": nbytes / s / 1e9, "cpu_s": cpu1 - cpu0, "t0_ns": t0, "t1_ns": t1}


def now_ns() -> int:
    # CLOCK_MONOTONIC is one clock for every process on the host, network namespaces included.
    return time.monotonic_ns()


def touched(nbytes: int) -> np.ndarray:
    """A zeroed buffer whose pages are all faulted in (np.zeros alone maps them lazily)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0)
    return buf


def fill(buf: np.ndarray, seed: int) -> None:
    """64-bit word i of ``buf`` := i + seed * 2**40: every word differs, and so does each seed."""
    words = buf.view(np.uint64)
    step = _SLICE // 8
    for start in range(0, words.size, step):
        stop = min(words.size, start + step)
        words[start:stop] = np.arange(start, stop, dtype=np.uint64) + np.uint64(seed << 40)


def first_mismatch(buf: np.ndarray, seed: int) -> int | None:
    """Byte offset of the first 8-byte word that differs from ``fill(buf, seed)``, or None."""
    words = buf.view(np.uint64)
    step = _SLICE // 8
    for start in range(0, words.size, step):
        stop = min(words.size, start + step)
        want = np.arange(start, stop, dtype=np.uint64) + np.uint64(seed << 40)
        bad = np.flatnonzero(words[start:stop] != want)
        if bad.size:
            return int(start + bad[0]) * 8
    return None


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def error_reply(exc: BaseException) -> dict[str, Any]:
    return {
        "ok": False,
        "error": type(exc).__name__,
        "message": str(exc),
        "trace": traceback.format_exc(limit=5),
    }


def serve(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Answer commands from stdin until "exit" or EOF. ``handle`` gets each request."""
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        cmd = req.get("cmd")
        try:
            if cmd == "cpu":
                rep: dict[str, Any] = {"cpu_s": cpu_s()}
            elif cmd == "exit":
                rep = {}
            else:
                rep = handle(req)
            reply({"ok": True, **rep})
        except Exception as exc:
            reply(error_reply(exc))
        if cmd == "exit":
            return


def quiet_stdout() -> None:
    """Point fd 1 at stderr for native libraries, keeping a private stdout for the replies.

    Native code (glog, UCX) that prints to fd 1 would otherwise interleave with the JSON.
    """
    keep = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(keep, "w", buffering=1)
