"""GPU memory support: the CUDA runtime and where a GPU sits (docs/api.md, "GPU memory").

The C core loads ``libcudart`` at run time (``dlopen``, csrc/cuda.c), on the
first registration of GPU memory; nothing needs CUDA to build or import
kvlink.  This module finds the candidates (the ``nvidia-cuda-runtime-cu12``
wheel's library first, then the loader's search path) and hands them to the
core, and reads the NUMA nodes of GPUs and NICs from sysfs.
"""

from __future__ import annotations

import importlib.util
import socket
import threading
from pathlib import Path

from . import _native
from ._errors import KvlinkError, RegistrationError

_lock = threading.Lock()
_loaded = False

HINT = "pip install nvidia-cuda-runtime-cu12, or install the CUDA toolkit"


# Sonames the loader's search path may resolve, after the wheel's copy.
SONAMES = ("libcudart.so.12", "libcudart.so")


def runtime_candidates() -> list[str]:
    """What the core tries to load, in order: ``libcudart`` from the
    ``nvidia-cuda-runtime-cu12`` wheel if installed, then :data:`SONAMES`."""
    return [*_wheel_libraries(), *SONAMES]


def _wheel_libraries() -> list[str]:
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    out = []
    for loc in spec.submodule_search_locations:
        for name in ("libcudart.so.12", "libcudart.so"):
            lib = Path(loc) / "lib" / name
            if lib.is_file():
                out.append(str(lib))
    return out


def ensure_runtime(arg: str = "memory") -> None:
    """Loads the CUDA runtime into the core, once per process.

    Raises:
        RegistrationError: no CUDA runtime was found; the message says what
            was tried and what to install.
    """
    global _loaded
    with _lock:
        if _loaded:
            return
        ok, why = _native.cuda_load(runtime_candidates())
        if not ok:
            raise RegistrationError(f"{arg}: {why}")
        _loaded = True


def _read_int(path: Path) -> int:
    """The integer in a sysfs file; -1 when missing or unreadable."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return -1


def pci_numa_node(bus_id: str, sysfs: str | Path = "/sys") -> int:
    """NUMA node of the PCI device ``bus_id`` ("0000:3b:00.0", any case), from
    ``<sysfs>/bus/pci/devices/<bus_id>/numa_node``; -1 when unknown."""
    bdf = bus_id.strip().lower()
    if not bdf:
        return -1
    return _read_int(Path(sysfs) / "bus" / "pci" / "devices" / bdf / "numa_node")


def nic_numa_node(nic: str, sysfs: str | Path = "/sys") -> int:
    """NUMA node of network interface ``nic``, from
    ``<sysfs>/class/net/<nic>/device/numa_node``; -1 when unknown (loopback
    and virtual interfaces have no device)."""
    if not nic or "/" in nic:
        return -1
    return _read_int(Path(sysfs) / "class" / "net" / nic / "device" / "numa_node")


def nic_of_address(address: str) -> str | None:
    """The up interface holding IPv4 ``address``, if any."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return str(name)
    return None


def address_numa_node(address: str, sysfs: str | Path = "/sys") -> int:
    """NUMA node of the NIC a local IPv4 address belongs to; -1 when unknown."""
    nic = nic_of_address(address)
    return -1 if nic is None else nic_numa_node(nic, sysfs)


def gpu_numa_node(device: int, sysfs: str | Path = "/sys") -> tuple[str, int]:
    """(PCI bus id, NUMA node) of CUDA device ``device``; ("", -1) when the
    runtime cannot say."""
    try:
        bus = _native.cuda_pci_bus_id(device)
    except KvlinkError:  # topology is best effort
        return "", -1
    return bus, pci_numa_node(bus, sysfs)
