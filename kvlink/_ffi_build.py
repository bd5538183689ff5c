"""cffi build script (API mode) for the C core: ``kvlink._kvlink_c``.

The cdef is csrc/include/kvlink.h itself, minus its preprocessor lines and the
C++ guards, so the header stays the single description of the C API.  One function
more, ``kvl_py_build_info``, carries what this build compiled (its optional parts,
the compiler, the flags) as JSON into the module, for ``kvlink doctor``.

Users' builds (``pip install`` of the sdist) compile without ``-Werror``: a newer
compiler's new warning must not stop an install.  The project's own builds (``make
build``, ``make wheel``, CI) set ``KVLINK_WERROR=1``.  The build says on stderr which
optional parts it compiled and how to get the missing ones; a missing compiler or
missing Python headers stop it with a message saying what to install.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
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
    "-Wno-format-truncation",  # truncating long messages into fixed buffers is intended
    "-Wno-unused-parameter",  # cffi's generated wrappers have some
]
if os.environ.get("KVLINK_WERROR") == "1":  # the project's own builds, not users'
    CFLAGS.append("-Werror")


def _stop(message: str) -> None:
    """Ends the build with ``message`` (what is missing, what to do), not a traceback."""
    print(f"\nkvlink: cannot build the C core: {message}\n", file=sys.stderr)
    raise SystemExit(1)


def compiler() -> list[str]:
    """The C compiler setuptools will run (``CC``, else the one Python was built with,
    else ``cc``), as argv; stops the build with what to install when it is missing."""
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        fallback = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
        if fallback is None or os.environ.get("CC"):
            looked = [cc[0] if cc else "cc"]
            if not os.environ.get("CC"):
                looked += [c for c in ("cc", "gcc", "clang") if c not in looked]
            _stop(
                f"no C compiler found (looked for {', '.join(looked)}). Install one "
                "(Debian/Ubuntu: apt-get install gcc; Fedora/RHEL: dnf install gcc), or set "
                "CC, or install a prebuilt kvlink wheel instead of the sdist."
            )
        cc = [str(fallback)]
        os.environ["CC"] = str(fallback)  # setuptools compiles with it too
    return cc


def check_python_headers() -> None:
    """Stops the build with what to install when Python.h is missing."""
    inc = Path(sysconfig.get_paths()["include"])
    if not (inc / "Python.h").is_file():
        _stop(
            f"Python's C headers are missing ({inc / 'Python.h'} not found). Install them "
            f"(Debian/Ubuntu: apt-get install python3-dev; Fedora/RHEL: dnf install "
            f"python3-devel) for {sys.executable}, or install a prebuilt kvlink wheel."
        )


UCX_MISSING = (
    "UCX headers not found: the UCX transport (RDMA, GPUDirect) is left out. To build it in, "
    "install UCX where the build sees it (pip install libucx-cu12 into the build environment "
    "and build with --no-build-isolation, or apt-get install libucx-dev) and reinstall kvlink"
)
URING_MISSING = (
    "liburing headers not found: the store's disk tier will use a thread pool instead of "
    "io_uring. To build it in, apt-get install liburing-dev (dnf install liburing-devel) "
    "and reinstall kvlink"
)


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
        [*CC, "-E", "-x", "c", "-", "-o", os.devnull],
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


def version() -> str:
    """kvlink's version, from kvlink/__init__.py (pyproject.toml carries the same)."""
    m = re.search(r'^__version__ = "([^"]+)"', (ROOT / "kvlink" / "__init__.py").read_text(), re.M)
    return m.group(1) if m else "unknown"


def compiler_version() -> str:
    r = subprocess.run([*CC, "--version"], capture_output=True, text=True, check=False)
    return (r.stdout.splitlines() or ["unknown"])[0].strip()


def _left_out(part: str, missing: str) -> str:
    """Why part ("UCX", "URING") is not compiled in: asked (KVLINK_BUILD_<part>=0) or not found."""
    if os.environ.get(f"KVLINK_BUILD_{part}") == "0":
        return (f"left out on request (KVLINK_BUILD_{part}=0); unset it and reinstall to "
                "compile it in")
    return missing


def build_info() -> dict[str, object]:
    """What this build compiled, as kvlink doctor shows it."""
    return {
        "version": version(),
        "ucx": bool(UCX_CFLAGS),
        "ucx_missing": "" if UCX_CFLAGS else _left_out("UCX", UCX_MISSING),
        "io_uring": bool(URING_CFLAGS),
        "io_uring_missing": "" if URING_CFLAGS else _left_out("URING", URING_MISSING),
        "compiler": compiler_version(),
        "werror": "-Werror" in CFLAGS,
    }


def report(info: dict[str, object]) -> None:
    """Says on stderr which optional parts this build compiled and how to get the others."""
    print(f"kvlink {info['version']}: building the C core with {info['compiler']}",
          file=sys.stderr)
    for part, name in (("ucx", "UCX transport"), ("io_uring", "io_uring disk I/O")):
        if info[part]:
            print(f"kvlink: {name}: compiled in", file=sys.stderr)
        else:
            print(f"kvlink: {name}: NOT compiled in: {info[part + '_missing']}", file=sys.stderr)


check_python_headers()
CC = compiler()
UCX_CFLAGS = ucx_cflags()
URING_CFLAGS, URING_LDFLAGS = uring_flags()
BUILD_INFO = build_info()
report(BUILD_INFO)

# kvl_py_build_info's body: the JSON as a C string literal (json.dumps escapes what C needs
# escaped too, all of it ASCII)
_BUILD_INFO_C = (
    "static const char *kvl_py_build_info(void) { return "
    + json.dumps(json.dumps(BUILD_INFO, sort_keys=True))
    + "; }"
)

ffibuilder = FFI()
ffibuilder.cdef(cdef_text())
ffibuilder.cdef("const char *kvl_py_build_info(void);")
ffibuilder.set_source(
    "kvlink._kvlink_c",
    '#include "kvlink.h"\n' + _BUILD_INFO_C,
    sources=SOURCES,
    include_dirs=[str(CSRC / "include"), str(CSRC)],
    extra_compile_args=CFLAGS + UCX_CFLAGS + URING_CFLAGS,
    extra_link_args=URING_LDFLAGS,
    libraries=["pthread", "dl"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
