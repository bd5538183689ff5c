"""The system tools the tests run, the Debian package of each, and installing the missing ones.

`make sysdeps` (which `make test` runs first) runs this file with the system Python: when a tool
is missing and we are root with apt-get, it installs the packages that have them; elsewhere it
says what is missing, and each test that needs a missing tool skips saying so (fails, under
KVLINK_REQUIRE_ALL=1 as in CI). tests/conftest.py's ``require_tool`` and the ``tools`` marker
look tools up here, so what is installed and what is checked cannot drift apart.

Only the standard library: this runs before the virtual environment exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

# tool -> the Debian/Ubuntu packages that provide it (space-separated)
TOOLS: dict[str, str] = {
    "ip": "iproute2",  # network namespaces, veths, addresses (tests/testbed)
    "tc": "iproute2",  # tbf shaping (tests/testbed)
    "iperf3": "iperf3",  # competing traffic and rate checks on the testbed
    "setpriv": "util-linux",  # dropping root in the "not root" test
    # libFuzzer over the frame decoders (make -C tests/c fuzz-short); the runtime is apart
    "clang": "clang libclang-rt-dev",
    # discovery tests start and stop their own etcd servers (tests/integration/test_cluster*.py)
    "etcd": "etcd-server",
    # kvlink-bench's rows name the commit they ran (tests/unit/test_bench_table.py)
    "git": "git",
    # relayed paths seal with OpenSSL's libcrypto, loaded at run time (docs/relays.md); the
    # openssl package pulls in the library under whichever name the release gives it
    "libcrypto": "openssl",
    # the KV store's disk tier submits its I/O through io_uring with liburing, linked into
    # the C core at build time (docs/store.md); without it the store uses a thread pool
    "liburing.h": "liburing-dev",
    # kvlink-bench store's baseline (tests/integration/test_bench_cli.py runs it briefly)
    "fio": "fio",
}
# What building the C core uses when present (installed before the first build, by
# `make`'s venv step): liburing for the store's io_uring.
BUILD_TOOLS = ["liburing.h"]
# the smallest libFuzzer program: clang links it only with the runtime installed
_FUZZ_PROBE = b"int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return 0; }\n"
# Non-root PATHs often lack the sbin directories, where ip and tc live.
_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"


def find_tool(name: str) -> str | None:
    """Path of system tool ``name``, or None when it is not installed (or, for clang, when
    it cannot link a libFuzzer program: the compiler and its runtime are separate packages)."""
    if name.endswith(".h"):  # a C header the build includes
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            return None
        probe = subprocess.run(
            [cc, "-E", "-x", "c", "-", "-o", os.devnull],
            input=f"#include <{name}>\n".encode(),
            capture_output=True,
            check=False,
        )
        return f"/usr/include/{name}" if probe.returncode == 0 else None
    if name.startswith("lib"):  # a shared library, not a program
        import ctypes.util

        return ctypes.util.find_library(name[3:])
    path = shutil.which(name) or shutil.which(name, path=_SBIN)
    if path is not None and name == "clang":
        probe = subprocess.run(
            [path, "-fsanitize=fuzzer,address,undefined", "-x", "c", "-", "-o", os.devnull],
            input=_FUZZ_PROBE,
            capture_output=True,
            check=False,
        )
        if probe.returncode != 0:
            return None
    return path


def missing() -> list[str]:
    """The tools of TOOLS that are not installed."""
    return [name for name in TOOLS if find_tool(name) is None]


def _packages(names: list[str]) -> list[str]:
    return sorted({pkg for n in names for pkg in TOOLS[n].split()})


def install_hint(names: list[str]) -> str:
    """What a user runs to get ``names``."""
    packages = " ".join(_packages(names))
    return f"run `make sysdeps` as root, or `apt-get install -y {packages}`"


def ensure_build_deps() -> None:
    """Installs what the C core's build uses when present (BUILD_TOOLS), where we can;
    never fails: without them kvlink builds without those features and says so."""
    gone = [n for n in BUILD_TOOLS if find_tool(n) is None]
    apt = shutil.which("apt-get")
    if not gone or os.geteuid() != 0 or apt is None:
        if gone:
            print(
                f"sysdeps: {', '.join(gone)} missing: the store's disk tier will use a thread "
                f"pool instead of io_uring. To install: {install_hint(gone)}",
                file=sys.stderr,
            )
        return
    packages = _packages(gone)
    print(f"sysdeps: installing {' '.join(packages)} (for the build)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    argv = [apt, "install", "-y", "-qq", "--no-install-recommends", *packages]
    if subprocess.run(argv, env=env, check=False).returncode != 0:
        subprocess.run([apt, "update", "-qq"], env=env, check=False)
        subprocess.run(argv, env=env, check=False)


def ensure_venv() -> int:
    """`python3 -m venv` needs ensurepip, which Debian ships apart (python3-venv): install it
    where we can, so `make` works on a machine with only Python, a C compiler and make.
    Returns non-zero, saying what to install, when venv cannot work."""
    try:
        import ensurepip  # noqa: F401
        import venv  # noqa: F401

        return 0
    except ImportError:
        pass
    apt = shutil.which("apt-get")
    version = f"python3.{sys.version_info.minor}-venv"
    if os.geteuid() == 0 and apt is not None:
        print(f"sysdeps: installing python3-venv {version} (for `python3 -m venv`)", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run([apt, "update", "-qq"], env=env, check=False)
        for pkgs in (["python3-venv", version], ["python3-venv"]):
            argv = [apt, "install", "-y", "-qq", "--no-install-recommends", *pkgs]
            if subprocess.run(argv, env=env, check=False).returncode == 0:
                return 0
    print(
        f"sysdeps: `python3 -m venv` does not work here (no ensurepip); install python3-venv "
        f"(`apt-get install -y python3-venv {version}` as root) and run make again",
        file=sys.stderr,
    )
    return 1


def main() -> int:
    """Install what is missing where we can; otherwise say what the tests will skip.

    Never fails the build: a tool that stays missing makes the tests that need it skip with
    the reason, or fail under KVLINK_REQUIRE_ALL=1.
    """
    gone = missing()
    if not gone:
        return 0
    packages = _packages(gone)
    apt = shutil.which("apt-get")
    if os.geteuid() == 0 and apt is not None:
        print(f"sysdeps: installing {' '.join(packages)} (for {', '.join(gone)})", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (
            [apt, "update", "-qq"],
            [apt, "install", "-y", "-qq", "--no-install-recommends", *packages],
        ):
            if subprocess.run(argv, env=env, check=False).returncode != 0:
                print(f"sysdeps: `{' '.join(argv)}` failed", file=sys.stderr)
                break
        gone = missing()
        if not gone:
            return 0
    why = "not root or no apt-get" if apt is None or os.geteuid() != 0 else "install failed"
    print(
        f"sysdeps: {', '.join(gone)} not installed ({why}); the tests that need them will "
        f"skip (fail under KVLINK_REQUIRE_ALL=1). To install: {install_hint(gone)}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--venv"]:
        ensure_build_deps()
        sys.exit(ensure_venv())
    sys.exit(main())
