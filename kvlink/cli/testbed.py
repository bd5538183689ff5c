"""``kvlink testbed``: build, inspect, change and use the multi-NIC network testbed.

    kvlink testbed up --links 4 --rate 2gbit [--tag tb] [--subnet-base 0]
    kvlink testbed up --links 3 --rates 2gbit,500mbit,none
    kvlink testbed up --topology "a-b:2x2gbit,a-r:1x8gbit,r-b:2x2gbit" [--tag tb]
    kvlink testbed up --topology relay3        # the preset of the line above
    kvlink testbed status [--tag tb] [--json]
    kvlink testbed set --link 1 (--rate 200mbit | --down | --up) [--tag tb]
    kvlink testbed run --side a [--tag tb] -- iperf3 -c 198.18.0.2
    kvlink testbed run --host r [--tag tb] -- ip -br addr      # any host of a topology
    kvlink testbed down [--tag tb]

Every command reads the testbed's state back from the live namespaces, so no state file is
kept and ``down`` always works. Exit codes: 0 ok, 1 testbed error, 2 usage error, 3 from
``status`` when the testbed is not up; ``run`` returns the command's own exit code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from kvlink.testbed import (
    TOPOLOGY_PRESETS,
    Testbed,
    TestbedError,
    Topology,
    format_rate,
    inspect,
    inspect_topology,
    parse_rate,
    parse_topology,
    teardown,
)

from . import _logging

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_UP = 3  # as `systemctl status` does for an inactive unit


def _rate_arg(text: str) -> int | None:
    """argparse type for one rate; "none" (or "unshaped") means no shaping."""
    if text.strip().lower() in ("none", "unshaped"):
        return None
    try:
        return parse_rate(text, name="rate")
    except TestbedError as exc:
        # argparse already names the option; drop parse_rate's own "rate: " prefix.
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None


def _rates_arg(text: str) -> list[int | None]:
    """argparse type for a comma-separated list of rates."""
    items = text.split(",")
    if any(not item.strip() for item in items):
        raise argparse.ArgumentTypeError(f"empty rate in {text!r}; write e.g. 2gbit,500mbit")
    return [_rate_arg(item) for item in items]


def _topology_arg(text: str) -> str:
    """argparse type for --topology: the spec (or preset name), checked now."""
    try:
        parse_topology(text)
    except TestbedError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _parser(prog: str = "kvlink testbed") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Two network namespaces joined by N rate-limited veth links, or a topology "
        "of more hosts joined pairwise (needs root).",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log every ip/tc command (the same as --log-level debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def tagged(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--tag", default="tb", help="testbed id, 1-8 of [a-z0-9] (default: tb)")
        return p

    up = tagged("up", "create the testbed (or repair it to the given configuration)")
    up.add_argument(
        "--links", type=int, help="number of veth pairs (default: as many as --rates, else 4)"
    )
    shape = up.add_mutually_exclusive_group()
    # SUPPRESS, so that --topology can tell whether --rate was given.
    shape.add_argument(
        "--rate", type=_rate_arg, default=argparse.SUPPRESS,
        help="rate of every link, e.g. 2gbit, 500mbit, or none (default: 2gbit)",
    )  # fmt: skip
    shape.add_argument(
        "--rates", type=_rates_arg,
        help="one rate per link instead of --rate, comma-separated: 2gbit,1gbit,none "
        "(default: none)",
    )  # fmt: skip
    up.add_argument(
        "--subnet-base", type=int, default=0,
        help="third octet of link 0's subnet 198.18.X.0/24 (default: 0)",
    )  # fmt: skip
    presets = ", ".join(f"{name} = {spec}" for name, spec in TOPOLOGY_PRESETS.items())
    up.add_argument(
        "--topology", metavar="SPEC", type=_topology_arg,
        help="hosts joined pairwise instead of --links/--rate/--rates: comma-separated "
        f"X-Y:NxRATE items (RATE none: unshaped), or a preset ({presets}); links are numbered "
        "in the order written, and of a link's two hosts the one that sorts first gets .1 "
        "(default: none, two sides a and b)",
    )  # fmt: skip

    tagged("down", "stop everything in the testbed's namespaces and delete them")

    status = tagged("status", "show namespaces, links, addresses, states and rates")
    status.add_argument("--json", action="store_true", help="print the state as JSON")

    setp = tagged("set", "change one link while the testbed is up")
    setp.add_argument("--link", type=int, required=True, help="link index, from 0")
    change = setp.add_mutually_exclusive_group(required=True)
    # SUPPRESS, not None: argparse would count "--rate none" (parsed to None) as not given.
    change.add_argument(
        "--rate", type=_rate_arg, default=argparse.SUPPRESS,
        help="new rate, or none to remove shaping",
    )  # fmt: skip
    change.add_argument("--down", action="store_true", help="take both ends down")
    change.add_argument("--up", action="store_true", help="bring both ends up")

    run = tagged("run", "run a command inside one side's (or a topology host's) namespace")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--side", choices=("a", "b"), help="the side to run in (default: none; this or --host)"
    )
    where.add_argument(
        "--host", help="the host of a topology to run in, e.g. r (default: none; this or --side)"
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    _logging.add_log_level(parser)
    return parser


def _cmd_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.topology is not None:
        given = [
            flag
            for flag, set_ in (
                ("--links", args.links is not None),
                ("--rate", hasattr(args, "rate")),
                ("--rates", args.rates is not None),
            )
            if set_
        ]
        if given:
            parser.error(
                f"up: --topology gives every link's rate; drop {', '.join(given)} "
                "(write e.g. --topology a-b:4x500mbit)"
            )
        return _cmd_up_topology(args)
    links = args.links if args.links is not None else len(args.rates) if args.rates else 4
    rate = getattr(args, "rate", "2gbit")
    tb = Testbed(
        links=links, rate=rate, rates=args.rates, tag=args.tag, subnet_base=args.subnet_base
    )
    tb.up()
    print(f"testbed {tb.tag!r} up: {tb.namespace('a')} <-> {tb.namespace('b')}, {tb.links} links")
    for i, r in enumerate(tb.rates):
        print(f"  link {i}: {tb.address('a', i)} <-> {tb.address('b', i)}  {r or 'unshaped'}")
    return 0


def _cmd_up_topology(args: argparse.Namespace) -> int:
    topo = Topology(args.topology, tag=args.tag, subnet_base=args.subnet_base)
    topo.up()
    names = ", ".join(topo.namespace(h) for h in topo.hosts)
    print(f"topology {topo.tag!r} up: {names}; {len(topo)} links ({topo.spec})")
    for link in topo.links():
        x, y = link.ends
        print(
            f"  link {link.index}: {x} {link.addrs[x]} <-> {y} {link.addrs[y]}  "
            f"{link.rate or 'unshaped'}"
        )
    return 0


def _is_topology(state: dict[str, Any]) -> bool:
    """Whether inspect_topology's ``state`` needs the topology view (hosts beyond a and b)."""
    return bool(set(state["hosts"]) - {"a", "b"})


