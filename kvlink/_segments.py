"""Segments: contiguous byte ranges a transfer moves, as one numpy record array.

The dtype mirrors ``kvl_segment`` in csrc/include/kvlink.h byte for byte, so
an array of them is handed to the C core without a per-segment Python loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from ._errors import InvalidArgumentError

SEGMENT_DTYPE = np.dtype(
    [
        ("src_region", "<u8"),
        ("src_offset", "<u8"),
        ("dst_region", "<u8"),
        ("dst_offset", "<u8"),
        ("len", "<u8"),
        ("layer", "<u4"),
        ("_pad", "<u4"),
    ]
)
assert SEGMENT_DTYPE.itemsize == 48


class Segment(NamedTuple):
    """(src region, src offset) -> (dst region, dst offset), ``length`` bytes."""

    src_region: int
    src_offset: int
    dst_region: int
    dst_offset: int
    length: int
    layer: int = 0


def as_segment_array(segments: Any, arg: str = "segments") -> np.ndarray[Any, Any]:
    """``segments`` (a SEGMENT_DTYPE array or an iterable of :class:`Segment`)
    as a C-contiguous SEGMENT_DTYPE array.

    Raises:
        InvalidArgumentError: wrong type, negative values or zero lengths.
    """
    if isinstance(segments, np.ndarray):
        if segments.dtype != SEGMENT_DTYPE:
            raise InvalidArgumentError(
                f"{arg}: expected dtype kvlink.SEGMENT_DTYPE, got {segments.dtype}"
            )
        arr = np.ascontiguousarray(segments.reshape(-1))
    elif isinstance(segments, Iterable):
        rows = [tuple(s) for s in segments]
        for i, row in enumerate(rows):
            if len(row) not in (5, 6) or any(not isinstance(v, (int, np.integer)) for v in row):
                raise InvalidArgumentError(
                    f"{arg}[{i}]: expected a Segment of integers, got {row!r}"
                )
            if any(int(v) < 0 for v in row):
                raise InvalidArgumentError(f"{arg}[{i}]: negative value in {row!r}")
        arr = np.zeros(len(rows), dtype=SEGMENT_DTYPE)
        for i, row in enumerate(rows):
            arr[i] = (*row[:5], row[5] if len(row) == 6 else 0, 0)
    else:
        raise InvalidArgumentError(f"{arg}: expected Segments, got {type(segments).__name__}")
    if arr.size == 0:
        raise InvalidArgumentError(f"{arg}: no segments; a transfer moves at least one byte")
    zero = np.flatnonzero(arr["len"] == 0)
    if zero.size:
        raise InvalidArgumentError(f"{arg}[{int(zero[0])}]: length is 0")
    return arr
