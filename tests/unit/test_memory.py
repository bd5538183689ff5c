"""Registration of every supported memory kind, and the errors for the rest."""

from __future__ import annotations

import mmap
from typing import ClassVar

import numpy as np
import pytest

import kvlink
from tests.conftest import require


def test_numpy_views_inside_a_region_are_found(make_agent):
    a = make_agent("mem-np")
    arr = np.arange(1024, dtype=np.uint32)
    r = a.register(arr, remote_read=True, name="arr")
    assert r.nbytes == arr.nbytes and r.address == arr.ctypes.data
    assert a._locate(arr[256:512], "src") == (r.id, 1024, 1024)
    with pytest.raises(kvlink.InvalidArgumentError, match="already exists"):
        a.register(np.zeros(4), name="arr")


def test_buffer_protocol_objects(make_agent):
    a = make_agent("mem-buf")
    ba = bytearray(4096)
    assert a.register(ba, remote_write=True).nbytes == 4096
    mm = mmap.mmap(-1, 8192)
    assert a.register(mm).nbytes == 8192
    ro = a.register(b"x" * 100, remote_read=True)
    assert ro.readonly
    a.deregister(ro)
    with pytest.raises(kvlink.UnknownRegionError):
        a.deregister(ro)


class DLPackOnly:
    """A CPU tensor reachable only through the DLPack protocol."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, **kw):
        return self._arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


class FakeCuda:
    __cuda_array_interface__: ClassVar[dict[str, object]] = {
        "shape": (4,),
        "typestr": "<f4",
        "data": (0, False),
        "version": 3,
    }


def test_dlpack_cpu_tensor(make_agent):
    a = make_agent("mem-dl")
    arr = np.ones(256, np.float32)
    r = a.register(DLPackOnly(arr))
    assert r.address == arr.ctypes.data and r.nbytes == 1024


def test_cuda_array_that_is_not_device_memory_is_refused(make_agent):
    """A CUDA-typed object is registered only once the CUDA runtime confirms it is
    device memory: without a runtime, a GPU, or with a host pointer, a
    RegistrationError naming CUDA (tests/integration/test_gpu.py has more)."""
    a = make_agent("mem-gpu")
    with pytest.raises(kvlink.RegistrationError, match="empty"):
        a.register(FakeCuda())  # a null pointer
    host = np.zeros(16, np.float32)
    fake = FakeCuda()
    fake.__cuda_array_interface__ = {**FakeCuda.__cuda_array_interface__,
                                     "data": (host.ctypes.data, False)}  # fmt: skip
    with pytest.raises(kvlink.RegistrationError, match="CUDA"):
        a.register(fake)
    assert a.regions() == []


def test_torch_cpu_tensor(make_agent):
    torch = require("torch")
    a = make_agent("mem-torch")
    t = torch.arange(1000, dtype=torch.float32)
    r = a.register(t, remote_read=True)
    assert r.address == t.data_ptr() and r.nbytes == 4000
    with pytest.raises(kvlink.RegistrationError, match="not contiguous"):
        a.register(torch.ones(8, 8).t())
    dl = a.register(DLPackOnly(torch.ones(16)))
    assert dl.nbytes == 64


def test_torch_push_between_processes(make_agent, spawn_peer):
    torch = require("torch")
    rx = spawn_peer("rx-torch")
    rx.call("alloc", key="w", nbytes=4 << 20, remote_write=True, name="w")
    tx = make_agent("tx-torch")
    t = torch.arange((4 << 20) // 4, dtype=torch.int32)
    tx.register(t)
    tx.add_peer(rx.metadata)
    tx.push("rx-torch", src=t, dst="w").wait(10)
    assert (
        rx.call("read", key="w", offset=4000, nbytes=8)["hex"]
        == t[1000:1002].numpy().tobytes().hex()
    )


def test_torch_meta_tensor_is_named(make_agent):
    torch = require("torch")
    a = make_agent("mem-meta")
    with pytest.raises(kvlink.RegistrationError, match=r"meta tensor.*no storage"):
        a.register(torch.empty(1024, device="meta"))


class _BrokenDeviceArray:
    """An array library whose attributes fail without its driver (as CuPy's do)."""

    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")


def test_array_library_errors_are_wrapped(make_agent):
    a = make_agent("mem-broken")
    with pytest.raises(kvlink.RegistrationError, match="memory: cannot tell where") as ei:
        a.register(_BrokenDeviceArray())
    assert isinstance(ei.value.__cause__, RuntimeError)


def test_cupy_array_without_a_driver(make_agent):
    cupy = pytest.importorskip("cupy", reason="cupy (an optional GPU array library) is absent")
    a = make_agent("mem-cupy")
    try:
        arr = cupy.zeros(16, dtype=cupy.uint8)
    except Exception:  # no driver: cupy cannot even allocate; nothing reaches kvlink
        pytest.skip("cupy cannot allocate without a GPU driver")
    with pytest.raises(kvlink.RegistrationError, match=r"CUDA|cannot tell"):
        a.register(arr)