def _attach(tag: str) -> Testbed | Topology:
    """The live testbed or topology ``tag``, as the class that describes it best."""
    if _is_topology(inspect_topology(tag)):
        return Topology.attach(tag)
    return Testbed.attach(tag)


def _cmd_down(args: argparse.Namespace) -> int:
    removed = teardown(args.tag)
    print(f"testbed {args.tag!r} {'removed' if removed else 'was not up'}")
    return 0


def _side_text(side: dict[str, Any] | None) -> str:
    if side is None:
        return "(missing)"
    return f"{side['device']} {side['address'] or '(no address)'}"


def _print_rows(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _topology_status(state: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(state, indent=2))
        return 0 if state["up"] else EXIT_NOT_UP
    names = " ".join(host["name"] for host in state["hosts"].values())
    print(f"topology {state['tag']!r}: {'up' if state['up'] else 'not up'}  [{names}]")
    rows: list[tuple[str, ...]] = [("link", "hosts", "end .1", "end .2", "state", "rate")]
    for link in state["links"]:
        ends = [link["hosts"][h] for h in link["ends"]]
        cells = [f"{h} {_side_text(end)}" for h, end in zip(link["ends"], ends, strict=True)]
        cells += ["(missing)"] * (2 - len(cells))
        admin = "up" if ends and all(e["admin_up"] for e in ends) else "down"
        rates = {e["rate"] or "unshaped" for e in ends}
        rows.append(
            (str(link["link"]), "-".join(link["ends"]), *cells, admin, "/".join(sorted(rates)))
        )
    if state["links"]:
        _print_rows(rows)
    return 0 if state["up"] else EXIT_NOT_UP


def _cmd_status(args: argparse.Namespace) -> int:
    topo_state = inspect_topology(args.tag)
    if _is_topology(topo_state):
        return _topology_status(topo_state, args.json)
    state = inspect(args.tag)
    if args.json:
        print(json.dumps(state, indent=2))
        return 0 if state["up"] else EXIT_NOT_UP
    names = " ".join(
        f"{ns['name']}{'' if ns['present'] else ' (missing)'}"
        for ns in state["namespaces"].values()
    )
    print(f"testbed {args.tag!r}: {'up' if state['up'] else 'not up'}  [{names}]")
    if state["links"]:
        rows = [("link", "side a", "side b", "state", "rate")]
        for link in state["links"]:
            a, b = link["a"], link["b"]
            ends = [s for s in (a, b) if s is not None]
            admin = "up" if ends and all(s["admin_up"] for s in ends) else "down"
            rates = {s["rate"] or "unshaped" for s in ends}
            rows.append(
                (str(link["link"]), _side_text(a), _side_text(b), admin, "/".join(sorted(rates)))
            )
        _print_rows(rows)
    return 0 if state["up"] else EXIT_NOT_UP


def _cmd_set(args: argparse.Namespace) -> int:
    tb = _attach(args.tag)
    if args.down:
        tb.link_down(args.link)
        print(f"testbed {args.tag!r}: link {args.link} down")
    elif args.up:
        tb.link_up(args.link)
        print(f"testbed {args.tag!r}: link {args.link} up")
    else:
        tb.set_rate(args.link, args.rate)
        shown = "unshaped" if args.rate is None else format_rate(args.rate)
        print(f"testbed {args.tag!r}: link {args.link} rate {shown}")
    return 0


def _cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("run: give the command after --, e.g. `run --side a -- ip addr`")
    tb = _attach(args.tag)
    proc = subprocess.Popen([*tb.exec_prefix(args.side or args.host), *cmd])
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:  # the child got the same SIGINT; wait for it to finish
            continue
    return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None, prog: str = "kvlink testbed") -> int:
    """Run ``kvlink testbed`` with ``argv`` (default: sys.argv[1:]) and return the exit code."""
    parser = _parser(prog)
    try:
        args = parser.parse_args(argv)
        _logging.setup("debug" if args.verbose else args.log_level, prog)
        if args.command == "up":
            return _cmd_up(args, parser)
        if args.command == "down":
            return _cmd_down(args)
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "set":
            return _cmd_set(args)
        return _cmd_run(args, parser)
    except SystemExit as exc:  # argparse's usage errors and --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except TestbedError as exc:
        print(f"kvlink testbed: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
