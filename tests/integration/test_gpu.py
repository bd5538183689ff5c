"""GPU memory (docs/api.md, "GPU memory").

Runs everywhere: registration of CUDA objects where no GPU (or no CUDA
runtime) is, and the staging path that GPU payloads take over TCP, driven with
host memory through ``Config(stage_host_memory=True)`` (memcpy instead of
cudaMemcpy, the same slots, crc checks, ordering and failure paths), over real
sockets.  The tests marked ``gpu`` need a CUDA GPU and CuPy or PyTorch; they
skip with "no CUDA GPU on this machine" even under KVLINK_REQUIRE_ALL=1: that
is the one skip CI allows, as CI machines have no GPU (bench/gpu/device_check.sh
runs them on one).
"""

from __future__ import annotations

import ctypes
import json
import socket
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import kvlink
from kvlink import _cuda
from tests.wire_client import ACK as F_ACK
from tests.wire_client import announce, connect, crc, data, key_of, recv_frame

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
NO_GPU = "no CUDA GPU on this machine"


# ---- objects that say they live on a CUDA device ------------------------------


class FakeCudaArray:
    """A __cuda_array_interface__ producer whose pointer is no device memory."""

    def __init__(self, address: int = 1 << 20, n: int = 1024) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "<f4",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


class _DLDevice(ctypes.Structure):
    _fields_: ClassVar = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLManagedTensor(ctypes.Structure):
    _fields_: ClassVar = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def dltensor_capsule(device_type: int, address: int, n: int, keep: list[Any]) -> Any:
    """A raw "dltensor" capsule of n uint8 at address on device_type (no deleter);
    keep holds the ctypes objects it points into."""
    shape = (ctypes.c_int64 * 1)(n)
    t = _DLManagedTensor(address, _DLDevice(device_type, 0), 1, 1, 8, 1, shape, None, 0)
    keep += [shape, t]
    return _capsule_new(ctypes.addressof(t), b"dltensor", None)


