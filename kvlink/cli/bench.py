"""kvlink-bench: kvlink's throughput tool.

Subcommands:
  demo       the main job: a 32-layer paged KV cache pushed between two processes
             over 4 loopback paths, every byte verified
  loopback   serve + run as two processes on this machine over N loopback paths
  testbed    the same across the emulated multi-NIC testbed (root; builds or reuses it)
  serve      the target side on this host (prints its bootstrap endpoint)
  run        the initiator side: connects to a serve endpoint and measures

Every result is measured against a limit taken in the same run (iperf3 on the
same paths) when --compare includes iperf3 (the default for loopback/testbed).

Examples:
  kvlink-bench loopback --paths 4 --size 16MiB,256MiB,1GiB --iters 5
  kvlink-bench testbed --links 4 --rate 2gbit --size 20MB,1GiB --json
  kvlink-bench loopback --size 16MiB --concurrency 64 --op pull
  kvlink-bench serve --nics eth2,eth3 --size 4GiB --bootstrap 0.0.0.0:18515
  kvlink-bench run --connect host:18515 --nics eth2,eth3 --size 1GiB
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
}
JSON_FIELDS = (
    "tool",
    "op",
    "size_bytes",
    "chunk_bytes",
    "paths",
    "seconds",
    "gbps",
    "first_layer_s",
    "p50_s",
    "p99_s",
    "cpu_s",
    "limit_gbps",
    "ratio_to_limit",
)
PEERS = ("iperf3", "mooncake", "nixl", "ucxx")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16MiB, 20MB, 1GiB)")
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


def size_list(text: str) -> list[int]:
    return [parse_size(t) for t in text.split(",") if t.strip()]


def chunk_list(text: str) -> list[int]:
    return [0 if t.strip() == "auto" else parse_size(t) for t in text.split(",") if t.strip()]


def fmt_size(n: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n / 1e6:g}MB" if n >= 10**6 else f"{n}B"


def chunk_label(chunk_bytes: int | None) -> str:
    """A result's chunk column: auto (the planner's choice), a size, or - (not kvlink)."""
    if chunk_bytes is None:
        return "-"
    return "auto" if chunk_bytes == 0 else fmt_size(chunk_bytes)


def common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=size_list, default=[1 << 30], help="sweep list (16MiB,1GiB)")
    p.add_argument(
        "--chunk",
        type=chunk_list,
        default=[0],
        help="exact chunk sizes to sweep (4MiB,64MiB); default auto: the planner's choice",
    )
    p.add_argument("--op", choices=["push", "pull"], default="push")
    p.add_argument("--mem", choices=["host", "cuda"], default="host")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=1, help="transfers in flight at once")
    p.add_argument("--layers", type=int, default=1, help="split each transfer into layers")
    p.add_argument("--no-verify", action="store_true", help="skip the byte check")
    p.add_argument("--json", action="store_true", help="one JSON object per result line")
    p.add_argument("--csv", metavar="FILE", help="also write the results as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="throughput vs size (or chunk size)")
    p.add_argument("--compare", default="iperf3", help="iperf3,mooncake,nixl,ucxx or none")
    p.add_argument(
        "--peers-dir",
        metavar="DIR",
        help="bench/peers of a kvlink checkout, with the peers installed by its setup.sh "
        "(default: $KVLINK_PEERS_DIR, else found from the checkout or the current directory)",
    )
    p.add_argument("--quick", action="store_true", help="tiny run for smoke tests")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvlink-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the main job (see kvlink-bench demo --help)", add_help=False)
    lo = sub.add_parser("loopback", help="two processes on this machine")
    lo.add_argument("--paths", type=int, default=4)
    common(lo)
    tb = sub.add_parser("testbed", help="across the emulated multi-NIC testbed (root)")
    tb.add_argument("--links", type=int, default=4)
    tb.add_argument("--rate", default="2gbit")
    tb.add_argument("--rates", help="per-link rates, e.g. 2gbit,2gbit,1gbit,500mbit")
    tb.add_argument("--tag", default="bench", help="testbed tag (reused if it is up)")
    common(tb)
    sv = sub.add_parser("serve", help="the target side")
    sv.add_argument("--nics", default="auto")
    sv.add_argument("--size", type=parse_size, default=1 << 30, help="bytes to register")
    sv.add_argument("--bootstrap", default="0.0.0.0:18515", help="host:port for run to reach")
    rn = sub.add_parser("run", help="the initiator side")
    rn.add_argument("--connect", required=True, help="serve's bootstrap host:port")
    rn.add_argument("--nics", default="auto")
    common(rn)
    return ap


# ---- output ----------------------------------------------------------------


class Reporter:
    """Live progress for humans, JSON lines for machines, CSV and plots on request."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows: list[dict[str, Any]] = []
        self.console: Any = None
        self.bar: Any = None
        self.task: Any = None
        if not args.json:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn

            # wide enough for the summary table even when piped
            self.console = Console(width=max(150, shutil.get_terminal_size().columns))
            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                console=self.console,
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("starting", total=1)

    def progress(self, what: str, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=what, completed=done, total=total)

    def note(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)
        else:
            print(json.dumps({"note": text}), flush=True)

    def result(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.args.json:
            print(json.dumps(row), flush=True)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self._table()
        if self.args.csv:
            with open(self.args.csv, "w", newline="") as f:
                w = csv.DictWriter(
                    f,
                    fieldnames=[*JSON_FIELDS, "concurrency", "layers", "cpu_cores", "verified"],
                    extrasaction="ignore",
                )
                w.writeheader()
                w.writerows(self.rows)
        if self.args.plot:
            self._plot(self.args.plot)

    def _table(self) -> None:
        from rich.table import Table

        t = Table(title="kvlink-bench")
        for col in (
            "tool",
            "op",
            "size",
            "chunk",
            "conc",
            "GB/s",
            "limit GB/s",
            "% limit",
            "first layer",
            "p50",
            "p99",
            "CPU cores",
            "per path GB/s",
        ):
            t.add_column(col)
        for r in self.rows:
            ratio = r.get("ratio_to_limit")
            t.add_row(
                r["tool"],
                r.get("op", "-"),
                fmt_size(r["size_bytes"]),
                chunk_label(r.get("chunk_bytes")),
                str(r.get("concurrency", 1)),
                f"{r['gbps']:.3f}",
                f"{r['limit_gbps']:.3f}" if r.get("limit_gbps") else "-",
                f"{100 * ratio:.0f}%" if ratio else "-",
                f"{r['first_layer_s'] * 1e3:.1f} ms" if r.get("first_layer_s") else "-",
                f"{r['p50_s'] * 1e3:.1f} ms" if r.get("p50_s") else "-",
                f"{r['p99_s'] * 1e3:.1f} ms" if r.get("p99_s") else "-",
                f"{r['cpu_cores']:.2f}" if r.get("cpu_cores") is not None else "-",
                " ".join(f"{v:.2f}" for v in r.get("per_path_gbps", {}).values()) or "-",
            )
        self.console.print(t)

    def _plot(self, path: str) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.note("--plot needs matplotlib: pip install matplotlib")
            return
        rows = [r for r in self.rows if r["tool"] == "kvlink"]
        by_chunk = (
            len({r["chunk_bytes"] for r in rows}) > 1 and len({r["size_bytes"] for r in rows}) == 1
        )
        key = "chunk_bytes" if by_chunk else "size_bytes"
        fig, ax = plt.subplots(figsize=(8, 4.5))
        groups: dict[Any, list[dict[str, Any]]] = {}
        for r in rows:
            groups.setdefault(r["size_bytes"] if by_chunk else r["chunk_bytes"], []).append(r)
        for g, rs in sorted(groups.items()):
            rs.sort(key=lambda r: r[key])
            ax.plot(
                [r[key] for r in rs],
                [r["gbps"] for r in rs],
                marker="o",
                label=f"kvlink ({'size' if by_chunk else 'chunk'} {fmt_size(g) if g else 'auto'})",
            )
        limits = [r["limit_gbps"] for r in rows if r.get("limit_gbps")]
        if limits:
            ax.axhline(max(limits), color="grey", linestyle="--", label="iperf3, same paths")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("chunk size (bytes)" if by_chunk else "transfer size (bytes)")
        ax.set_ylabel("GB/s (1e9 bytes/s)")
        ax.set_title(
            f"kvlink-bench {self.args.command}: throughput vs "
            f"{'chunk size' if by_chunk else 'size'} ({time.strftime('%Y-%m-%d')})"
        )
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        self.note(f"plot written to {path}")


# ---- limits (iperf3 on the same paths) --------------------------------------


def listening(pid: int, port: int) -> bool:
    """Whether something in ``pid``'s network namespace listens on TCP ``port``."""
    for table in ("tcp6", "tcp"):  # /proc/PID/net/*: the table of PID's namespace
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def wait_listening(servers: list[subprocess.Popen[Any]], ports: list[int], err: Any) -> None:
    """Waits up to 10 s for each iperf3 server to listen on its port.

    Raises:
        RuntimeError: a server exited or did not listen in time (with its stderr, ``err``,
            a file opened in binary mode).
    """
    deadline = time.monotonic() + 10
    for srv, port in zip(servers, ports, strict=True):
        while not listening(srv.pid, port):
            if srv.poll() is not None or time.monotonic() > deadline:
                err.seek(0)
                raise RuntimeError(f"iperf3 -s did not listen on {port}: {err.read()!r}")
            time.sleep(0.01)


def iperf3_gbps(pairs: list[tuple[list[str], str, list[str], str]], nbytes: int) -> float | None:
    """Aggregate GB/s of one iperf3 stream per (server prefix, server addr, client prefix,
    client bind addr), all at once; None without iperf3."""
    if not shutil.which("iperf3"):
        return None
    servers, clients = [], []
    ports = [15201 + i for i in range(len(pairs))]
    err = tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
    try:
        for (spre, saddr, _, _), port in zip(pairs, ports, strict=True):
            servers.append(
                subprocess.Popen(
                    [*spre, "iperf3", "-s", "-1", "-B", saddr, "-p", str(port)],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
        wait_listening(servers, ports, err)
        per = max(1, nbytes // len(pairs))
        for (_, saddr, cpre, caddr), port in zip(pairs, ports, strict=True):
            clients.append(
                subprocess.Popen(
                    [
                        *cpre,
                        "iperf3",
                        "-c",
                        saddr,
                        "-B",
                        caddr,
                        "-p",
                        str(port),
                        "-n",
                        str(per),
                        "--json",
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        total, longest = 0.0, 0.0
        for c in clients:
            out, _ = c.communicate(timeout=300)
            end = json.loads(out)["end"]["sum_received"]
            total += float(end["bytes"])
            longest = max(longest, float(end["seconds"]))
        return total / longest / 1e9 if longest else None
    finally:
        for p in servers + clients:
            if p.poll() is None:
                p.kill()
            p.wait()
        err.close()


# ---- orchestration -----------------------------------------------------------


def spec_from(args: argparse.Namespace) -> Any:
    from ._bench_core import RunSpec

    if args.quick:
        args.size, args.chunk = [16 << 20], [0]
        args.iters, args.warmup = 2, 1
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
    if args.mem == "cuda":
        return (
            "--mem cuda: GPU memory needs the UCX transport, which this build lacks; use --mem host"
        )
    for name in ("iters", "concurrency", "layers"):
        if getattr(args, name) < 1:
            return f"--{name} must be at least 1"
    if args.warmup < 0:
        return "--warmup must be >= 0"
    bad = [p for p in args.compare.split(",") if p and p != "none" and p not in PEERS]
    if bad:
        return f"--compare: unknown {bad}; choose from {','.join(PEERS)} or none"
    libs = [p for p in args.compare.split(",") if p in ("mooncake", "nixl", "ucxx")]
    if args.command == "run" and libs:
        return (
            f"--compare {','.join(libs)}: peer libraries are compared by `kvlink-bench loopback` "
            "and `kvlink-bench testbed`; between two hosts run each library's own tool"
        )
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


@contextlib.contextmanager
def spawn_serve(prefix: list[str], nics: str, nbytes: int, host: str) -> Iterator[str]:
    """`kvlink-bench serve` in a child process; yields its bootstrap endpoint."""
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "kvlink.cli.bench",
        "serve",
        "--nics",
        nics,
        "--size",
        str(nbytes),
        "--bootstrap",
        f"{host}:0",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("endpoint "):
            raise RuntimeError(f"kvlink-bench serve did not start (rc={proc.poll()})")
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
    argv = [
        *prefix,
        sys.executable,
        "-m",
        "kvlink.cli.bench",
        "run",
        "--connect",
        endpoint,
        "--nics",
        nics,
        "--json",
        "--compare",
        "none",
        "--size",
        ",".join(map(str, args.size)),
        "--chunk",
        ",".join(map(str, args.chunk)),
        "--op",
        args.op,
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--concurrency",
        str(args.concurrency),
        "--layers",
        str(args.layers),
    ]
    if args.no_verify:
        argv.append("--no-verify")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    rows = []
    assert proc.stdout is not None
    for line in proc.stdout:
        row = json.loads(line)
        if "note" in row:
            rep.note(row["note"])
            continue
        rows.append(row)
        rep.progress(
            f"{row['op']} {fmt_size(row['size_bytes'])}",
            len(rows),
            len(args.size) * len(args.chunk),
        )
    if proc.wait() != 0:
        raise RuntimeError(f"kvlink-bench run failed (rc={proc.returncode})")
    return rows


def report_limit(rep: Reporter, limit: float | None, nbytes: int, paths: int) -> float | None:
    """Reports iperf3's result as a row of its own (or a note when it is missing)."""
    if limit is None:
        rep.note("iperf3 not found: no limit measured (apt-get install iperf3)")
        return None
    rep.result({
        "tool": "iperf3", "op": "push", "size_bytes": nbytes, "chunk_bytes": None,
        "paths": paths, "seconds": nbytes / limit / 1e9, "gbps": limit, "first_layer_s": None,
        "p50_s": None, "p99_s": None, "cpu_s": None, "limit_gbps": limit, "ratio_to_limit": 1.0,
    })  # fmt: skip
    return limit


def with_limit(rows: list[dict[str, Any]], limit: float | None) -> list[dict[str, Any]]:
    for r in rows:
        r["limit_gbps"] = limit
        r["ratio_to_limit"] = r["gbps"] / limit if limit else None
    return rows


def cmd_loopback(args: argparse.Namespace, rep: Reporter) -> int:
    from ._bench_core import RunSpec, run

    spec: RunSpec = spec_from(args)
    paths = 2 if args.quick else args.paths
    nics = f"loopback:{paths}"
    need = max(spec.sizes) * spec.concurrency
    with spawn_serve([], nics, need, "127.0.0.1") as endpoint:
        rows = list(run(endpoint, nics, spec, rep.progress))
    limit = None
    if "iperf3" in args.compare.split(","):
        lo: list[tuple[list[str], str, list[str], str]] = [
            ([], "127.0.0.1", [], f"127.0.0.{i + 1}") for i in range(paths)
        ]
        limit = report_limit(rep, iperf3_gbps(lo, need), need, paths)
    from ._peers import Where

    for r in [*with_limit(rows, limit), *run_peers(args, rep, Where(), limit)]:
        rep.result(r)
    return 0


def cmd_testbed(args: argparse.Namespace, rep: Reporter) -> int:
    from .. import testbed as kt

    ok, why = kt.is_available()
    if not ok:
        rep.note(f"testbed unavailable: {why}")
        return 2
    spec = spec_from(args)
    rates = args.rates.split(",") if args.rates else None
    tb = kt.Testbed(
        links=len(rates) if rates else args.links,
        rate=None if rates else args.rate,
        rates=rates,
        tag=args.tag,
    )
    with tb:
        a_nics, b_nics = ",".join(tb.addresses("a")), ",".join(tb.addresses("b"))
        need = max(spec.sizes) * spec.concurrency
        with spawn_serve(tb.exec_prefix("b"), b_nics, need, tb.addresses("b")[0]) as endpoint:
            rows = run_remote(tb.exec_prefix("a"), endpoint, a_nics, args, rep)
        limit = None
        if "iperf3" in args.compare.split(","):
            pairs = [
                (tb.exec_prefix("b"), b, tb.exec_prefix("a"), a)
                for a, b in zip(tb.addresses("a"), tb.addresses("b"), strict=True)
            ]
            limit = report_limit(rep, iperf3_gbps(pairs, need), need, len(pairs))
        from ._peers import TestbedWhere

        for r in [*with_limit(rows, limit), *run_peers(args, rep, TestbedWhere(tb), limit)]:
            rep.result(r)
    return 0


def run_peers(
    args: argparse.Namespace, rep: Reporter, where: Any, limit: float | None
) -> list[dict[str, Any]]:
    """Each peer named in --compare: one timed write of every size, --iters times, each in
    fresh processes (kvlink/cli/_peers.py).  A peer that cannot run is a note with why."""
    from . import _peers

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
                    rep.progress(f"{peer} {fmt_size(size)}", it, args.iters)
                    runs.append(_peers.run_peer(peers_dir, peer, where, size, it))
            except _peers.PeerError as exc:
                rep.note(f"{peer} {fmt_size(size)}: failed: {exc}")
                continue
            if not all(r.verified for r in runs):
                bad = next(r for r in runs if not r.verified)
                rep.note(f"{peer} {fmt_size(size)}: data check failed ({bad.extra})")
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
    from ._bench_core import serve

    host, port = args.bootstrap.rsplit(":", 1)

    def ready(endpoint: str) -> None:
        print(f"endpoint {endpoint}", flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        serve(args.nics, args.size, (host, int(port)), ready)
    return 0


def cmd_run(args: argparse.Namespace, rep: Reporter) -> int:
    from ._bench_core import run

    for r in run(args.connect, args.nics, spec_from(args), rep.progress):
        rep.result(r)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from . import demo

        return demo.main(argv[1:])
    args = build_parser().parse_args(argv)
    err = check_environment()
    if err:
        print(f"kvlink-bench: {err}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return cmd_serve(args)
    err = check_args(args)
    if err:
        print(f"kvlink-bench: {err}", file=sys.stderr)
        return 2
    rep = Reporter(args)
    try:
        fn = {"loopback": cmd_loopback, "testbed": cmd_testbed, "run": cmd_run}[args.command]
        rc = fn(args, rep)
    except Exception as exc:
        if rep.bar is not None:
            rep.bar.stop()
        print(f"kvlink-bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    rep.finish()
    return rc


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
