"""The receiver's handle of a push: :class:`InboundTransfer`."""

from __future__ import annotations

from collections.abc import Iterator

from . import _native
from ._errors import KvlinkError
from ._handle import NativeOps, ProgressHandle, check_layer
from ._types import ChunkEvent, InboundInfo


class InboundTransfer(ProgressHandle):
    """A push arriving at this agent, as the receiver sees it, from its first
    frame on (:meth:`Agent.inbound <kvlink.Agent.inbound>`).

    The queries (:attr:`done`, :attr:`ok`, :meth:`layers_done`,
    :meth:`layer_done`) take one lock and copy a few integers: cheap enough to
    poll every engine step for hundreds of requests.  The waits block with
    the GIL released, in slices, so Ctrl-C gets through.  Thread-safe.
    """

    _ops = NativeOps(_native.inxfer_wait, _native.inxfer_wait_layer, _native.inxfer_next_event)
    _transfer_id = None  # its exceptions name the peer; transfer_id is the sender's

    def __init__(self, handle: _native.Handle) -> None:
        self._h = handle
        info = self.info()
        self.transfer_id = info.transfer_id
        self.peer = info.peer
        self.tag = info.tag
        self.nbytes = info.bytes_total
        self.layers = self._layers = info.layers

    def __repr__(self) -> str:
        i = self.info()
        return (
            f"InboundTransfer(peer={self.peer!r}, tag={self.tag!r}, state={i.state.name}, "
            f"{i.bytes_done}/{i.bytes_total} bytes, layers {i.layers_ready}/{i.layers})"
        )

    def info(self) -> InboundInfo:
        """A full snapshot (copies the tag; use the properties to poll)."""
        return _native.inxfer_info(self._h)

    def _poll(self) -> _native.Progress:
        return _native.inxfer_progress(self._h)

    @property
    def done(self) -> bool:
        """True once the push has finished here, successfully or not."""
        return self._done()

    @property
    def ok(self) -> bool:
        """True once every byte of the push is verified in this agent's memory."""
        return self._ok()

    @property
    def error(self) -> KvlinkError | None:
        """The push's error once it failed here, else None."""
        return self._error()

    def layers_done(self) -> int:
        """How many layers from layer 0 on are verified here: layers
        ``0 .. layers_done() - 1`` may be used (a later layer may be done too:
        :meth:`layer_done`)."""
        return self._poll().layers_ready

    def layer_done(self, layer: int) -> bool:
        """True if every byte of ``layer`` is verified here.

        Raises:
            InvalidArgumentError: the push has no such layer.
        """
        return _native.inxfer_layer_done(self._h, check_layer(layer, self.layers))

    def wait(self, timeout_s: float | None = None) -> InboundTransfer:
        """Blocks until every byte of the push is verified here.

        Raises:
            TransferTimeoutError: still arriving after ``timeout_s`` (it goes
                on), or the sender's deadline passed without it finishing.
            TransferError: the sender failed the push (the subclass and the
                message say why), or the agent was closed.
        """
        return self._wait(timeout_s)

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Blocks until every chunk carrying bytes of ``layer`` is verified here.

        Raises:
            InvalidArgumentError: the push has no such layer.
            TransferTimeoutError, TransferError: as :meth:`wait`.
        """
        self._wait_layer(layer, timeout_s)

    def chunks(self, timeout_s: float | None = None) -> Iterator[ChunkEvent]:
        """Yields chunks as they are verified here, in arrival order, until
        the push is done (``path`` is this side's connection index).

        Raises:
            TransferTimeoutError: no chunk arrived within ``timeout_s``.
            TransferError: the push failed.
        """
        return self._chunks(timeout_s)
