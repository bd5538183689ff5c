"""`kvlink`: operational commands.

Subcommands:
  testbed    build and drive the emulated multi-NIC testbed (root)
  bench      the same as kvlink-bench
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="kvlink", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["testbed", "bench"])
    args, rest = parser.parse_known_args(argv)
    if args.command == "testbed":
        from . import testbed

        return testbed.main(rest)
    from . import bench

    return bench.main(rest)


if __name__ == "__main__":
    sys.exit(main())