def test_cuda_array_without_the_cuda_runtime_is_refused_whole():
    """No libcudart anywhere (the candidates say so): the specific error, and no
    region behind it.  In a child process: a loaded runtime stays for the process."""
    script = textwrap.dedent(
        """
        import json, kvlink
        from kvlink import _cuda
        _cuda.runtime_candidates = lambda: ["/nonexistent/libcudart.so.12"]
        class Cai:
            __cuda_array_interface__ = {"shape": (256,), "typestr": "|u1",
                                        "data": (1 << 20, False), "version": 3}
        a = kvlink.Agent("no-cudart", kvlink.Config(nics="loopback:1"))
        try:
            a.register(Cai(), remote_write=True, name="kv")
        except kvlink.RegistrationError as exc:
            print(json.dumps({"error": str(exc), "regions": len(a.regions())}))
        a.close()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert "GPU memory needs the CUDA runtime (libcudart.so.12): not found" in r["error"]
    assert "/nonexistent/libcudart.so.12" in r["error"]
    assert "nvidia-cuda-runtime-cu12" in r["error"]
    assert r["regions"] == 0


def _has_gpu() -> bool:
    try:
        _cuda.ensure_runtime()
    except kvlink.RegistrationError:
        return False
    return bool(_cuda.gpu_numa_node(0)[0])


@pytest.mark.parametrize("kind", ["cai", "dlpack-cuda", "dlpack-managed"])
def test_cuda_objects_that_are_not_device_memory_are_refused(make_agent, kind):
    """Without a GPU (or with one: the pointer is host memory) a CUDA-typed
    object is refused with a RegistrationError naming CUDA, and nothing stays."""
    a = make_agent(f"gpu-refuse-{kind}")
    host = np.zeros(4096, np.uint8)  # a host address that claims to be on the device
    keep: list[Any] = []
    obj: Any
    if kind == "cai":
        obj = FakeCudaArray(host.ctypes.data, 1024)
    else:
        obj = dltensor_capsule(2 if kind == "dlpack-cuda" else 13, host.ctypes.data, 4096, keep)
    with pytest.raises(kvlink.RegistrationError, match="CUDA") as ei:
        a.register(obj, remote_write=True, name="kv")
    assert "memory:" in str(ei.value)
    assert a.regions() == []
    a.register(host, remote_write=True, name="kv")  # the name was not taken


def test_dlpack_cuda_host_capsule_is_host_memory(make_agent):
    """kDLCUDAHost (pinned host memory) registers as host memory."""
    a = make_agent("gpu-dl-host")
    host = np.arange(4096, dtype=np.uint32).view(np.uint8)
    keep: list[Any] = []
    r = a.register(dltensor_capsule(3, host.ctypes.data, host.nbytes, keep))
    assert r.mem == kvlink.MemoryType.HOST and r.address == host.ctypes.data
    assert r.nbytes == host.nbytes and r.device == -1


def test_cuda_array_interface_checks(make_agent):
    a = make_agent("gpu-cai-checks")
    bad = FakeCudaArray()
    bad.__cuda_array_interface__["strides"] = (8,)
    with pytest.raises(kvlink.RegistrationError, match="not C-contiguous"):
        a.register(bad)
    empty = FakeCudaArray(n=0)
    with pytest.raises(kvlink.RegistrationError, match="empty"):
        a.register(empty)
    assert a.regions() == []


# ---- the staging path, with host memory (stage_host_memory=True) -------------

# every staging test twice: I/O on the engine thread, and on two I/O threads
staged = pytest.mark.usefixtures("io_threads_mode")


def _pair(make_agent, tag: str, paths: int = 3, **cfg: Any) -> tuple[Any, Any]:
    cfg.setdefault("stage_host_memory", True)
    a = make_agent(f"stage-a-{tag}", nics=f"loopback:{paths}", **cfg)
    b = make_agent(f"stage-b-{tag}", nics=f"loopback:{paths}", **cfg)
    return a, b


def _link(a: Any, b: Any) -> None:
    """Each adds the other (after registering: metadata carries the keys)."""
    a.add_peer(b.metadata())
    b.add_peer(a.metadata())


@staged
def test_staged_push_and_pull_are_byte_exact(make_agent):
    a, b = _pair(make_agent, "rt")
    n = 48 * MiB
    src = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    a.register(src, remote_read=True, name="src")
    b.register(dst, remote_write=True, name="dst")
    _link(a, b)
    t = a.push("stage-b-rt", src=src, dst="dst")
    t.wait(60)
    assert t.info().chunks_total >= 3  # chunks of at most gpu_chunk_bytes (16 MiB)
    assert np.array_equal(src, dst)
    back = np.zeros(n, np.uint8)
    b.register(back)
    b.pull("stage-a-rt", src="src", dst=back).wait(60)
    assert np.array_equal(src, back)
    assert sum(p.chunks_done for p in a.paths()) > 0
    assert all(p.numa_node == -1 for p in a.paths())  # loopback: no device


@staged
def test_staged_pieces_spanning_regions(make_agent):
    """Chunks whose pieces come from and go to several regions: each piece is
    gathered from and scattered to its own memory."""
    a, b = _pair(make_agent, "seg", paths=2, gpu_chunk_bytes="64KiB", min_chunk_bytes=4096)
    rng = np.random.default_rng(3)
    srcs = [rng.integers(0, 256, 300_000, dtype=np.uint8) for _ in range(2)]
    dsts = [np.zeros(300_000, np.uint8) for _ in range(2)]
    sr = [a.register(s) for s in srcs]
    dr = [b.register(d, remote_write=True, name=f"d{i}") for i, d in enumerate(dsts)]
    seg = np.zeros(6, dtype=kvlink.SEGMENT_DTYPE)
    # interleaved 100 kB blocks: block k of src (k % 2) -> block of dst ((k + 1) % 2)
    for k in range(6):
        seg[k] = (sr[k % 2].id, (k // 2) * 100_000, dr[(k + 1) % 2].id, (k // 2) * 100_000,
                  100_000, 0, 0)
    _link(a, b)
    a.push("stage-b-seg", segments=seg).wait(30)
    for k in range(6):
        off = (k // 2) * 100_000
        want = srcs[k % 2][off : off + 100_000]
        assert np.array_equal(dsts[(k + 1) % 2][off : off + 100_000], want)


@staged
@pytest.mark.parametrize("pool", ["256MiB", "0"], ids=["pool", "nopool"])
def test_staged_chunks_are_small_and_a_large_transfer_completes(make_agent, pool):
    """A transfer far larger than a staging slot moves in slot-sized chunks; with
    gpu_staging_bytes=0 no idle slot is kept (each is freed once its payload
    left or landed) and it still completes."""
    a, b = _pair(make_agent, f"small{pool}", paths=2, gpu_chunk_bytes="256KiB",
                 min_chunk_bytes=4096, gpu_staging_bytes=pool)  # fmt: skip
    n = 8 * MiB + 12345
    src = np.random.default_rng(11).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    a.register(src)
    b.register(dst, remote_write=True, name="dst")
    _link(a, b)
    t = a.push(f"stage-b-small{pool}", src=src, dst="dst")
    t.wait(60)
    assert t.info().chunks_total >= n // (256 << 10)
    assert np.array_equal(src, dst)


@staged
def test_one_side_staged_both_ways(make_agent):
    """Only one end stages (as GPU <-> host mixes do): push and pull in both
    directions, with the staging end sending and receiving."""
    a = make_agent("mix-a", nics="loopback:2", stage_host_memory=True)
    b = make_agent("mix-b", nics="loopback:2")
    n = 24 * MiB + 77
    rng = np.random.default_rng(9)
    a_src, b_src = (rng.integers(0, 256, n, dtype=np.uint8) for _ in range(2))
    a_dst, b_dst = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    a.register(a_src, remote_read=True, name="src")
    a.register(a_dst, remote_write=True, name="dst")
    b.register(b_src, remote_read=True, name="src")
    b.register(b_dst, remote_write=True, name="dst")
    _link(a, b)
    a.push("mix-b", src=a_src, dst="dst").wait(60)  # staged sender
    b.push("mix-a", src=b_src, dst="dst").wait(60)  # staged receiver
    assert np.array_equal(b_dst, a_src) and np.array_equal(a_dst, b_src)
    a_dst[:] = 0
    b_dst[:] = 0
    a.pull("mix-b", src="src", dst=a_dst).wait(60)  # staged receiver of READ_RESP
    b.pull("mix-a", src="src", dst=b_dst).wait(60)  # staged responder
    assert np.array_equal(a_dst, b_src) and np.array_equal(b_dst, a_src)


@pytest.mark.ucx
def test_staged_over_ucx_paths(make_agent, monkeypatch):
    """Staged frames on UCX paths: a push's payload is put from the sender's
    slot, a pull's comes in-stream into the receiver's slot; both byte-exact."""
    from kvlink import _transport
    from tests.conftest import unavailable

    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_MODULES", "^ib,ib_mlx5,ib_mlx5_ext")
    ok, why = _transport.ucx_status()
    if not ok:
        unavailable(f"UCX not usable here: {why}")
    secret = "kvlink-test-secret-0123456789abcdef"
    a = make_agent("ucxs-a", nics="loopback:2", transport="ucx", secret=secret,
                   stage_host_memory=True)  # fmt: skip
    b = make_agent("ucxs-b", nics="loopback:2", transport="ucx", secret=secret,
                   stage_host_memory=True)  # fmt: skip
    n = 20 * MiB + 5
    src = np.random.default_rng(4).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    a.register(src, remote_read=True, name="src")
    b.register(dst, remote_write=True, name="dst")
    _link(a, b)
    a.push("ucxs-b", src=src, dst="dst").wait(60)
    assert np.array_equal(src, dst)
    assert sum(p.bytes_put for p in a.paths()) > 0, [p.transport_note for p in a.paths()]
    back = np.zeros(n, np.uint8)
    b.register(back)
    b.pull("ucxs-a", src="src", dst=back).wait(60)
    assert np.array_equal(src, back)


def _staging_receiver(make_agent, name: str) -> tuple[Any, np.ndarray, int, bytes, Any]:
    rx = make_agent(name, nics="loopback:1", stage_host_memory=True)
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    return rx, dst, rid, key_of(rx.metadata(), rid), rx.addresses[0]


@staged
def test_staged_corrupt_payload_never_reaches_memory(make_agent):
    """A payload whose crc32c fails is refused with CHECKSUM, and staged, none of
    its bytes reach the destination (they are checked before they are placed)."""
    _rx, dst, rid, key, addr = _staging_receiver(make_agent, "stage-rx-bad")
    d = connect(addr, 1, 0)
    try:
        good = bytes(range(256)) * (MiB // 256)
        bad = bytearray(good)
        bad[12345] ^= 0xFF
        d.sendall(announce(5, MiB, 1) + data(5, 0, 1, rid, MiB, key) + bytes(bad))
        d.sendall(struct.pack("<I", crc(good)))
        t, body = recv_frame(d)
        assert t == F_ACK
        assert struct.unpack_from("<QIII", body)[3] == kvlink.ErrorCode.CHECKSUM
        assert not dst.any(), "a staged payload that failed its crc was placed"
        # the good copy then lands whole
        d.sendall(data(5, 0, 2, rid, MiB, key) + good + struct.pack("<I", crc(good)))
        t, body = recv_frame(d)
        assert t == F_ACK and struct.unpack_from("<QIII", body)[3] == 0
        assert dst.tobytes() == good
    finally:
        d.close()


@staged
def test_staged_payload_larger_than_a_chunk_is_refused(make_agent):
    """A peer cannot make a receiver stage (pin) more than a chunk of its own
    configuration: such a payload is refused by name, and nothing is placed."""
    rx = make_agent("stage-rx-big", stage_host_memory=True, chunk_bytes="256KiB",
                    min_chunk_bytes=4096, gpu_chunk_bytes="256KiB")  # fmt: skip
    dst = np.zeros(MiB, np.uint8)
    rid = rx.register(dst, remote_write=True).id
    d = connect(rx.addresses[0], 1, 0)
    try:
        good = b"\x42" * MiB
        d.sendall(announce(9, MiB, 1) + data(9, 0, 1, rid, MiB, key_of(rx.metadata(), rid)))
        d.sendall(good + struct.pack("<I", crc(good)))
        t, body = recv_frame(d)
        assert t == F_ACK
        assert struct.unpack_from("<QIII", body)[3] == kvlink.ErrorCode.INVALID_ARG
        assert b"gpu_chunk_bytes" in body
        assert not dst.any()
    finally:
        d.close()


@staged
def test_staged_cut_payload_is_not_placed_or_reported(make_agent):
    """A connection cut mid-payload: nothing placed, no chunk reported, and the
    push's handle does not complete."""
    rx, dst, rid, key, addr = _staging_receiver(make_agent, "stage-rx-cut")
    d = connect(addr, 1, 0)
    d.sendall(announce(6, MiB, 1, tag=b"cut") + data(6, 0, 1, rid, MiB, key) + b"\x5a" * (MiB // 2))
    d.shutdown(socket.SHUT_WR)
    d.close()
    inbound = rx.inbound(timeout_s=5)
    with pytest.raises(kvlink.KvlinkError):
        inbound.wait(timeout_s=3)
    assert not dst.any()


@staged
def test_staged_transfer_to_a_dead_peer_fails(make_agent):
    """A staged push whose receiver goes away fails; it never reports done."""
    a, b = _pair(make_agent, "dead", paths=2, connect_timeout_s=1.0, transfer_timeout_s=5.0)
    n = 32 * MiB
    src = np.ones(n, np.uint8)
    dst = np.zeros(n, np.uint8)
    a.register(src)
    b.register(dst, remote_write=True, name="dst")
    _link(a, b)
    b.close()
    with pytest.raises(kvlink.KvlinkError):
        a.push("stage-b-dead", src=src, dst="dst").wait(30)


def test_stage_host_memory_is_checked():
    with pytest.raises(kvlink.ConfigError, match="stage_host_memory"):
        kvlink.Config(stage_host_memory=1)  # type: ignore[arg-type]
    with pytest.raises(kvlink.ConfigError, match="gpu_chunk_bytes"):
        kvlink.Config(gpu_chunk_bytes=10)
    with pytest.raises(kvlink.ConfigError, match="gpu_staging_bytes"):
        kvlink.Config(gpu_staging_bytes=-1)


# ---- topology (sysfs parsing) ------------------------------------------------


def test_numa_nodes_from_sysfs(tmp_path):
    dev = tmp_path / "bus" / "pci" / "devices" / "0000:3b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    nic = tmp_path / "class" / "net" / "eth9" / "device"
    nic.mkdir(parents=True)
    (nic / "numa_node").write_text("0\n")
    (tmp_path / "class" / "net" / "lo").mkdir(parents=True)  # virtual: no device
    odd = tmp_path / "class" / "net" / "odd" / "device"
    odd.mkdir(parents=True)
    (odd / "numa_node").write_text("garbage")
    assert _cuda.pci_numa_node("0000:3B:00.0", tmp_path) == 1  # as cudaDeviceGetPCIBusId spells it
    assert _cuda.pci_numa_node("0000:af:00.0", tmp_path) == -1
    assert _cuda.pci_numa_node("", tmp_path) == -1
    assert _cuda.nic_numa_node("eth9", tmp_path) == 0
    assert _cuda.nic_numa_node("lo", tmp_path) == -1
    assert _cuda.nic_numa_node("odd", tmp_path) == -1
    assert _cuda.nic_numa_node("../../etc", tmp_path) == -1


def test_runtime_candidates_end_with_the_sonames():
    c = _cuda.runtime_candidates()
    assert c[-2:] == ["libcudart.so.12", "libcudart.so"]


# ---- with a GPU ------------------------------------------------------------------


def _gpu_arrays() -> Any:
    """cupy, or skip: the one skip CI allows (no GPU there), also under
    KVLINK_REQUIRE_ALL=1."""
    if not _has_gpu():
        pytest.skip(NO_GPU)
    try:
        import cupy
    except ImportError:
        pytest.skip(f"{NO_GPU} usable from Python: cupy is not installed")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("src_mem,dst_mem", [("cuda", "cuda"), ("cuda", "host"), ("host", "cuda")])
def test_gpu_push_and_pull_byte_exact(make_agent, src_mem, dst_mem):
    cp = _gpu_arrays()
    a = make_agent(f"gpu-a-{src_mem}{dst_mem}", nics="loopback:2")
    b = make_agent(f"gpu-b-{src_mem}{dst_mem}", nics="loopback:2")
    n = 40 * MiB + 4096
    host_src = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
    src = cp.asarray(host_src) if src_mem == "cuda" else host_src
    dst = cp.zeros(n, cp.uint8) if dst_mem == "cuda" else np.zeros(n, np.uint8)
    ra = a.register(src, remote_read=True, name="src")
    b.register(dst, remote_write=True, name="dst")
    _link(a, b)
    if src_mem == "cuda":
        assert ra.mem == kvlink.MemoryType.CUDA and ra.device == 0 and ra.pci_bus_id
    a.push(b.name, src=src, dst="dst").wait(60)
    got = cp.asnumpy(dst) if dst_mem == "cuda" else dst
    assert np.array_equal(got, host_src)
    back = cp.zeros(n, cp.uint8) if dst_mem == "cuda" else np.zeros(n, np.uint8)
    b.register(back)
    b.pull(a.name, src="src", dst=back).wait(60)
    got = cp.asnumpy(back) if dst_mem == "cuda" else back
    assert np.array_equal(got, host_src)


@pytest.mark.gpu
def test_gpu_torch_and_dlpack(make_agent):
    _gpu_arrays()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"{NO_GPU} usable from torch (a CPU build of torch)")
    a = make_agent("gpu-torch-a", nics="loopback:1")
    b = make_agent("gpu-torch-b", nics="loopback:1")
    src = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    dst = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    a.register(src)
    r = b.register(torch.utils.dlpack.to_dlpack(dst), remote_write=True, name="dst")
    assert r.mem == kvlink.MemoryType.CUDA
    _link(a, b)
    a.push(b.name, src=src, dst="dst").wait(60)
    assert torch.equal(src, dst)
