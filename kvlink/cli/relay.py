"""`kvlink relay`: a relay daemon for a host that runs no engine (docs/relays.md).

It is a kvlink agent that only relays: it lends the NICs it is given to relayed paths of the
cluster's agents (members only: it needs the cluster secret, KVLINK_SECRET or
KVLINK_SECRET_FILE), takes a NIC back while this host's own traffic needs it, and publishes its
metadata for the agents that route through it: to a file (--metadata-out, for Config(relays=
[path]) or add_relay), and to etcd with --discovery.  It runs until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

import kvlink

from . import _logging


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--name",
        default=f"relay-{os.uname().nodename}",
        help="the relay's agent name, unique in the cluster (default: relay-HOST)",
    )
    p.add_argument(
        "--nics",
        default="auto",
        help="the NICs it lends: 'auto', or names / IPv4 addresses, comma-separated",
    )
    p.add_argument("--port", type=int, default=0, help="relay port on each NIC (0: ephemeral)")
    p.add_argument(
        "--yield-mbps",
        type=int,
        default=100,
        help="this host's own traffic on a lent NIC above this takes it back "
        "(0: never; default 100)",
    )
    p.add_argument("--max-conns", type=int, default=128,
                   help="relayed connections at once (six descriptors each; default 128)")
    p.add_argument(
        "--metadata-out",
        metavar="FILE",
        help="write the relay's metadata here (atomically) for the agents to use",
    )
    p.add_argument(
        "--discovery", metavar="URL", help="etcd://HOST:PORT[/PREFIX]: publish the relay there too"
    )
    p.add_argument(
        "--stats-every",
        type=float,
        default=0.0,
        metavar="S",
        help="print the relay's counters every S seconds (0: never)",
    )
    # a daemon: what it refuses and what it gives back is worth a line (docs/security.md)
    _logging.add_log_level(p, default="info")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "kvlink relay") -> int:
    args = _parser(prog).parse_args(argv)
    _logging.setup(args.log_level, prog)
    try:
        cfg = kvlink.Config.load(
            nics=args.nics,
            relay=True,
            relay_port=args.port,
            relay_yield_mbps=args.yield_mbps,
            relay_max_conns=args.max_conns,
            accept_relayed=False,
            discovery=args.discovery,
        )
        agent = kvlink.Agent(args.name, cfg)
    except kvlink.KvlinkError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        md = agent.metadata()
        if args.metadata_out:
            d = os.path.dirname(os.path.abspath(args.metadata_out))
            with tempfile.NamedTemporaryFile("wb", dir=d, delete=False) as f:
                f.write(md)
            os.replace(f.name, args.metadata_out)
        print(md.decode(), flush=True)
        print(
            f"{prog}: '{args.name}' relays on " + ", ".join(f"{h}" for h, _ in agent.addresses),
            file=sys.stderr,
            flush=True,
        )
        next_stats = time.monotonic() + args.stats_every
        while not stop.wait(0.2):
            if args.stats_every and time.monotonic() >= next_stats:
                next_stats += args.stats_every
                print(agent.relay_stats(), file=sys.stderr, flush=True)
    finally:
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
