"""What every benchmark measures with: data patterns and their check, CPU and memory of a
process, and the way sizes and rates are written in results.

Throughput figures named ``gbps`` are GB/s (1e9 bytes per second), never Gbit/s.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import statistics
from typing import Any

import numpy as np

from .._units import parse_size

# Spreads word indices over all 64 bits, so a word at the wrong offset never matches.
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# uint64 words per fill/check step: 512 KiB temporaries, lost in a process's peak RSS (the
# loopback benchmark checks that RSS stays within registered memory + 64 MiB).
_STEP = 1 << 16
USER_HZ = os.sysconf("SC_CLK_TCK")
MiB = 1 << 20
GiB = 1 << 30


def _words(lo: int, hi: int, seed: int) -> np.ndarray[Any, Any]:
    return np.arange(lo + seed, hi + seed, dtype=np.uint64) * GOLDEN


def fill_pattern(buf: np.ndarray[Any, Any], seed: int = 0) -> None:
    """Word i of ``buf`` (bytes, any length) := (i + seed) * GOLDEN; a tail shorter than a
    word holds the low bytes of the next one. Every byte is predictable from its offset."""
    flat = buf.reshape(-1).view(np.uint8)
    n8 = flat.size // 8 * 8
    words = flat[:n8].view(np.uint64)
    for lo in range(0, words.size, _STEP):
        hi = min(lo + _STEP, words.size)
        np.multiply(np.arange(lo + seed, hi + seed, dtype=np.uint64), GOLDEN, out=words[lo:hi])
    if n8 < flat.size:
        flat[n8:] = _words(n8 // 8, n8 // 8 + 1, seed).view(np.uint8)[: flat.size - n8]


def check_pattern(
    buf: np.ndarray[Any, Any], nbytes: int | None = None, seed: int = 0
) -> tuple[int, int]:
    """(bytes of the first ``nbytes`` that differ from :func:`fill_pattern`, offset of the
    first, or -1)."""
    flat = buf.reshape(-1).view(np.uint8)
    nbytes = flat.size if nbytes is None else nbytes
    bad_total, first = 0, -1
    for lo in range(0, nbytes, _STEP * 8):
        hi = min(lo + _STEP * 8, nbytes)
        w0, w1 = lo // 8, (hi + 7) // 8
        want = _words(w0, w1, seed).view(np.uint8)[: hi - lo]
        diff = np.flatnonzero(flat[lo:hi] != want)
        if diff.size:
            bad_total += int(diff.size)
            if first < 0:
                first = lo + int(diff[0])
    return bad_total, first


def random_bytes(nbytes: int, seed: int) -> np.ndarray[Any, Any]:
    """``nbytes`` reproducible random bytes: the same ``seed`` gives the same array anywhere."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8).copy()


def digest(buf: np.ndarray[Any, Any]) -> str:
    """blake2b of the bytes of ``buf``."""
    return hashlib.blake2b(np.ascontiguousarray(buf).reshape(-1).view(np.uint8).data).hexdigest()


# ---- CPU and memory ------------------------------------------------------------------------


def cpu_times() -> tuple[float, float]:
    """(user, system) CPU seconds of this process, every thread included (getrusage)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return float(ru.ru_utime), float(ru.ru_stime)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far."""
    return sum(cpu_times())


def proc_cpu_s(pid: int) -> float:
    """utime + stime of another live process, all its threads (clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / USER_HZ


def status_kib(field: str, pid: int | str = "self") -> int:
    """A ``kB`` field of /proc/PID/status (VmRSS, VmHWM); -1 when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def memory() -> dict[str, int]:
    """Current and peak RSS of this process (VmHWM: ru_maxrss is inherited across exec)."""
    return {
        "rss_kib": status_kib("VmRSS"),
        "hwm_kib": status_kib("VmHWM"),
        "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


# ---- how figures are written ---------------------------------------------------------------


def size_arg(text: str) -> int:
    """argparse type for a size (kvlink._units.parse_size): 64MiB, 1GiB, 1.5GB, 4096."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def median(xs: list[float]) -> float:
    """The median, NaN for no samples."""
    return statistics.median(xs) if xs else float("nan")


def fmt_size(n: int) -> str:
    """64MiB, 1GiB, 20MB, 4096B: exact binary units where they fit."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    if n >= 10**6:
        return f"{n / 1e6:g}MB"
    return f"{n}B"


def chunk_label(chunk_bytes: int | None) -> str:
    """A result's chunk column: auto (the planner's choice, 0), a size, or - (not kvlink)."""
    if chunk_bytes is None:
        return "-"
    return "auto" if chunk_bytes == 0 else fmt_size(chunk_bytes)
