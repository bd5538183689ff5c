"""What the two handles of a transfer share: :class:`ProgressHandle`, the base of
:class:`~kvlink.Transfer` (the initiator's) and :class:`~kvlink.InboundTransfer` (the
receiver's of a push).

Both wrap one C progress handle (csrc/progress.c): the waits run in slices with
the GIL released (``_native``), a failure becomes the transfer's exception, and
the chunk events come out in verification order.  The native handle is freed
when the Python object is collected; dropping a handle never cancels its transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol, TypeVar

from . import _native
from ._args import int_error
from ._errors import ConnectionLostError, InvalidArgumentError, KvlinkError, error_for
from ._types import ChunkEvent, TransferState

H = TypeVar("H", bound="ProgressHandle")


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


class NativeOps(NamedTuple):
    """One end's ``_native`` waits, each ``(handle, [layer,] timeout_s, *, peer,
    transfer_id)``."""

    wait: Callable[..., None]
    wait_layer: Callable[..., None]
    next_event: Callable[..., ChunkEvent | None]


class Counters(Protocol):
    """What a cheap poll reports (``TransferInfo``, ``_native.Progress``)."""

    @property
    def state(self) -> TransferState: ...
    @property
    def bytes_done(self) -> int: ...


class Snapshot(Counters, Protocol):
    """What a full snapshot reports besides (``TransferInfo``, ``InboundInfo``)."""

    @property
    def error_code(self) -> int: ...
    @property
    def message(self) -> str: ...


class ProgressHandle:
    """The shared part of a transfer's handle.  Thread-safe; waits release the GIL.

    A subclass sets ``_ops`` (its native waits) and, in ``__init__``, ``_h``
    (the native handle), ``peer``, ``_transfer_id`` (what its exceptions carry)
    and ``_layers`` (the layer count to check against, None to let the C core
    check); it provides ``info()`` and may override ``_poll`` and ``_explain``.
    """

    _ops: NativeOps
    _h: _native.Handle
    _transfer_id: int | None
    _layers: int | None
    peer: str

    def info(self) -> Snapshot:
        raise NotImplementedError

    def _poll(self) -> Counters:
        """State and verified bytes, as cheaply as the end can say them."""
        return self.info()

    def _explain(self, exc: KvlinkError) -> KvlinkError:
        """``exc``, or a clearer exception for it."""
        return exc

    @contextmanager
    def _explained(self) -> Iterator[None]:
        """Raises a lost connection as :meth:`_explain` words it."""
        try:
            yield
        except ConnectionLostError as exc:
            better = self._explain(exc)
            if better is exc:
                raise
            raise better from None

    def _kw(self) -> dict[str, Any]:
        return {"peer": self.peer, "transfer_id": self._transfer_id}

    # ---- state (each subclass documents done, ok and error its own way) ----

    @property
    def state(self) -> TransferState:
        return self._poll().state

    def _done(self) -> bool:
        return self._poll().state != TransferState.RUNNING

    def _ok(self) -> bool:
        return self._poll().state == TransferState.DONE

    @property
    def bytes_done(self) -> int:
        return self._poll().bytes_done

    def _error(self) -> KvlinkError | None:
        i = self.info()
        if i.state != TransferState.FAILED:
            return None
        return self._explain(error_for(i.error_code, i.message, transfer=True, **self._kw()))

    # ---- waits ----

    def _wait(self: H, timeout_s: float | None) -> H:
        with self._explained():
            self._ops.wait(self._h, timeout_s, **self._kw())
        return self

    def _wait_layer(self, layer: int, timeout_s: float | None) -> None:
        layer = check_layer(layer, self._layers)
        with self._explained():
            self._ops.wait_layer(self._h, layer, timeout_s, **self._kw())

    def _chunks(self, timeout_s: float | None) -> Iterator[ChunkEvent]:
        while True:
            with self._explained():
                ev = self._ops.next_event(self._h, timeout_s, **self._kw())
            if ev is None:
                return
            yield ev
