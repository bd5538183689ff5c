"""`kvlink`: operational commands.

Commands:
  testbed    build and drive the emulated multi-NIC testbed (root); kvlink testbed --help
  bench      the same as kvlink-bench; kvlink bench --help
  top        a live view of an agent's paths, from its metrics endpoint; kvlink top --help
  paths      an agent's paths once, as a table or JSON; kvlink paths --help
  relay      lend this host's idle NICs to the cluster's relayed paths; kvlink relay --help
  trace      where the last P/D requests' time went, from vLLM servers' metrics; kvlink trace --help
  doctor     what this install and this host have and lack, and what to do; kvlink doctor --help

Every command takes --log-level (debug, info, warning, error): kvlink's log records at that level
and above go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

COMMANDS = ("testbed", "bench", "top", "paths", "relay", "trace", "doctor")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # what was set up is undone on the way out
        print("\nkvlink: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The command's own parser sees everything after its name, --help included, so
    # `kvlink testbed up --help` shows `up`'s help, not this one.
    if argv[:1] == ["testbed"]:
        from . import testbed

        return testbed.main(argv[1:], prog="kvlink testbed")
    if argv[:1] == ["bench"]:
        from . import bench

        return bench.main(argv[1:], prog="kvlink bench")
    if argv[:1] == ["relay"]:
        from . import relay

        return relay.main(argv[1:], prog="kvlink relay")
    if argv[:1] == ["trace"]:
        from . import trace

        return trace.main(argv[1:], prog="kvlink trace")
    if argv[:1] == ["doctor"]:
        from . import doctor

        return doctor.main(argv[1:], prog="kvlink doctor")
    if argv[:1] in (["top"], ["paths"]):
        from . import top

        return top.main(argv[1:], prog=f"kvlink {argv[0]}", command=argv[0])
    parser = argparse.ArgumentParser(
        prog="kvlink", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=COMMANDS, help="the command to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's arguments")
    parser.parse_args(argv)  # only --help, nothing or an unknown command get here
    return 2


if __name__ == "__main__":
    sys.exit(main())
