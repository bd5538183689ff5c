"""cffi build script (API mode) for the C core: ``kvlink._kvlink_c``.

The cdef is csrc/include/kvlink.h itself, minus its preprocessor lines and the
C++ guards, so the header stays the single description of the C API.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

# Relative to setup.py: setuptools wants relative source paths.  Every transport folder
# (csrc/transport/<name>/) is built: a new transport is a folder and a line in registry.c.
SOURCES = sorted(
    str(p.relative_to(ROOT))
    for p in [*CSRC.glob("*.c"), *CSRC.glob("transport/*.c"), *CSRC.glob("transport/*/*.c")]
)

CFLAGS = [
    "-std=gnu11",
    "-O2",
    "-D_GNU_SOURCE",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-format-truncation",  # truncating long messages into fixed buffers is intended
    "-Wno-unused-parameter",  # cffi's generated wrappers have some
]


def ucx_cflags() -> list[str]:
    """Flags that compile csrc/transport/ucx/ against UCX's own headers, or [].

    UCX is found through pkg-config: the libucx-cu12 wheel's .pc files when the
    build environment has that wheel (kvlink[ucx]), else the system's
    (libucx-dev).  Nothing links against UCX: libucp is loaded at run time
    (docs/ucx.md), so without UCX kvlink builds and runs the TCP transport.
    KVLINK_BUILD_UCX=0 builds without UCX even where it is found.
    """
    if os.environ.get("KVLINK_BUILD_UCX") == "0":
        return []
    env = dict(os.environ)
    wheel: Path | None = None
    try:
        import libucx  # type: ignore[import-not-found]

        wheel = Path(libucx.__file__).resolve().parent
        env["PKG_CONFIG_PATH"] = os.pathsep.join(
            p for p in (str(wheel / "lib" / "pkgconfig"), env.get("PKG_CONFIG_PATH", "")) if p
        )
    except ImportError:
        pass
    if not shutil.which("pkg-config"):
        # no pkg-config: the wheel's headers are still where the wheel puts them
        if wheel is not None and (wheel / "include" / "ucp" / "api" / "ucp.h").is_file():
            return ["-DKVL_HAVE_UCX", f"-isystem{wheel / 'include'}"]
        return []
    r = subprocess.run(
        ["pkg-config", "--define-prefix", "--cflags", "ucx"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        return []
    # -isystem: UCX's headers do not build under -Wextra -Werror
    return ["-DKVL_HAVE_UCX"] + [
        f"-isystem{f[2:]}" if f.startswith("-I") else f for f in r.stdout.split()
    ]


def cdef_text() -> str:
    """The public header as cffi can parse it."""
    text = (CSRC / "include" / "kvlink.h").read_text()
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def uring_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) that build csrc/blockio.c on io_uring through liburing,
    or ([], []) when liburing's headers are missing: the store's disk tier then uses a
    thread pool and says so in its log (docs/store.md).  `make` installs liburing-dev
    where it can (tests/sysdeps.py).  KVLINK_BUILD_URING=0 builds without it.

    liburing is linked statically when its archive is there, so the built module needs
    no liburing at run time."""
    if os.environ.get("KVLINK_BUILD_URING") == "0":
        return [], []
    probe = subprocess.run(
        [os.environ.get("CC", "cc"), "-E", "-x", "c", "-", "-o", os.devnull],
        input=b"#include <liburing.h>\n",
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        return [], []
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        if (Path(d) / "liburing.a").is_file():
            return ["-DKVL_HAVE_URING"], [str(Path(d) / "liburing.a")]
    return ["-DKVL_HAVE_URING"], ["-luring"]


URING_CFLAGS, URING_LDFLAGS = uring_flags()

ffibuilder = FFI()
ffibuilder.cdef(cdef_text())
ffibuilder.set_source(
    "kvlink._kvlink_c",
    '#include "kvlink.h"',
    sources=SOURCES,
    include_dirs=[str(CSRC / "include"), str(CSRC)],
    extra_compile_args=CFLAGS + ucx_cflags() + URING_CFLAGS,
    extra_link_args=URING_LDFLAGS,
    libraries=["pthread", "dl"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
