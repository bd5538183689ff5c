"""The initiator's handle of a push or pull: :class:`Transfer`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from . import _native
from ._errors import (
    ArgumentTypeError,
    ClosedError,
    ConnectionLostError,
    InvalidArgumentError,
    KvlinkError,
)
from ._handle import NativeOps, ProgressHandle
from ._types import ChunkEvent, Op, TransferInfo


class Transfer(ProgressHandle):
    """Handle of a push or pull.  Thread-safe; waits release the GIL."""

    _ops = NativeOps(_native.xfer_wait, _native.xfer_wait_layer, _native.xfer_next_event)
    _layers = None  # the C core knows which layers the transfer carries

    def __init__(
        self,
        handle: _native.Handle,
        op: Op,
        peer: str,
        nbytes: int,
        why_gone: Callable[[str], str | None] | None = None,
        using: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        self._h = handle
        self._why_gone = why_gone
        self._using = using  # the agent's: lends it for one call, ClosedError once closed
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.id = self._transfer_id = self.info().id

    def __repr__(self) -> str:
        i = self.info()
        return (
            f"Transfer(id={self.id}, op={self.op.name}, peer={self.peer!r}, "
            f"state={i.state.name}, {i.bytes_done}/{i.bytes_total} bytes)"
        )

    def info(self) -> TransferInfo:
        """A snapshot of progress, timestamps and error."""
        return _native.xfer_info(self._h)

    @property
    def done(self) -> bool:
        """True once the transfer has finished, successfully or not."""
        return self._done()

    @property
    def ok(self) -> bool:
        """True once every byte has been verified at the destination."""
        return self._ok()

    @property
    def error(self) -> KvlinkError | None:
        """The transfer's error once it failed, else None."""
        return self._error()

    def _explain(self, exc: KvlinkError) -> KvlinkError:
        """A lost connection to a peer that discovery removed says why."""
        why = self._why_gone(self.peer) if self._why_gone is not None else None
        if why and isinstance(exc, ConnectionLostError) and why not in exc.message:
            exc.message = f"{exc.message} (discovery removed peer {self.peer!r}: {why})"
            exc.args = (exc.message,)
        return exc

    def cancel(self, why: str = "") -> None:
        """Fails the transfer with :class:`TransferCancelledError` (``why`` in its message)
        unless it already finished, drops its queued chunks and, for a push, tells the peer at
        once (its inbound handle fails; nothing it received counts). Does not wait: once
        :meth:`wait` returns after this, no byte of the transfer's local memory is read or
        written any more, so the memory may be reused. A no-op on a finished transfer or a
        closed agent (closing failed it already).

        Raises:
            ArgumentTypeError: ``why`` is not a string.
        """
        if not isinstance(why, str):
            raise ArgumentTypeError(f"why: expected a str, got {type(why).__name__}")
        if self._using is None:
            raise InvalidArgumentError("this transfer was not started by an agent")
        try:
            with self._using():
                _native.xfer_cancel(self._h, why)
        except ClosedError:
            pass

    def wait(self, timeout_s: float | None = None) -> Transfer:
        """Blocks until every byte is verified at the destination.

        Raises:
            ArgumentTypeError, InvalidArgumentError: ``timeout_s`` is not a
                non-negative number or None.
            TransferTimeoutError: still running after ``timeout_s`` (it goes
                on), or the transfer's own deadline passed (it failed).
            TransferError: the transfer failed; the subclass says why.
        """
        return self._wait(timeout_s)

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Blocks until every chunk carrying bytes of ``layer`` is verified.

        Raises:
            InvalidArgumentError: the transfer carries no bytes of ``layer``.
            TransferTimeoutError, TransferError: as :meth:`wait`.
        """
        self._wait_layer(layer, timeout_s)

    def chunks(self, timeout_s: float | None = None) -> Iterator[ChunkEvent]:
        """Yields chunks as they are verified, in completion order, until the
        transfer is done.

        Raises:
            TransferTimeoutError: no chunk finished within ``timeout_s``.
            TransferError: the transfer failed.
        """
        return self._chunks(timeout_s)
