"""`kvlink-bench`: kvlink's throughput tool.

Subcommands:
  demo       the main job: a 32-layer paged KV cache pushed between two processes
             over 4 loopback paths, every byte verified
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="kvlink-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["demo"], help="what to run")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from . import demo

        return demo.main(rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
