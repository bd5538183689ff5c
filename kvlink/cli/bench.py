"""kvlink-bench: kvlink's throughput tool.

Subcommands:
  demo       the main job: a 32-layer paged KV cache pushed between two processes
             over 4 loopback paths, every byte verified, beside baselines taken in the
             same run (iperf3 on the same paths, memcpy on this machine)
  loopback   serve + run as two processes on this machine over N loopback paths
  tcp-limit  kvlink's TCP data path over N loopback paths against plain TCP (N
             connections, a native thread each side, no framing, no crc) in the same run
  testbed    the same across the emulated multi-NIC testbed (root; reuses testbed
             --tag as it is if it is up, else builds it and removes it afterwards)
  serve      the target side on this host (prints its bootstrap endpoint)
  run        the initiator side: connects to a serve endpoint and measures
  table      today's figures as one markdown table, from the JSON lines of runs
             (docs/BENCHMARKS.md is written by it)

Every throughput (gbps in JSON, "GB/s" in tables) is GB/s: 1e9 bytes per second.
Every result is measured against a limit taken in the same run (iperf3 on the
same paths) when --compare includes iperf3 (the default for loopback/testbed).

Examples:
  kvlink-bench loopback --paths 4 --size 16MiB,256MiB,1GiB --iters 5
  kvlink-bench testbed --links 4 --rate 2gbit --size 20MB,1GiB --json
  kvlink-bench tcp-limit --paths 4 --size 1GiB --iters 5 --io-threads auto
  kvlink-bench loopback --size 16MiB --concurrency 64 --op pull
  kvlink-bench serve --nics eth2,eth3 --size 4GiB --bootstrap 0.0.0.0:18515
  kvlink-bench run --connect host:18515 --nics eth2,eth3 --size 1GiB
  kvlink-bench table docs/data/benchmarks-current.jsonl run.jsonl --write docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._nics import MAX_PATHS
from .._units import parse_size
from ..bench import iperf3, measure, share_run_secret
from ..bench.protocol import WorkerError
from ..bench.report import Reporter, plot_unavailable, run_info
from ..bench.runner import RunSpec
from . import _logging

PEERS = ("iperf3", "mooncake", "nixl", "ucxx")
# What a run measures when a flag is not given: (normal, --quick). --quick changes only the
# flags that were not given explicitly.
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "size": ([1 << 30], [16 << 20]),
    "chunk": ([0], [0]),
    "iters": (5, 2),
    "warmup": (1, 1),
    "paths": (4, 2),
}


class UsageError(Exception):
    """A flag's value is out of range; the message names the flag and what is allowed."""


