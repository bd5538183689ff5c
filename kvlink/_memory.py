"""Memory adapters: numpy, buffer protocol, torch, DLPack, CUDA arrays.

Each turns a caller's object into a :class:`MemorySpan` (address, length,
read-only flag, memory type, CUDA device) plus the object that keeps the
memory alive.  GPU memory is recognised here (``__cuda_array_interface__``,
torch CUDA tensors, DLPack on kDLCUDA / kDLCUDAManaged); whether it really is
device memory the core checks with the CUDA runtime at registration.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ._errors import RegistrationError
from ._native import buffer_address
from ._types import MemoryType

T = TypeVar("T")

# DLPack device types (dlpack.h DLDeviceType)
_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_HOST = 3  # pinned host memory: host memory to kvlink
_DLPACK_CUDA_MANAGED = 13
_DLPACK_HOST_TYPES = (_DLPACK_CPU, _DLPACK_CUDA_HOST)
_DLPACK_CUDA_TYPES = (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED)


@dataclass(frozen=True)
class MemorySpan:
    """A contiguous range of memory and what keeps it alive."""

    address: int
    nbytes: int
    readonly: bool
    mem: MemoryType
    keepalive: Any
    device: int = -1  # CUDA ordinal for MemoryType.CUDA; -1: host, or not told


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
            "there is no memory to register; register a tensor allocated on the CPU or a GPU"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise RegistrationError(
            f"{arg}: the torch tensor is on {t.device}; kvlink registers CPU and CUDA tensors"
        )
    if not t.is_contiguous():
        raise RegistrationError(
            f"{arg}: the torch tensor is not contiguous (shape {tuple(t.shape)}, "
            f"stride {t.stride()}); register t.contiguous() or its base tensor"
        )
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        raise RegistrationError(f"{arg}: the tensor is empty (0 bytes)")
    if t.device.type == "cuda":
        dev = t.device.index if t.device.index is not None else -1
        return MemorySpan(int(t.data_ptr()), int(nbytes), False, MemoryType.CUDA, t, int(dev))
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
            f"{exc}); pass a numpy array, a torch tensor, a CUDA array or a DLPack tensor"
        ) from exc


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, unit: int) -> bool:
    """strides (in units of ``unit`` bytes) describe a C-contiguous layout of
    shape; dimensions of extent 1 may have any stride."""
    if strides is None:
        return True
    if len(strides) != len(shape):
        return False
    expect = unit
    for extent, stride in zip(reversed(shape), reversed(strides), strict=True):
        if extent != 1 and stride != expect:
            return False
        expect *= extent
    return True


def _from_cai(obj: Any, arg: str) -> MemorySpan:
    """``__cuda_array_interface__`` (CuPy, Numba, PyTorch, ...): version 2+."""
    cai = _ask(obj, arg, lambda: obj.__cuda_array_interface__)
    what = f"the {type(obj).__module__}.{type(obj).__name__} array"
    try:
        shape = tuple(int(d) for d in cai["shape"])
        itemsize = np.dtype(cai["typestr"]).itemsize
        ptr, readonly = cai["data"]
        strides = cai.get("strides")
        strides = None if strides is None else tuple(int(s) for s in strides)
    except (KeyError, TypeError, ValueError) as exc:
        raise RegistrationError(
            f"{arg}: {what} has a malformed __cuda_array_interface__ ({exc})"
        ) from exc
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0 or not ptr:
        raise RegistrationError(f"{arg}: {what} is empty (0 bytes)")
    if not _c_contiguous(shape, strides, itemsize):
        raise RegistrationError(
            f"{arg}: {what} is not C-contiguous (shape {shape}, strides {strides}); "
            "register a contiguous copy (cupy.ascontiguousarray) or its base array"
        )
    dev = -1
    if _is_cupy(obj):  # CuPy says which device; other producers leave it to the runtime
        dev = int(_ask(obj, arg, lambda: obj.device.id))
    return MemorySpan(int(ptr), int(nbytes), bool(readonly), MemoryType.CUDA, obj, dev)


# ---- DLPack capsules (dlpack.h, read without consuming them) ----------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _is_capsule(obj: Any) -> bool:
    return type(obj).__name__ == "PyCapsule"


def _from_capsule(capsule: Any, owner: Any, arg: str) -> MemorySpan:
    """A "dltensor" capsule (DLManagedTensor, whose first member is the
    DLTensor).  It is kept unconsumed: its destructor returns the tensor to
    its producer once the region lets go of it."""
    if not _capsule_valid(capsule, b"dltensor"):
        raise RegistrationError(
            f"{arg}: the capsule is not an unconsumed DLPack 'dltensor' (used already, or "
            "another kind of capsule); pass the tensor itself or a fresh __dlpack__() capsule"
        )
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    dev_type, dev_id = int(t.device.device_type), int(t.device.device_id)
    if dev_type not in _DLPACK_HOST_TYPES + _DLPACK_CUDA_TYPES:
        raise RegistrationError(
            f"{arg}: DLPack device type {dev_type} is not supported; kvlink registers CPU "
            "(1), CUDA host (3), CUDA (2) and CUDA managed (13) memory"
        )
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = None if not t.strides else tuple(int(t.strides[i]) for i in range(t.ndim))
    bits = int(t.dtype.bits) * int(t.dtype.lanes)
    if bits % 8:
        raise RegistrationError(f"{arg}: DLPack elements of {bits} bits are not whole bytes")
    nbytes = math.prod(shape) * (bits // 8)
    if nbytes == 0 or not t.data:
        raise RegistrationError(f"{arg}: the DLPack tensor is empty (0 bytes)")
    if not _c_contiguous(shape, strides, 1):
        raise RegistrationError(
            f"{arg}: the DLPack tensor is not C-contiguous (shape {shape}, strides {strides}); "
            "register a contiguous copy or its base tensor"
        )
    address = int(t.data) + int(t.byte_offset)
    if dev_type in _DLPACK_CUDA_TYPES:
        return MemorySpan(address, nbytes, False, MemoryType.CUDA, (owner, capsule), dev_id)
    return MemorySpan(address, nbytes, False, MemoryType.HOST, (owner, capsule))


def _from_dlpack(obj: Any, arg: str) -> MemorySpan:
    dev_type, _ = _ask(obj, arg, obj.__dlpack_device__)
    if dev_type in _DLPACK_CUDA_TYPES or dev_type == _DLPACK_CUDA_HOST:
        # stream=None: the producer synchronises with the legacy default stream
        capsule = _ask(obj, arg, lambda: obj.__dlpack__(stream=None))
        return _from_capsule(capsule, obj, arg)
    if dev_type != _DLPACK_CPU:
        raise RegistrationError(f"{arg}: DLPack device type {dev_type} is not supported")
    try:
        arr = np.from_dlpack(obj)
    except (BufferError, TypeError, RuntimeError) as exc:
        raise RegistrationError(f"{arg}: cannot view the DLPack tensor: {exc}") from exc
    span = _from_numpy(arr, arg)
    return MemorySpan(span.address, span.nbytes, span.readonly, span.mem, (obj, arr))


def as_span(obj: Any, arg: str = "memory") -> MemorySpan:
    """The memory behind ``obj``.

    Raises:
        RegistrationError: non-contiguous, empty, an unsupported device, or an
            object that exposes no memory; the message names ``arg``.
    """
    if isinstance(obj, np.ndarray):
        return _from_numpy(obj, arg)
    if _is_torch(obj):
        return _from_torch(obj, arg)
    if _is_capsule(obj):
        return _from_capsule(obj, None, arg)
    if _is_cupy(obj) or _ask(obj, arg, lambda: hasattr(obj, "__cuda_array_interface__")):
        return _from_cai(obj, arg)
    if _ask(obj, arg, lambda: hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        return _from_dlpack(obj, arg)
    try:
        view = memoryview(obj)
    except TypeError:
        raise RegistrationError(
            f"{arg}: {type(obj).__name__} exposes no memory; pass a numpy array, a torch "
            "tensor, a CUDA array (__cuda_array_interface__), a DLPack tensor or a "
            "buffer-protocol object (bytearray, mmap, ...)"
        ) from None
    if not view.c_contiguous:
        raise RegistrationError(f"{arg}: the buffer is not contiguous")
    if view.nbytes == 0:
        raise RegistrationError(f"{arg}: the buffer is empty (0 bytes)")
    address, cdata = buffer_address(obj)
    return MemorySpan(address, view.nbytes, view.readonly, MemoryType.HOST, (obj, cdata))
