"""Sizes as people write them: ``64MiB``, ``1GiB``, ``1.5GB``, ``4096``.

One parser for every place a size is read (the CLIs, the benchmark scripts, ``KVLINK_*``
settings), so a size accepted in one place is accepted in all of them.
"""

from __future__ import annotations

import re

__all__ = ["parse_size"]

# Decimal units are powers of 1000 (as disks and networks count), binary ones powers of 1024.
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
    "T": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: an int, or a number with an optional unit (``64MiB``, ``1.5GB``).

    ``K``/``M``/``G``/``T`` alone are binary (as iperf3 and tc read them); ``KB``/``MB``/``GB``
    are decimal; ``KiB``/``MiB``/``GiB`` binary. Units are case-insensitive.

    Raises:
        ValueError: ``text`` is not a size, is negative, or is not a whole number of bytes.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(
            f"a size must be an int or a string like '64MiB', not {type(text).__name__}"
        )
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    m = _SIZE.fullmatch(text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(
            f"not a size: {text!r}; write a number of bytes with an optional unit, "
            "e.g. 4096, 64MiB, 1GiB or 1.5GB"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r} is {value:g} bytes")
    return int(value)
