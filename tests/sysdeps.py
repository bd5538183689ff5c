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

# tool -> the Debian/Ubuntu package that provides it
TOOLS: dict[str, str] = {
    "ip": "iproute2",  # network namespaces, veths, addresses (tests/testbed)
    "tc": "iproute2",  # tbf shaping (tests/testbed)
    "iperf3": "iperf3",  # competing traffic and rate checks on the testbed
    "setpriv": "util-linux",  # dropping root in the "not root" test
}
# Non-root PATHs often lack the sbin directories, where ip and tc live.
_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"


def find_tool(name: str) -> str | None:
    """Path of system tool ``name``, or None when it is not installed."""
    return shutil.which(name) or shutil.which(name, path=_SBIN)


def missing() -> list[str]:
    """The tools of TOOLS that are not installed."""
    return [name for name in TOOLS if find_tool(name) is None]


def install_hint(names: list[str]) -> str:
    """What a user runs to get ``names``."""
    packages = " ".join(sorted({TOOLS[n] for n in names}))
    return f"run `make sysdeps` as root, or `apt-get install -y {packages}`"


def main() -> int:
    """Install what is missing where we can; otherwise say what the tests will skip.

    Never fails the build: a tool that stays missing makes the tests that need it skip with
    the reason, or fail under KVLINK_REQUIRE_ALL=1.
    """
    gone = missing()
    if not gone:
        return 0
    packages = sorted({TOOLS[n] for n in gone})
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
    sys.exit(main())
