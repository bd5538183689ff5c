"""cffi build script (API mode) for the C core: ``kvlink._kvlink_c``.

The cdef is csrc/include/kvlink.h itself, minus its preprocessor lines and the
C++ guards, so the header stays the single description of the C API.
"""

from __future__ import annotations

import re
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

# Relative to setup.py: setuptools wants relative source paths.
SOURCES = sorted(
    str(p.relative_to(ROOT)) for p in [*CSRC.glob("*.c"), *CSRC.glob("transport/tcp/*.c")]
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


def cdef_text() -> str:
    """The public header as cffi can parse it."""
    text = (CSRC / "include" / "kvlink.h").read_text()
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


ffibuilder = FFI()
ffibuilder.cdef(cdef_text())
ffibuilder.set_source(
    "kvlink._kvlink_c",
    '#include "kvlink.h"',
    sources=SOURCES,
    include_dirs=[str(CSRC / "include"), str(CSRC)],
    extra_compile_args=CFLAGS,
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
