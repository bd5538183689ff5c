"""The receiver's handle of a push: :class:`InboundTransfer`."""

from __future__ import annotations

from collections.abc import Iterator

from . import _native
from ._errors import KvlinkError, error_for
from ._transfer import check_layer
from ._types import ChunkEvent, InboundInfo, TransferState


class InboundTransfer:
    """A push arriving at this agent, as the receiver sees it, from its first
    frame on (:meth:`Agent.inbound <kvlink.Agent.inbound>`).

    The queries (:attr:`done`, :attr:`ok`, :meth:`layers_done`,
    :meth:`layer_done`) take one lock and copy a few integers: cheap enough to
    poll every engine step for hundreds of requests.  The waits block with
    the GIL released, in slices, so Ctrl-C gets through.  Thread-safe.
    """

    def __init__(self, handle: _native.Handle) -> None:
        self._t = handle
        info = self.info()
        self.transfer_id = info.transfer_id
        self.peer = info.peer
        self.tag = info.tag
        self.nbytes = info.bytes_total
        self.layers = info.layers

    def __repr__(self) -> str:
        i = self.info()
        return (
            f"InboundTransfer(peer={self.peer!r}, tag={self.tag!r}, state={i.state.name}, "
            f"{i.bytes_done}/{i.bytes_total} bytes, layers {i.layers_ready}/{i.layers})"
        )

    def info(self) -> InboundInfo:
        """A full snapshot (copies the tag; use the properties to poll)."""
        return _native.inxfer_info(self._t)

    def _poll(self) -> _native.Progress:
        return _native.inxfer_progress(self._t)

    @property
    def state(self) -> TransferState:
        return self._poll().state

    @property
    def done(self) -> bool:
        """True once the push has finished here, successfully or not."""
        return self._poll().state != TransferState.RUNNING

    @property
    def ok(self) -> bool:
        """True once every byte of the push is verified in this agent's memory."""
        return self._poll().state == TransferState.DONE

    @property
    def bytes_done(self) -> int:
        return self._poll().bytes_done

    @property
    def error(self) -> KvlinkError | None:
        """The push's error once it failed here, else None."""
        i = self.info()
        if i.state != TransferState.FAILED:
            return None
        return error_for(i.error_code, i.message, transfer=True, peer=self.peer)

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
        return _native.inxfer_layer_done(self._t, check_layer(layer, self.layers))

    def wait(self, timeout_s: float | None = None) -> InboundTransfer:
        """Blocks until every byte of the push is verified here.

        Raises:
            TransferTimeoutError: still arriving after ``timeout_s`` (it goes
                on), or the sender's deadline passed without it finishing.
            TransferError: the sender failed the push (the subclass and the
                message say why), or the agent was closed.
        """
        _native.inxfer_wait(self._t, timeout_s, peer=self.peer)
        return self

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Blocks until every chunk carrying bytes of ``layer`` is verified here.

        Raises:
            InvalidArgumentError: the push has no such layer.
            TransferTimeoutError, TransferError: as :meth:`wait`.
        """
        _native.inxfer_wait_layer(
            self._t, check_layer(layer, self.layers), timeout_s, peer=self.peer
        )

    def chunks(self, timeout_s: float | None = None) -> Iterator[ChunkEvent]:
        """Yields chunks as they are verified here, in arrival order, until
        the push is done (``path`` is this side's connection index).

        Raises:
            TransferTimeoutError: no chunk arrived within ``timeout_s``.
            TransferError: the push failed.
        """
        while True:
            ev = _native.inxfer_next_event(self._t, timeout_s, peer=self.peer)
            if ev is None:
                return
            yield ev
