"""The receiver's handle of a push: :class:`InboundTransfer`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ._agent import ChunkEvent, TransferState
from ._errors import ErrorCode, InvalidArgumentError, KvlinkError, error_for
from ._native import check, cstr, ffi, lib
from ._wait import sliced


@dataclass(frozen=True)
class InboundInfo:
    """A snapshot of a push arriving here."""

    transfer_id: int  # the sender's transfer id
    peer: str
    state: TransferState
    bytes_total: int
    bytes_done: int
    chunks_total: int
    chunks_done: int
    layers: int
    layers_ready: int  # layers 0 .. layers_ready-1 are all verified here
    t_announce_ns: int
    t_first_byte_ns: int
    t_done_ns: int
    tag: bytes
    error_code: ErrorCode
    message: str


class InboundTransfer:
    """A push arriving at this agent, as the receiver sees it, from its first
    frame on (:meth:`Agent.inbound <kvlink.Agent.inbound>`).

    The queries (:attr:`done`, :attr:`ok`, :meth:`layers_done`,
    :meth:`layer_done`) take one lock and copy a few integers: cheap enough to
    poll every engine step for hundreds of requests.  The waits block with
    the GIL released, in slices, so Ctrl-C gets through.  Thread-safe.
    """

    def __init__(self, cdata: Any) -> None:
        self._t = ffi.gc(cdata, lib.kvl_inxfer_release)
        info = self.info()
        self.transfer_id = info.transfer_id
        self.peer = info.peer
        self.tag = info.tag
        self.nbytes = info.bytes_total
        self.layers = info.layers
        self._progress = ffi.new("kvl_inbound_progress *")

    def __repr__(self) -> str:
        i = self.info()
        return (
            f"InboundTransfer(peer={self.peer!r}, tag={self.tag!r}, state={i.state.name}, "
            f"{i.bytes_done}/{i.bytes_total} bytes, layers {i.layers_ready}/{i.layers})"
        )

    def info(self) -> InboundInfo:
        """A full snapshot (copies the tag; use the properties to poll)."""
        out = ffi.new("kvl_inbound_info *")
        check(lib.kvl_inxfer_info(self._t, out))
        failed = out.state == TransferState.FAILED
        return InboundInfo(
            transfer_id=int(out.xfer_id),
            peer=cstr(out.peer),
            state=TransferState(out.state),
            bytes_total=int(out.bytes_total),
            bytes_done=int(out.bytes_done),
            chunks_total=int(out.chunks_total),
            chunks_done=int(out.chunks_done),
            layers=int(out.layers),
            layers_ready=int(out.layers_ready),
            t_announce_ns=int(out.t_announce_ns),
            t_first_byte_ns=int(out.t_first_byte_ns),
            t_done_ns=int(out.t_done_ns),
            tag=bytes(ffi.buffer(out.tag, out.tag_len)),
            error_code=ErrorCode(out.err) if failed else ErrorCode.OK,
            message=cstr(out.message),
        )

    def _poll(self) -> Any:
        lib.kvl_inxfer_progress(self._t, self._progress)
        return self._progress

    @property
    def state(self) -> TransferState:
        return TransferState(self._poll().state)

    @property
    def done(self) -> bool:
        """True once the push has finished here, successfully or not."""
        return bool(self._poll().state != TransferState.RUNNING)

    @property
    def ok(self) -> bool:
        """True once every byte of the push is verified in this agent's memory."""
        return bool(self._poll().state == TransferState.DONE)

    @property
    def bytes_done(self) -> int:
        return int(self._poll().bytes_done)

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
        return int(self._poll().layers_ready)

    def layer_done(self, layer: int) -> bool:
        """True if every byte of ``layer`` is verified here.

        Raises:
            InvalidArgumentError: the push has no such layer.
        """
        self._check_layer(layer)
        out = ffi.new("int *")
        check(lib.kvl_inxfer_layer_done(self._t, layer, out))
        return bool(out[0])

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.layers:
            raise InvalidArgumentError(
                f"layer: expected an int in 0..{self.layers - 1} (the push's layers), got {layer!r}"
            )

    def _wait(self, fn: Any, *args: Any, timeout_s: float | None) -> None:
        rc = sliced(lambda step_ms: int(fn(self._t, *args, step_ms)), timeout_s)
        check(rc, transfer=True, peer=self.peer, waited_s=timeout_s)

    def wait(self, timeout_s: float | None = None) -> InboundTransfer:
        """Blocks until every byte of the push is verified here.

        Raises:
            TransferTimeoutError: still arriving after ``timeout_s`` (it goes
                on), or the sender's deadline passed without it finishing.
            TransferError: the sender failed the push (the subclass and the
                message say why), or the agent was closed.
        """
        self._wait(lib.kvl_inxfer_wait, timeout_s=timeout_s)
        return self

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Blocks until every chunk carrying bytes of ``layer`` is verified here.

        Raises:
            InvalidArgumentError: the push has no such layer.
            TransferTimeoutError, TransferError: as :meth:`wait`.
        """
        self._check_layer(layer)
        self._wait(lib.kvl_inxfer_wait_layer, layer, timeout_s=timeout_s)

    def chunks(self, timeout_s: float | None = None) -> Iterator[ChunkEvent]:
        """Yields chunks as they are verified here, in arrival order, until
        the push is done (``path`` is this side's connection index).

        Raises:
            TransferTimeoutError: no chunk arrived within ``timeout_s``.
            TransferError: the push failed.
        """
        ev = ffi.new("kvl_chunk_event *")
        while True:
            rc = sliced(
                lambda step_ms: int(lib.kvl_inxfer_next_event(self._t, step_ms, ev)), timeout_s
            )
            if rc == ErrorCode.END:
                return
            check(rc, transfer=True, peer=self.peer, waited_s=timeout_s)
            yield ChunkEvent.from_c(ev)
