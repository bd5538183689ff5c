"""Which transports this process can use (docs/ucx.md).

UCX is loaded by the C core at run time (``dlopen``), never linked: this module
finds the library (the ``libucx-cu12`` wheel that ``kvlink[ucx]`` installs,
else the system's) and asks the core to load it, once per process.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from . import _native

_HINT = "pip install 'kvlink[ucx]'"


def ucx_library() -> str | None:
    """Path of the ``libucx-cu12`` wheel's libucp, or None (then the loader's
    search path decides, e.g. a system libucx)."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libucp.so.0"
    return str(lib) if lib.is_file() else None


@functools.cache
def ucx_status() -> tuple[bool, str]:
    """(True, "UCX 1.22.0 from PATH") when UCX loads in this process, else
    (False, why, with what to do).  The first call decides for the process."""
    lib = ucx_library()
    ok, detail = _native.ucx_load(lib)
    where = lib or "the loader's search path"
    if ok:
        return True, f"UCX {detail} from {where}"
    if lib is None and "cannot load" in detail:
        detail += f" ({_HINT})"
    return False, detail


def path_transport(requested: str) -> tuple[str, str]:
    """The transport a new data path runs and why, for ``Config.transport``
    ``requested``, where the engine says nothing of its own (``paths()``).

    "ucx": the engine offers UCX on every path and says per path what came of
    it.  Under "auto" and "ucx" a path to another process on this host copies
    process to process ("shm", the engine says so).  "auto" does not offer
    UCX yet: the only UCX here is its TCP
    emulation, which gives a peer write access to the whole process and is
    no faster than kvlink's TCP (docs/ucx.md); "auto" will use UCX where the
    transport enforces key bounds (RDMA, shared memory).  UCX is not loaded
    for "auto" or "tcp": loading libucp makes UCX catch SIGHUP (its
    UCX_DEBUG_SIGNO) and a real-time signal in the whole process.
    """
    if requested == "tcp":
        return "tcp", "transport='tcp'"
    if requested in ("ucx", "fault"):  # the engine says per path what came of it
        return requested, ""
    return "tcp", (
        "transport='auto': TCP to a peer on another host or network namespace (same-host peers "
        "get 'shm'); UCX is not offered: only UCX over TCP is available here, which does not "
        "enforce key bounds (docs/ucx.md); transport='ucx' opts in"
    )
