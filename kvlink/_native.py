"""The only module that touches the compiled C core.

It loads ``kvlink._kvlink_c`` and turns every non-zero return code into the
matching :class:`~kvlink.KvlinkError`; nothing above it sees a raw code.
cffi releases the GIL around every call, so blocking waits do not stall
other Python threads.
"""

from __future__ import annotations

import re
from typing import Any

from ._errors import ErrorCode, error_for

# "within 199 ms" / "after 199 ms" in the C core's timeout messages
_SLICE_MS = re.compile(r"\b(within|after) \d+ ms\b")

try:
    from ._kvlink_c import ffi, lib
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "kvlink's C core is not built: run `make build` (or `pip install -e .`) in the "
        "kvlink checkout"
    ) from exc

__all__ = ["ErrorCode", "check", "ffi", "last_error", "lib"]


def last_error() -> str:
    """The C core's message for the last error in this thread."""
    return str(ffi.string(lib.kvl_last_error()).decode("utf-8", "replace"))


def check(
    rc: int,
    *,
    transfer: bool = False,
    peer: str | None = None,
    transfer_id: int | None = None,
    waited_s: float | None = None,
) -> None:
    """Raises the exception for ``rc`` unless it is KVL_OK.

    ``waited_s``: the caller's whole timeout, for a wait the Python layer ran
    in slices; a TIMEOUT message then names it instead of the last slice.

    Raises:
        KvlinkError: the subclass matching ``rc``, with the C core's message.
    """
    if rc != 0:
        msg = last_error()
        if rc == ErrorCode.TIMEOUT and waited_s is not None:
            msg = _SLICE_MS.sub(lambda m: f"{m.group(1)} {waited_s:g} s", msg, count=1)
        raise error_for(rc, msg, transfer=transfer, peer=peer, transfer_id=transfer_id)


def cstr(data: Any) -> str:
    """A NUL-terminated char array from the C core as str."""
    return str(ffi.string(data).decode("utf-8", "replace"))


def make_plan(
    segments: Any, n_paths: int, chunk_bytes: int, min_chunk_bytes: int, max_pieces: int
) -> tuple[Any, Any, int, int]:
    """Runs the C chunk planner on a SEGMENT_DTYPE array (for tests and tools).

    Returns (chunks, pieces, chunk_target, n_layers): ``chunks`` rows are
    (first_piece, n_pieces, layer_first, layer_last, bytes) and ``pieces`` rows
    are (segment index, offset in segment, length), as numpy int64 arrays.

    Raises:
        InvalidArgumentError: what kvl_plan_make rejects.
    """
    import numpy as np

    plan = ffi.new("kvl_plan *")
    check(
        lib.kvl_plan_make(
            ffi.cast("const kvl_segment *", segments.ctypes.data),
            len(segments),
            n_paths,
            chunk_bytes,
            min_chunk_bytes,
            max_pieces,
            plan,
        )
    )
    try:
        chunks = np.array(
            [
                (c.first_piece, c.n_pieces, c.layer_first, c.layer_last, c.bytes)
                for c in plan.chunks[0 : plan.n_chunks]
            ],
            dtype=np.int64,
        ).reshape(-1, 5)
        raw = np.frombuffer(ffi.buffer(plan.pieces, plan.n_pieces * 24), dtype="<u8")
        pieces = raw.reshape(-1, 3).astype(np.int64)
        return chunks, pieces, int(plan.chunk_target), int(plan.n_layers)
    finally:
        lib.kvl_plan_free(plan)
