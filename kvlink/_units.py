"""Byte sizes as people write them: one parser for the library, its config and its CLIs."""

from __future__ import annotations

import re

# Decimal units are powers of 1000, binary ones (KiB, and the bare K/M/G/T that
# iperf3 reads as binary) powers of 1024.
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
    "T": 1 << 40,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_HEX = re.compile(r"\s*0[xX][0-9a-fA-F]+\s*")
_EXAMPLES = "e.g. 4096, 0x1000, 64MiB, 1GiB, 1.5GB"


def parse_size(text: str | int) -> int:
    """A number of bytes from an int or a string such as ``"4096"``,
    ``"0x1000"``, ``"64MiB"``, ``"1GiB"``, ``"1.5GB"`` or ``"16M"`` (units are
    case-insensitive; KB/MB/GB/TB are decimal, KiB/MiB/GiB/TiB and bare K/M/G/T
    binary).

    Raises:
        ValueError: not a size, negative, or a fraction of a byte; the message
            shows the accepted forms.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"not a size: {text!r}; expected bytes as an int or text ({_EXAMPLES})")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"not a size: {text} is negative")
        return text
    if _HEX.fullmatch(text):
        return int(text, 16)
    m = _SIZE.fullmatch(text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} ({_EXAMPLES})")
    number = m.group(1)
    if "." not in number:
        return int(number) * _UNITS[unit]
    whole, _, frac = number.partition(".")
    # exact arithmetic: 1.1GB must be 1100000000, not a float rounding of it
    scaled = int(whole or "0") * _UNITS[unit] * 10 ** len(frac) + int(frac or "0") * _UNITS[unit]
    value, rest = divmod(scaled, 10 ** len(frac))
    if rest:
        raise ValueError(f"not a size: {text!r} is not a whole number of bytes")
    return int(value)


__all__ = ["parse_size"]
