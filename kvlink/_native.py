"""The only module that touches the compiled C core.

It loads ``kvlink._kvlink_c`` and turns every non-zero return code into the
matching :class:`~kvlink.KvlinkError`; nothing above it sees a raw code.
cffi releases the GIL around every call, so blocking waits do not stall
other Python threads.
"""

from __future__ import annotations

from typing import Any

from ._errors import ErrorCode, error_for

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
) -> None:
    """Raises the exception for ``rc`` unless it is KVL_OK.

    Raises:
        KvlinkError: the subclass matching ``rc``, with the C core's message.
    """
    if rc != 0:
        raise error_for(rc, last_error(), transfer=transfer, peer=peer, transfer_id=transfer_id)


def cstr(data: Any) -> str:
    """A NUL-terminated char array from the C core as str."""
    return str(ffi.string(data).decode("utf-8", "replace"))
