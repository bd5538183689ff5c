"""The initiator's handle of a push or pull: :class:`Transfer`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from . import _native
from ._args import int_error
from ._errors import ConnectionLostError, InvalidArgumentError, KvlinkError, error_for
from ._types import ChunkEvent, Op, TransferInfo, TransferState


def check_layer(layer: object, layers: int | None = None) -> int:
    """``layer`` if it is an int in range (``0 .. layers - 1`` when ``layers`` is known).

    Raises:
        InvalidArgumentError: anything else, naming the valid range.
    """
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise int_error("layer", layer, "a non-negative int")
    if layers is not None and layer >= layers:
        raise InvalidArgumentError(
            f"layer: expected an int in 0..{layers - 1} (the push's layers), got {layer!r}"
        )
    return layer


class Transfer:
    """Handle of a push or pull.  Thread-safe; waits release the GIL."""

    def __init__(
        self,
        handle: _native.Handle,
        op: Op,
        peer: str,
        nbytes: int,
        why_gone: Callable[[str], str | None] | None = None,
    ) -> None:
        self._x = handle
        self._why_gone = why_gone
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.id = self.info().id

    def __repr__(self) -> str:
        i = self.info()
        return (
            f"Transfer(id={self.id}, op={self.op.name}, peer={self.peer!r}, "
            f"state={i.state.name}, {i.bytes_done}/{i.bytes_total} bytes)"
        )

    def info(self) -> TransferInfo:
        """A snapshot of progress, timestamps and error."""
        return _native.xfer_info(self._x)

    @property
    def state(self) -> TransferState:
        return self.info().state

    @property
    def done(self) -> bool:
        """True once the transfer has finished, successfully or not."""
        return self.state != TransferState.RUNNING

    @property
    def ok(self) -> bool:
        """True once every byte has been verified at the destination."""
        return self.state == TransferState.DONE

    @property
    def bytes_done(self) -> int:
        return self.info().bytes_done

    @property
    def error(self) -> KvlinkError | None:
        """The transfer's error once it failed, else None."""
        i = self.info()
        if i.state != TransferState.FAILED:
            return None
        return self._explain(
            error_for(i.error_code, i.message, transfer=True, peer=self.peer, transfer_id=self.id)
        )

    def _explain(self, exc: KvlinkError) -> KvlinkError:
        """A lost connection to a peer that discovery removed says why."""
        why = self._why_gone(self.peer) if self._why_gone is not None else None
        if why and isinstance(exc, ConnectionLostError) and why not in exc.message:
            exc.message = f"{exc.message} (discovery removed peer {self.peer!r}: {why})"
            exc.args = (exc.message,)
        return exc

    def wait(self, timeout_s: float | None = None) -> Transfer:
        """Blocks until every byte is verified at the destination.

        Raises:
            ArgumentTypeError, InvalidArgumentError: ``timeout_s`` is not a
                non-negative number or None.
            TransferTimeoutError: still running after ``timeout_s`` (it goes
                on), or the transfer's own deadline passed (it failed).
            TransferError: the transfer failed; the subclass says why.
        """
        try:
            _native.xfer_wait(self._x, timeout_s, peer=self.peer, transfer_id=self.id)
        except ConnectionLostError as exc:
            raise self._explain(exc) from None
        return self

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Blocks until every chunk carrying bytes of ``layer`` is verified.

        Raises:
            InvalidArgumentError: the transfer carries no bytes of ``layer``.
            TransferTimeoutError, TransferError: as :meth:`wait`.
        """
        check_layer(layer)
        try:
            _native.xfer_wait_layer(
                self._x, layer, timeout_s, peer=self.peer, transfer_id=self.id
            )
        except ConnectionLostError as exc:
            raise self._explain(exc) from None

    def chunks(self, timeout_s: float | None = None) -> Iterator[ChunkEvent]:
        """Yields chunks as they are verified, in completion order, until the
        transfer is done.

        Raises:
            TransferTimeoutError: no chunk finished within ``timeout_s``.
            TransferError: the transfer failed.
        """
        while True:
            try:
                ev = _native.xfer_next_event(
                    self._x, timeout_s, peer=self.peer, transfer_id=self.id
                )
            except ConnectionLostError as exc:
                raise self._explain(exc) from None
            if ev is None:
                return
            yield ev