def _size(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return n


def _items(text: str, example: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    if not any(items) or not all(items):
        raise argparse.ArgumentTypeError(f"{text!r}: an empty item; write e.g. {example}")
    return items


def size_list(text: str) -> list[int]:
    return [_size(t) for t in _items(text, "16MiB,1GiB")]


CHUNK_MIN, CHUNK_MAX = 4096, 1 << 30  # Config.chunk_bytes' range


def chunk_list(text: str) -> list[int]:
    out = []
    for t in _items(text, "auto,4MiB"):
        n = 0 if t == "auto" else _size(t)
        if n and not CHUNK_MIN <= n <= CHUNK_MAX:
            raise argparse.ArgumentTypeError(f"{t!r}: a chunk must be 4KiB..1GiB (or auto)")
        out.append(n)
    return out


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """argparse type: an int in [lo, hi], with an error that says the range."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if n < lo or (hi is not None and n > hi):
            what = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"{n} is out of range: must be {what}")
        return n

    parse.__name__ = "int"  # how argparse names the type in "invalid int value"
    return parse


def io_threads_arg(text: str) -> str:
    """argparse type: Config.io_threads as text, "auto" or 0..64."""
    if text.strip().lower() == "auto":
        return "auto"
    return str(int_range(0, 64)(text))


def _show(name: str, value: Any) -> str:
    if name == "size":
        return ",".join(measure.fmt_size(x) for x in value)
    if name == "chunk":
        return ",".join(measure.chunk_label(x) for x in value)
    return str(value)


def _quick_note(name: str) -> str:
    normal, quick = DEFAULTS[name]
    return f"(default: {_show(name, normal)}; with --quick: {_show(name, quick)})"


def common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--size", type=size_list, default=None, metavar="SIZES",
        help=f"transfer sizes to sweep, comma-separated (16MiB,1GiB) {_quick_note('size')}",
    )  # fmt: skip
    p.add_argument(
        "--chunk", type=chunk_list, default=None, metavar="CHUNKS",
        help="exact chunk sizes to sweep (auto,4MiB,64MiB); auto is the planner's own choice "
        f"{_quick_note('chunk')}",
    )  # fmt: skip
    p.add_argument(
        "--op",
        choices=["push", "pull"],
        default="push",
        help="push (write to the far side) or pull (read from it) (default: push)",
    )
    p.add_argument(
        "--mem",
        choices=["host", "cuda"],
        default="host",
        help="memory to move (default: host; cuda: CuPy buffers on GPU 0, loopback only)",
    )
    p.add_argument(
        "--iters",
        type=int_range(1),
        default=None,
        help=f"timed transfers per configuration {_quick_note('iters')}",
    )
    p.add_argument(
        "--warmup",
        type=int_range(0),
        default=None,
        help=f"untimed transfers before them {_quick_note('warmup')}",
    )
    p.add_argument(
        "--concurrency",
        type=int_range(1),
        default=1,
        help="transfers in flight at once (default: 1)",
    )
    p.add_argument("--layers", type=int_range(1), default=1,
                   help="split each transfer into this many layers; >1 measures the time to "
                   "the first layer (default: 1)")  # fmt: skip
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the byte check after each configuration (default: check)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per result line, gbps in GB/s (default: a table)",
    )
    p.add_argument(
        "--csv",
        metavar="FILE",
        default=None,
        help="also write the results as CSV, gbps in GB/s (default: none)",
    )
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also plot GB/s vs size (or chunk size); needs the plot extra: "
                   "pip install kvlink[plot] (default: none)")  # fmt: skip
    p.add_argument("--compare", default="iperf3",
                   help="tools measured beside kvlink, comma-separated: iperf3, mooncake, "
                   "nixl, ucxx, or none (default: iperf3)")  # fmt: skip
    p.add_argument(
        "--peers-dir", metavar="DIR", default=None,
        help="bench/peers of a kvlink checkout, with the peers installed by its setup.sh "
        "(default: $KVLINK_PEERS_DIR, else found from the checkout or the current directory)",
    )  # fmt: skip
    p.add_argument(
        "--scenario", metavar="NAME", default=None,
        help="the name of this run's rows in --json (their `scenario`, for kvlink-bench "
        "table); a sweep adds each row's size and chunk, a peer its name (default: made from "
        "the command, transport, op, size and paths)",
    )  # fmt: skip
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run for smoke tests: changes the defaults of --size, --chunk, "
        "--iters and --warmup (and --paths for loopback), never a flag given explicitly "
        "(default: off)",
    )


def build_parser(prog: str = "kvlink-bench") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("demo", help="the main job (see kvlink-bench demo --help)", add_help=False)
    lo = sub.add_parser("loopback", help="two processes on this machine",
                        description="kvlink between two processes over N loopback paths; "
                        "throughput in GB/s (1e9 bytes/s).")  # fmt: skip
    lo.add_argument(
        "--paths",
        type=int_range(1, MAX_PATHS),
        default=None,
        help=f"loopback paths, 1 to {MAX_PATHS} {_quick_note('paths')}",
    )
    common(lo)
    tl = sub.add_parser("tcp-limit", help="kvlink's TCP data path against plain TCP",
                        description="kvlink (KVLINK_TRANSPORT=tcp) between two processes over N "
                        "loopback paths against the tcp-limit baseline: N TCP connections "
                        "between the same two processes, one native thread each side moving "
                        "its own slice of the same memory, no framing, no crc. Rounds "
                        "alternate the two; each kvlink row has its round's baseline as its "
                        "limit; CPU is both processes' (cpu_s, cpu_s_per_gib). Throughput in "
                        "GB/s (1e9 bytes/s).")  # fmt: skip
    tl.add_argument("--paths", type=int_range(1, MAX_PATHS), default=None,
                    help=f"loopback paths and baseline connections, 1 to {MAX_PATHS} "
                    f"{_quick_note('paths')}")  # fmt: skip
    tl.add_argument("--size", type=size_list, default=None, metavar="SIZES",
                    help=f"bytes each move carries, comma-separated {_quick_note('size')}")
    tl.add_argument("--iters", type=int_range(1), default=None,
                    help=f"timed rounds per size, each one baseline move and one kvlink push "
                    f"{_quick_note('iters')}")  # fmt: skip
    tl.add_argument("--warmup", type=int_range(0), default=None,
                    help=f"untimed rounds before them {_quick_note('warmup')}")
    tl.add_argument("--io-threads", type=io_threads_arg, default=None, metavar="N",
                    help="kvlink's Config.io_threads on both sides: auto or a count "
                    "(default: KVLINK_IO_THREADS, else auto)")  # fmt: skip
    tl.add_argument("--no-verify", action="store_true",
                    help="skip the byte check after each move (default: check)")
    tl.add_argument("--json", action="store_true",
                    help="one JSON object per result line, gbps in GB/s (default: a table)")
    tl.add_argument("--csv", metavar="FILE", default=None,
                    help="also write the results as CSV (default: none)")
    tl.add_argument("--quick", action="store_true",
                    help="a tiny run for smoke tests: changes the defaults of --size, --iters, "
                    "--warmup and --paths, never a flag given explicitly (default: off)")
    tb = sub.add_parser(
        "testbed", help="across the emulated multi-NIC testbed (root)",
        description="kvlink across the emulated multi-NIC testbed (root); throughput in GB/s "
        "(1e9 bytes/s). "
        "If testbed --tag is up it is used as it is and left up; else one is built from "
        "--links/--rate/--rates/--subnet-base and removed afterwards.",
    )  # fmt: skip
    tb.add_argument("--links", type=int_range(1, MAX_PATHS), default=None,
                    help=f"links of a testbed built for the run, 1 to {MAX_PATHS} "
                    "(default: 4, or as many as --rates)")  # fmt: skip
    tb.add_argument("--rate", default=None,
                    help="rate of every link of a testbed built for the run, in tc spelling "
                    "(default: 2gbit)")  # fmt: skip
    tb.add_argument("--rates", default=None,
                    help="per-link rates instead of --rate, e.g. 2gbit,2gbit,1gbit,500mbit "
                    "(default: not given: every link at --rate)")  # fmt: skip
    tb.add_argument("--subnet-base", type=int_range(0, 511), default=None,
                    help="third octet of link 0's subnet 198.18.X.0/24 of a testbed built for "
                    "the run (default: 0)")  # fmt: skip
    tb.add_argument(
        "--tag",
        default="tb",
        help="testbed tag: reused as it is if it is up, as `kvlink testbed up` leaves it "
        "(default: tb)",
    )
    common(tb)
    sv = sub.add_parser("serve", help="the target side",
                        description="The target side: registers --size bytes and serves "
                        "`kvlink-bench run` on --bootstrap until it says exit.")  # fmt: skip
    sv.add_argument("--nics", default="auto",
                    help="NICs: auto, loopback:N or names/addresses, comma-separated "
                    "(default: auto)")  # fmt: skip
    sv.add_argument("--size", type=_size, default=1 << 30,
                    help="bytes to register: the largest run --size x --concurrency "
                    "(default: 1GiB)")  # fmt: skip
    sv.add_argument(
        "--bootstrap",
        default="0.0.0.0:18515",
        help="host:port for run to reach (default: 0.0.0.0:18515)",
    )
    rn = sub.add_parser("run", help="the initiator side",
                        description="The initiator side: connects to `kvlink-bench serve` and "
                        "measures; throughput in GB/s (1e9 bytes/s).")  # fmt: skip
    rn.add_argument(
        "--connect",
        required=True,
        help="serve's bootstrap host:port, as serve prints it (required)",
    )
    rn.add_argument("--nics", default="auto",
                    help="NICs: auto, loopback:N or names/addresses, comma-separated "
                    "(default: auto)")  # fmt: skip
    common(rn)
    tt = sub.add_parser(
        "table", help="today's figures as one markdown table, from JSON lines",
        description="One markdown table row per scenario, from JSON lines (kvlink-bench "
        "--json output, docs/data/benchmarks-current.jsonl): scenario, the ratio against its "
        "baseline, the baseline, target, date and commit, and the command. Rows without a "
        "scenario are skipped; of rows naming the same scenario the last one read wins, in "
        "the place of the first.",
    )  # fmt: skip
    tt.add_argument("files", nargs="+", metavar="RESULTS.jsonl",
                    help="JSON-lines files, read in order")  # fmt: skip
    tt.add_argument(
        "--write", metavar="FILE.md", default=None,
        help="replace the table between the lines <!-- kvlink-bench table: begin --> and "
        "<!-- kvlink-bench table: end --> of FILE.md, keeping the rest of it as it is "
        "(default: print the table)",
    )  # fmt: skip
    so = sub.add_parser(
        "store", help="kvlink.store's tiers against fio and memcpy",
        description="kvlink.store's disk tier (write-back, read-up) against fio (O_DIRECT, "
        "1 MiB, iodepth 32) on the same directory, its host tier into an engine layout against "
        "memcpy, and lookup and load latency; every block checked. Throughput in GB/s.",
    )  # fmt: skip
    so.add_argument("--dir", default=None,
                    help="a directory on the disk to measure (default: the temp directory)")
    so.add_argument("--size", type=_size, default=1 << 30,
                    help="bytes of blocks moved each way (default: 1GiB)")
    so.add_argument("--block", type=_size, default=1 << 20,
                    help="bytes of one block, all layers (default: 1MiB)")
    so.add_argument("--layers", type=int_range(1, 1024), default=32,
                    help="layers a block spreads over in the engine layout (default: 32)")
    so.add_argument("--iters", type=int_range(1), default=3, help="rounds (default: 3)")
    so.add_argument("--json", action="store_true", help="one JSON object per row")
    _logging.add_log_level(ap)
    return ap


def cmd_store(args: argparse.Namespace) -> int:
    from ..bench import store

    if shutil.which("fio") is None:
        print("kvlink-bench store: fio is not installed (apt-get install fio): it is the "
              "baseline", file=sys.stderr)  # fmt: skip
        return 2
    for row in store.run(args.dir, args.size, args.block, args.layers, args.iters,
                         lambda s: print(s, file=sys.stderr)):  # fmt: skip
        print(json.dumps(row) if args.json else
              "  ".join(f"{k}={v}" for k, v in row.items()))  # fmt: skip
    return 0


def cmd_table(args: argparse.Namespace) -> int:
    from ..bench import table

    try:
        text = table.render(rows := table.load(args.files))
        if args.write is None:
            sys.stdout.write(text)
            return 0
        table.write(args.write, text)
    except table.TableError as exc:
        print(f"kvlink-bench table: {exc}", file=sys.stderr)
        return 2
    print(f"kvlink-bench table: {len(rows)} rows written to {args.write}")
    return 0


def scenario_name(args: argparse.Namespace, row: dict[str, Any]) -> str:
    """A result row's `scenario`: --scenario, or one made from how it was measured."""
    size = measure.fmt_size(row["size_bytes"])
    chunk = f", chunk {measure.chunk_label(row['chunk_bytes'])}" if row.get("chunk_bytes") else ""
    if args.scenario:
        sweep = len(args.size) > 1 or len(args.chunk) > 1
        name = args.scenario + (f" ({size}{chunk})" if sweep else "")
    else:
        over = "/".join(row.get("transports") or [])
        paths = row.get("paths") or 0
        name = (f"{args.command}{' ' + over if over else ''} {row.get('op', 'push')} {size}"
                f"{chunk}, {paths} path{'s' if paths != 1 else ''}")  # fmt: skip
        if row.get("concurrency", 1) > 1:
            name += f", {row['concurrency']} at once"
        if row.get("layers", 1) > 1:
            name += f", {row['layers']} layers"
        if args.mem != "host":
            name += f", {args.mem} memory"
    return name if row["tool"] == "kvlink" else f"{name} [{row['tool']}]"


def resolve(args: argparse.Namespace) -> None:
    """Fills the flags not given: the --quick defaults with --quick, else the normal ones."""
    for name, (normal, quick) in DEFAULTS.items():
        if hasattr(args, name) and getattr(args, name) is None:
            setattr(args, name, quick if args.quick else normal)


# ---- limits (iperf3 on the same paths) --------------------------------------


def iperf3_gbps(streams: list[iperf3.Stream]) -> float | None:
    """Aggregate GB/s of the streams, all at once; None without iperf3."""
    if not iperf3.available():
        return None
    return iperf3.aggregate_gbps(iperf3.run(streams))


def spec_from(args: argparse.Namespace) -> RunSpec:
    return RunSpec(
        sizes=args.size,
        chunks=args.chunk,
        op=args.op,
        iters=args.iters,
        warmup=args.warmup,
        concurrency=args.concurrency,
        layers=args.layers,
        verify=not args.no_verify,
    )


def check_args(args: argparse.Namespace) -> str | None:
    if args.command == "tcp-limit":
        return None
    if args.mem == "cuda" and args.command != "loopback":
        return (
            f"--mem cuda: GPU memory is measured by `kvlink-bench loopback --mem cuda` (both "
            f"agents on this host's GPU); `{args.command}` moves host memory only"
        )
    if args.mem == "cuda":
        from ..bench import gpu

        why = gpu.unavailable()
        if why:
            return why
    bad = [p for p in args.compare.split(",") if p and p != "none" and p not in PEERS]
    if bad:
        return f"--compare: unknown {bad}; choose from {','.join(PEERS)} or none"
    libs = [p for p in args.compare.split(",") if p in ("mooncake", "nixl", "ucxx")]
    if args.command == "run" and libs:
        return (
            f"--compare {','.join(libs)}: peer libraries are compared by `kvlink-bench loopback` "
            "and `kvlink-bench testbed`; between two hosts run each library's own tool"
        )
    if args.command == "testbed" and args.rate is not None and args.rates is not None:
        return "--rate and --rates: give one (--rates sets each link's rate)"
    if args.plot and (why := plot_unavailable()):
        return why
    return None


def check_environment() -> str | None:
    """KVLINK_* settings apply to every agent the tool makes: refuse bad ones up front."""
    from .._config import Config
    from .._errors import ConfigError

    try:
        Config.load()
    except ConfigError as exc:
        return str(exc)
    return None


def _child_env() -> dict[str, str]:
    """A child's environment: this one (the run's secret included), without the warnings
    this process has shown already."""
    return {**os.environ, "PYTHONWARNINGS": "ignore::UserWarning"}


def _child_failed(proc: subprocess.Popen[str], what: str) -> RuntimeError:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    err = proc.stderr.read() if proc.stderr else ""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    why = lines[-1] if lines else f"exit code {proc.returncode}"
    return RuntimeError(f"{what} failed: {why}")


@contextlib.contextmanager
def spawn_serve(prefix: list[str], nics: str, nbytes: int, host: str) -> Iterator[str]:
    """`kvlink-bench serve` in a child process; yields its bootstrap endpoint."""
    cmd = [*prefix, sys.executable, "-m", "kvlink.cli.bench", "serve", "--nics", nics,
           "--size", str(nbytes), "--bootstrap", f"{host}:0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_child_env())  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("endpoint "):
            raise _child_failed(proc, "kvlink-bench serve")
        yield line.split()[1]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_remote(
    prefix: list[str], endpoint: str, nics: str, args: argparse.Namespace, rep: Reporter
) -> list[dict[str, Any]]:
    """`kvlink-bench run --json` in a child process (inside a namespace)."""
    import json

    argv = [
        *prefix, sys.executable, "-m", "kvlink.cli.bench", "run", "--connect", endpoint,
        "--nics", nics, "--json", "--compare", "none",
        "--size", ",".join(map(str, args.size)),
        "--chunk", ",".join("auto" if c == 0 else str(c) for c in args.chunk),
        "--op", args.op, "--iters", str(args.iters), "--warmup", str(args.warmup),
        "--concurrency", str(args.concurrency), "--layers", str(args.layers),
    ]  # fmt: skip
    if args.no_verify:
        argv.append("--no-verify")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_child_env())  # fmt: skip
    rows = []
    assert proc.stdout is not None
    for line in proc.stdout:
        row = json.loads(line)
        if "note" in row:
            rep.note(row["note"])
            continue
        rows.append(row)
        rep.progress(
            f"{row['op']} {measure.fmt_size(row['size_bytes'])}, "
            f"chunk {measure.chunk_label(row['chunk_bytes'])}",
            len(rows),
            len(args.size) * len(args.chunk),
        )
    if proc.wait() != 0:
        raise _child_failed(proc, "kvlink-bench run")
    return rows


def report_limit(rep: Reporter, limit: float | None, nbytes: int, paths: int) -> float | None:
    """Reports iperf3's result as a row of its own (or a note when it is missing)."""
    if limit is None:
        rep.note(f"iperf3 not found: no limit measured ({iperf3.INSTALL_HINT})")
        return None
    rep.limit({
        "tool": "iperf3", "op": "push", "size_bytes": nbytes, "chunk_bytes": None,
        "paths": paths, "seconds": nbytes / limit / 1e9, "gbps": limit, "first_layer_s": None,
        "p50_s": None, "p99_s": None, "cpu_s": None, "limit_gbps": limit, "ratio_to_limit": 1.0,
    }, f"iperf3, {paths} stream{'s' if paths != 1 else ''} on the same paths")  # fmt: skip
    return limit


def with_limit(rows: list[dict[str, Any]], limit: float | None) -> list[dict[str, Any]]:
    for r in rows:
        r["limit_gbps"] = limit
        r["ratio_to_limit"] = r["gbps"] / limit if limit else None
    return rows


def cmd_loopback(args: argparse.Namespace, rep: Reporter) -> int:
    from ..bench.runner import run

    spec = spec_from(args)
    nics = f"loopback:{args.paths}"
    need = spec.need_bytes
    if args.mem == "cuda":
        from ..bench import gpu

        rows = list(gpu.run(nics, spec, rep.progress))
    else:
        with spawn_serve([], nics, need, "127.0.0.1") as endpoint:
            rows = list(run(endpoint, nics, spec, rep.progress))
    limit = None
    if "iperf3" in args.compare.split(","):
        per = max(1, need // args.paths)
        streams = [iperf3.Stream("127.0.0.1", f"127.0.0.{i + 1}", nbytes=per)
                   for i in range(args.paths)]  # fmt: skip
        rep.progress(f"iperf3 {measure.fmt_size(need)} over {args.paths} paths", 0, 1)
        limit = report_limit(rep, iperf3_gbps(streams), need, args.paths)
    from ..bench.peers import Where

    for r in [*with_limit(rows, limit), *run_peers(args, rep, Where(), limit)]:
        rep.result(r)
    return 0


def cmd_tcp_limit(args: argparse.Namespace, rep: Reporter) -> int:
    from ..bench import tcp_limit

    # The command measures kvlink's TCP transport: both agents (this one, serve's) take it.
    os.environ["KVLINK_TRANSPORT"] = "tcp"
    if args.io_threads is not None:
        os.environ["KVLINK_IO_THREADS"] = args.io_threads
    if err := check_environment():
        raise UsageError(err)
    nics = f"loopback:{args.paths}"
    rows: list[dict[str, Any]] = []
    with spawn_serve([], nics, max(args.size), "127.0.0.1") as endpoint:
        for size in args.size:
            for r in tcp_limit.run(endpoint, args.paths, size, args.iters, args.warmup,
                                   not args.no_verify, rep.progress):  # fmt: skip
                rows.append(r)
                rep.result(r)
    for size in args.size:
        kv = [r for r in rows if r["tool"] == "kvlink" and r["size_bytes"] == size]
        base = [r for r in rows if r["tool"] == "tcp-limit" and r["size_bytes"] == size]

        def span(rs: list[dict[str, Any]], key: str) -> str:
            xs = sorted(r[key] for r in rs)
            return f"{xs[0]:.2f}-{xs[-1]:.2f} (median {statistics.median(xs):.2f})"

        rep.note(
            f"{measure.fmt_size(size)} over {args.paths} paths, {len(kv)} rounds: "
            f"kvlink/tcp-limit {span(kv, 'ratio_to_limit')} x; GB/s kvlink "
            f"{span(kv, 'gbps')}, tcp-limit {span(base, 'gbps')}; CPU s/GiB kvlink "
            f"{span(kv, 'cpu_s_per_gib')}, tcp-limit {span(base, 'cpu_s_per_gib')}"
        )
    return 0


def _rates_bps(args: argparse.Namespace, links: int) -> list[int | None] | None:
    """The per-link rates --rate/--rates ask for (None: neither given)."""
    from .. import testbed as kt

    def bps(text: str) -> int | None:
        return None if text.strip().lower() in ("none", "unshaped") else kt.parse_rate(text)

    try:
        if args.rates is not None:
            return [bps(t) for t in args.rates.split(",")]
        if args.rate is not None:
            return [bps(args.rate)] * links
    except kt.TestbedError as exc:
        raise UsageError(str(exc)) from None
    return None


def _testbed(args: argparse.Namespace, rep: Reporter) -> tuple[Any, bool]:
    """The testbed to run on and whether this run owns it (built it, so removes it)."""
    from .. import testbed as kt

    if kt.inspect(args.tag)["up"]:
        tb = kt.Testbed.attach(args.tag)
        given = {
            "--links": args.links is not None and args.links != tb.links,
            "--rate/--rates": _rates_bps(args, tb.links) not in (None, list(tb.config.rates_bps)),
            "--subnet-base": args.subnet_base is not None
            and args.subnet_base != tb.config.subnet_base,
        }
        if changed := [k for k, v in given.items() if v]:
            raise UsageError(
                f"{', '.join(changed)}: testbed {args.tag!r} is up and is used as it is "
                f"({tb.links} links, rates {tb.rates}); leave {', '.join(changed)} out, change "
                f"it with `kvlink testbed set --tag {args.tag}`, or take it down first "
                f"(`kvlink testbed down --tag {args.tag}`)"
            )
        rep.note(
            f"using testbed {args.tag!r} as it is (left up): {tb.links} links, subnets "
            f"{', '.join(tb.subnet(i) for i in range(tb.links))}, rates {tb.rates}"
        )
        return tb, False
    rates = args.rates.split(",") if args.rates else None
    try:
        tb = kt.Testbed(
            links=len(rates) if rates else (args.links or 4),
            rate=None if rates else (args.rate or "2gbit"),
            rates=rates,
            tag=args.tag,
            subnet_base=args.subnet_base or 0,
        )
    except kt.TestbedConfigError as exc:
        raise UsageError(str(exc)) from None
    tb.up()
    rep.note(
        f"built testbed {args.tag!r} for this run (removed afterwards): {tb.links} links, "
        f"subnets {', '.join(tb.subnet(i) for i in range(tb.links))}, rates {tb.rates}"
    )
    return tb, True


def _relay_topology(tag: str) -> Any:
    """The live topology of ``tag`` when it has a relay host r (``kvlink testbed up --topology
    relay3``), else None."""
    from .. import testbed as kt

    state = kt.inspect_topology(tag)
    if not state.get("up") or "r" not in state.get("hosts", {}):
        return None
    return kt.Topology.attach(tag)


def cmd_testbed_relay(topo: Any, args: argparse.Namespace, rep: Reporter) -> int:
    """kvlink a -> b on a topology with a relay r: a `kvlink relay` runs in r and a's agent
    routes through it (docs/relays.md); iperf3 runs one stream per a-b and r-b link."""
    import tempfile

    spec = spec_from(args)
    need = spec.need_bytes
    with tempfile.TemporaryDirectory(prefix="kvlink-relay-") as work:
        md = os.path.join(work, "relay.json")
        relay = subprocess.Popen(
            [*topo.exec_prefix("r"), sys.executable, "-m", "kvlink.cli.main", "relay",
             "--name", "bench-relay", "--nics", ",".join(topo.addresses("r")),
             "--metadata-out", md], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=_child_env())  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(md):
                if relay.poll() is not None or time.monotonic() > deadline:
                    raise _child_failed(relay, "kvlink relay")
                time.sleep(0.05)
            rep.note(f"relaying through r: {', '.join(topo.addresses('r'))} (docs/relays.md)")
            os.environ["KVLINK_RELAYS"] = md  # a's agent (run_remote's child) routes through r
            try:
                b_nics = ",".join(topo.addresses("b"))
                with spawn_serve(topo.exec_prefix("b"), b_nics, need,
                                 topo.addresses("b")[0]) as endpoint:  # fmt: skip
                    rows = run_remote(topo.exec_prefix("a"), endpoint,
                                      ",".join(topo.addresses("a")), args, rep)  # fmt: skip
            finally:
                os.environ.pop("KVLINK_RELAYS", None)
        finally:
            relay.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                relay.wait(10)
    limit = None
    if "iperf3" in args.compare.split(","):
        flows = [(src, lk) for src in ("a", "r") for lk in topo.links(src, "b")]
        per = max(1, need // len(flows))
        streams = [
            iperf3.Stream(topo.address("b", lk.index), topo.address(src, lk.index), nbytes=per,
                          server_prefix=topo.exec_prefix("b"), client_prefix=topo.exec_prefix(src))
            for src, lk in flows
        ]  # fmt: skip
        rep.note("iperf3: one stream per a-b and r-b link at once (the capacity kvlink may use)")
        limit = report_limit(rep, iperf3_gbps(streams), need, len(streams))
    for r in with_limit(rows, limit):
        rep.result(r)
    return 0


def cmd_testbed(args: argparse.Namespace, rep: Reporter) -> int:
    from .. import testbed as kt

    ok, why = kt.is_available()
    if not ok:
        rep.note(f"testbed unavailable: {why}")
        return 2
    topo = _relay_topology(args.tag)
    if topo is not None:
        return cmd_testbed_relay(topo, args, rep)
    spec = spec_from(args)
    tb, owned = _testbed(args, rep)
    try:
        a_nics, b_nics = ",".join(tb.addresses("a")), ",".join(tb.addresses("b"))
        need = spec.need_bytes
        with spawn_serve(tb.exec_prefix("b"), b_nics, need, tb.addresses("b")[0]) as endpoint:
            rows = run_remote(tb.exec_prefix("a"), endpoint, a_nics, args, rep)
        limit = None
        if "iperf3" in args.compare.split(","):
            per = max(1, need // tb.links)
            streams = [
                iperf3.Stream(b, a, nbytes=per, server_prefix=tb.exec_prefix("b"),
                              client_prefix=tb.exec_prefix("a"))
                for a, b in zip(tb.addresses("a"), tb.addresses("b"), strict=True)
            ]  # fmt: skip
            limit = report_limit(rep, iperf3_gbps(streams), need, len(streams))
        from ..bench.peers import TestbedWhere

        for r in [*with_limit(rows, limit), *run_peers(args, rep, TestbedWhere(tb), limit)]:
            rep.result(r)
    finally:
        if owned:
            tb.down()
    return 0


def run_peers(
    args: argparse.Namespace, rep: Reporter, where: Any, limit: float | None
) -> list[dict[str, Any]]:
    """Each peer named in --compare: one timed write of every size, --iters times, each in
    fresh processes (kvlink/bench/peers.py).  A peer that cannot run is a note with why."""
    from ..bench import peers as _peers

    peers = [p for p in args.compare.split(",") if p in _peers.PEERS]
    if not peers:
        return []
    if args.op != "push" or args.concurrency != 1 or args.layers != 1:
        rep.note("peers run one plain write (push) of each size; --op/--concurrency/--layers "
                 "apply to kvlink only")  # fmt: skip
    peers_dir = _peers.find_peers_dir(args.peers_dir)
    rows = []
    for peer in peers:
        if reason := _peers.unavailable_reason(peers_dir, peer):
            rep.note(f"{peer}: cannot run: {reason}")
            continue
        for size in args.size:
            if size % 8:
                rep.note(f"{peer}: {size} bytes skipped: the peer workers need a multiple of 8")
                continue
            runs = []
            try:
                for it in range(args.iters):
                    rep.progress(f"{peer} {measure.fmt_size(size)}", it, args.iters)
                    runs.append(_peers.run_peer(peers_dir, peer, where, size, it))
            except _peers.PeerError as exc:
                rep.note(f"{peer} {measure.fmt_size(size)}: failed: {exc}")
                continue
            if not all(r.verified for r in runs):
                bad = next(r for r in runs if not r.verified)
                rep.note(f"{peer} {measure.fmt_size(size)}: data check failed ({bad.extra})")
                continue
            secs = sorted(r.seconds for r in runs)
            p50 = statistics.median(secs)
            gbps = size / p50 / 1e9
            rows.append({
                "tool": peer, "op": "push", "size_bytes": size, "chunk_bytes": None,
                "paths": where.links, "seconds": p50, "gbps": gbps, "first_layer_s": None,
                "p50_s": p50, "p99_s": secs[min(len(secs) - 1, int(0.99 * len(secs)))],
                "cpu_s": statistics.median(r.cpu_s for r in runs),
                "cpu_cores": statistics.median(r.cpu_s / r.seconds for r in runs),
                "limit_gbps": limit, "ratio_to_limit": gbps / limit if limit else None,
                "verified": True,
            })  # fmt: skip
    return rows


def cmd_serve(args: argparse.Namespace) -> int:
    from ..bench.runner import serve

    host, _, port = args.bootstrap.rpartition(":")
    if not host or not port.isdigit():
        print(f"kvlink-bench: --bootstrap: expected HOST:PORT, got {args.bootstrap!r}",
              file=sys.stderr)  # fmt: skip
        return 2

    def ready(endpoint: str) -> None:
        print(f"endpoint {endpoint}", flush=True)

    try:
        with contextlib.suppress(KeyboardInterrupt):
            serve(args.nics, args.size, (host, int(port)), ready)
    except Exception as exc:
        print(f"kvlink-bench serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_run(args: argparse.Namespace, rep: Reporter) -> int:
    from ..bench.runner import run

    for r in run(args.connect, args.nics, spec_from(args), rep.progress):
        rep.result(r)
    return 0


def quiet_warnings(prog: str) -> None:
    """A CLI shows a library warning (a misspelled KVLINK_* variable) as one line naming the
    tool, not with the library's source line."""

    def one_line(message: Warning | str, *_: Any, **__: Any) -> str:
        return f"{prog}: warning: {message}\n"

    warnings.formatwarning = one_line


def main(argv: Sequence[str] | None = None, prog: str = "kvlink-bench") -> int:
    quiet_warnings(prog)
    try:
        return _main(argv, prog)
    except KeyboardInterrupt:  # children and testbeds are cleaned up on the way out
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None, prog: str) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--log-level X demo ...` as well as `demo ... --log-level X`: the demo's own parser takes it
    lead = 2 if argv[:1] == ["--log-level"] else 0
    if argv[lead : lead + 1] == ["demo"]:
        from . import demo

        return demo.main(argv[:lead] + argv[lead + 1 :], prog=f"{prog} demo")
    args = build_parser(prog).parse_args(argv)
    _logging.setup(args.log_level, prog)
    if args.command == "table":
        return cmd_table(args)
    if args.command == "store":
        return cmd_store(args)
    err = check_environment()
    if err:
        print(f"kvlink-bench: {err}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return cmd_serve(args)
    resolve(args)
    err = check_args(args)
    if err:
        print(f"kvlink-bench: {err}", file=sys.stderr)
        return 2
    if args.command != "run":  # `run` meets a `serve` started apart: the user gives both theirs
        share_run_secret()
    rep = Reporter(args.command, args.json, args.csv, getattr(args, "plot", None))
    rep.run = run_info(prog, argv)
    rep.scenario_of = lambda row: scenario_name(args, row)
    try:
        fn = {"loopback": cmd_loopback, "testbed": cmd_testbed, "run": cmd_run,
              "tcp-limit": cmd_tcp_limit}[args.command]  # fmt: skip
        rc = fn(args, rep)
    except UsageError as exc:
        rep.stop()
        print(f"kvlink-bench: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        rep.stop()
        print(f"kvlink-bench: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        rep.stop()
        print(f"kvlink-bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    rep.finish()
    return rc


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
