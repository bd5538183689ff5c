"""Memory adapters: numpy, buffer protocol, torch, DLPack, CUDA arrays.

Each turns a caller's object into a :class:`MemorySpan` (address, length,
read-only flag, memory type) plus the object that keeps the memory alive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ._errors import RegistrationError
from ._native import buffer_address
from ._types import MemoryType

T = TypeVar("T")

_DLPACK_CPU = 1
_DLPACK_CUDA = 2


@dataclass(frozen=True)
class MemorySpan:
    """A contiguous range of memory and what keeps it alive."""

    address: int
    nbytes: int
    readonly: bool
    mem: MemoryType
    keepalive: Any


def _gpu_unsupported(what: str, arg: str) -> RegistrationError:
    return RegistrationError(
        f"{arg}: {what} lives in GPU memory, which the TCP transport cannot read; "
        "copy it to host memory, or use the UCX transport (GPUDirect) once built"
    )


def _from_numpy(arr: np.ndarray[Any, Any], arg: str) -> MemorySpan:
    if not arr.flags.c_contiguous:
        raise RegistrationError(
            f"{arg}: the array is not C-contiguous (shape {arr.shape}, strides {arr.strides}); "
            "register np.ascontiguousarray(a) or the base array it views"
        )
    if arr.nbytes == 0:
        raise RegistrationError(f"{arg}: the array is empty (0 bytes)")
    return MemorySpan(
        address=int(arr.__array_interface__["data"][0]),
        nbytes=int(arr.nbytes),
        readonly=not arr.flags.writeable,
        mem=MemoryType.HOST,
        keepalive=arr,
    )


def _from_torch(t: Any, arg: str) -> MemorySpan:
    if t.device.type == "meta":
        raise RegistrationError(
            f"{arg}: the torch tensor is a meta tensor: it has a shape but no storage, so "
            "there is no memory to register; register a tensor allocated on the CPU"
        )
    if t.device.type != "cpu":
        raise _gpu_unsupported(f"the torch tensor on {t.device}", arg)
    if not t.is_contiguous():
        raise RegistrationError(
            f"{arg}: the torch tensor is not contiguous (shape {tuple(t.shape)}, "
            f"stride {t.stride()}); register t.contiguous() or its base tensor"
        )
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        raise RegistrationError(f"{arg}: the tensor is empty (0 bytes)")
    return MemorySpan(int(t.data_ptr()), int(nbytes), False, MemoryType.HOST, t)


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _is_cupy(obj: Any) -> bool:
    # by module, without touching the object: without a GPU driver even reading
    # a CuPy array's attributes raises CuPy's own errors
    return type(obj).__module__.split(".")[0] == "cupy"


def _ask(obj: Any, arg: str, question: Callable[[], T]) -> T:
    """``question()`` about ``obj``, with whatever the object's library raises
    while answering (CuPy without a GPU driver, say) as a RegistrationError."""
    try:
        return question()
    except Exception as exc:
        raise RegistrationError(
            f"{arg}: cannot tell where the {type(obj).__name__} lives ({type(exc).__name__}: "
            f"{exc}); kvlink registers host memory: pass a numpy array or a CPU tensor"
        ) from exc


def as_span(obj: Any, arg: str = "memory") -> MemorySpan:
    """The memory behind ``obj``.

    Raises:
        RegistrationError: non-contiguous, empty, GPU memory, or an object
            that exposes no memory; the message names ``arg``.
    """
    if isinstance(obj, np.ndarray):
        return _from_numpy(obj, arg)
    if _is_torch(obj):
        return _from_torch(obj, arg)
    if _is_cupy(obj) or _ask(obj, arg, lambda: hasattr(obj, "__cuda_array_interface__")):
        raise _gpu_unsupported(f"the {type(obj).__module__}.{type(obj).__name__} array", arg)
    if _ask(obj, arg, lambda: hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        dev_type, _ = _ask(obj, arg, obj.__dlpack_device__)
        if dev_type == _DLPACK_CUDA:
            raise _gpu_unsupported(f"the DLPack tensor ({type(obj).__name__})", arg)
        if dev_type != _DLPACK_CPU:
            raise RegistrationError(f"{arg}: DLPack device type {dev_type} is not supported")
        try:
            arr = np.from_dlpack(obj)
        except (BufferError, TypeError, RuntimeError) as exc:
            raise RegistrationError(f"{arg}: cannot view the DLPack tensor: {exc}") from exc
        span = _from_numpy(arr, arg)
        return MemorySpan(span.address, span.nbytes, span.readonly, span.mem, (obj, arr))
    try:
        view = memoryview(obj)
    except TypeError:
        raise RegistrationError(
            f"{arg}: {type(obj).__name__} exposes no memory; pass a numpy array, a torch "
            "tensor, a DLPack tensor or a buffer-protocol object (bytearray, mmap, ...)"
        ) from None
    if not view.c_contiguous:
        raise RegistrationError(f"{arg}: the buffer is not contiguous")
    if view.nbytes == 0:
        raise RegistrationError(f"{arg}: the buffer is empty (0 bytes)")
    address, cdata = buffer_address(obj)
    return MemorySpan(address, view.nbytes, view.readonly, MemoryType.HOST, (obj, cdata))
