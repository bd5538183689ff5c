"""`kvlink-bench demo`: a prefill process pushes a 32-layer paged KV cache to a
decode process over several loopback paths, and the decode side verifies
every byte. Beside the result stand two baselines measured in the same run:
iperf3 over the same loopback paths (what TCP itself gives) and memcpy of
the same bytes on this machine. GB/s is 1e9 bytes per second.  The two
processes share a host, so with the default transport ("auto") the paths
copy process to process ("shm"); KVLINK_TRANSPORT=tcp runs them over TCP.

The sender runs in this process; the receiver is a benchmark worker
(kvlink.bench.worker) in a child process. Every wait has a deadline
(--timeout): a failure is reported with its reason, never waited out.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import kvlink
from kvlink import kv

from .._nics import MAX_PATHS
from ..bench import iperf3, measure
from ..bench.protocol import WorkerError
from ..bench.worker import Worker
from . import _logging
from .bench import check_environment, int_range

MEMCPY_SLICE = 64 << 20  # bytes per memcpy step: no second full-size cache is needed


def _positive_s(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be more than 0 seconds")
    return v


def cache_shape(args: argparse.Namespace) -> tuple[int, ...]:
    return (args.layers, 2, args.blocks, args.block_kib * 1024 // 8)


def memcpy_gbps(src: np.ndarray[Any, Any]) -> float:
    """GB/s of copying ``src`` once on this machine, slice by slice into one scratch slice."""
    flat = src.reshape(-1).view(np.uint8)
    scratch = np.empty(min(MEMCPY_SLICE, flat.size), np.uint8)
    scratch.fill(0)  # fault the pages in before the clock starts
    t0 = time.perf_counter()
    for lo in range(0, flat.size, MEMCPY_SLICE):
        hi = min(lo + MEMCPY_SLICE, flat.size)
        np.copyto(scratch[: hi - lo], flat[lo:hi])
    return flat.size / (time.perf_counter() - t0) / 1e9


BASELINE_S = 2.0  # iperf3 runs this long: a one-second burst on a shared host is too noisy


def iperf3_baseline(paths: int, timeout_s: float) -> float | None:
    """GB/s of iperf3 over the demo's loopback paths, one stream each, for BASELINE_S."""
    if not iperf3.available():
        return None
    streams = [
        iperf3.Stream("127.0.0.1", f"127.0.0.{i + 1}", seconds=BASELINE_S) for i in range(paths)
    ]
    return iperf3.aggregate_gbps(iperf3.run(streams, timeout_s=timeout_s))


def sender(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TransferSpeedColumn
    from rich.table import Table

    console = Console()
    nics = f"loopback:{args.paths}"
    shape = cache_shape(args)
    nbytes = int(np.prod(shape)) * 8
    console.print(f"starting the decode process (registers a {measure.fmt_size(nbytes)} cache) ...")
    rx = Worker("decode-0", name="decode-0", nics=nics, answer_s=args.timeout)
    try:
        rx.call("alloc", answer_s=args.timeout, key="kv", nbytes=nbytes, fill="zero",
                remote_write=True, name="kv")  # fmt: skip
        dst_layout = rx.call("layout", key="kv", layers=args.layers, planes=2,
                             num_blocks=args.blocks)["layout"]  # fmt: skip
        with kvlink.Agent("prefill-0", kvlink.Config.load(nics=nics)) as agent:
            cache = np.empty(shape, np.uint64)
            measure.fill_pattern(cache)
            agent.register(cache, remote_read=True, name="kv")
            src = kv.PagedLayout.from_tensors(agent, list(cache), planes=2)
            dst = kv.PagedLayout.from_dict(dst_layout)
            agent.add_peer(rx.metadata)
            segs = kv.block_segments(src, dst, range(args.blocks), range(args.blocks))
            total = int(segs["len"].sum())
            console.print(
                f"pushing a {args.layers}-layer paged KV cache ({measure.fmt_size(total)}, "
                f"{len(segs)} segments) from prefill-0 to decode-0 over {args.paths} loopback "
                "paths"
            )
            t0 = time.perf_counter()
            h = agent.push("decode-0", segments=segs, notify=b"req-demo", timeout_s=args.timeout)
            first_layer_s = None
            with Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                "[progress.percentage]{task.percentage:>3.0f}%",
                TransferSpeedColumn(),
                console=console,
                transient=False,
            ) as bar:
                task = bar.add_task("push", total=total)
                for ev in h.chunks(timeout_s=args.timeout):
                    if first_layer_s is None and 0 in ev.layers:
                        first_layer_s = (ev.t_ns - h.info().t_submit_ns) / 1e9
                    bar.update(task, advance=ev.nbytes)
            h.wait(args.timeout)
            seconds = time.perf_counter() - t0
            info = h.info()
            xfer_s = (info.t_done_ns - info.t_submit_ns) / 1e9
            paths = agent.paths()
            notes = rx.call("notifications", answer_s=args.timeout + 10,
                            wait_s=args.timeout)["notifications"]  # fmt: skip
            if not notes:
                raise WorkerError(f"decode-0: no notification from the sender in {args.timeout} s")
            t_check = time.perf_counter()
            check = rx.call("verify", answer_s=args.timeout + 60, key="kv")
            verify_s = time.perf_counter() - t_check
            console.print("measuring the baselines: memcpy, then iperf3 on the same paths ...")
            copy_gbps = memcpy_gbps(cache)
        rx.close()  # frees the receiver's cache before iperf3 runs
        limit = iperf3_baseline(args.paths, args.timeout)
    finally:
        rx.close()

    gbps = total / xfer_s / 1e9
    table = Table(title="kvlink demo: per-path throughput (GB/s = 1e9 bytes/s)")
    for col in ("path", "local -> remote", "bytes", "GB/s"):
        table.add_column(col)
    for p in paths:
        table.add_row(
            str(p.index),
            f"{p.local} -> {p.remote}",
            f"{p.bytes_sent:,}",
            f"{p.bytes_sent / xfer_s / 1e9:.2f}",
        )
    console.print(table)
    kinds = sorted({p.transport for p in paths})
    if kinds == ["shm"]:
        console.print(
            "transport: shm (same host: each chunk copied process to process by the receiver "
            "and verified; no socket carries payload bytes; KVLINK_TRANSPORT=tcp for TCP)"
        )
    else:
        console.print(f"transport: {', '.join(kinds)}")
    base = Table(title="the result beside baselines measured in this run")
    for col in ("what", "GB/s", "kvlink as a share of it"):
        base.add_column(col)
    base.add_row(f"kvlink push, {args.paths} paths, every byte checked", f"{gbps:.2f}", "")
    if limit is not None:
        base.add_row(f"iperf3, {args.paths} streams on the same paths for {BASELINE_S:g} s "
                     "(plain TCP, nothing checked)",
                     f"{limit:.2f}", f"{gbps / limit:.0%}")  # fmt: skip
    else:
        base.add_row(f"iperf3: not installed ({iperf3.INSTALL_HINT})", "-", "-")
    base.add_row("memcpy of the same bytes, one core (memory's limit)", f"{copy_gbps:.2f}",
                 f"{gbps / copy_gbps:.0%}")  # fmt: skip
    console.print(base)
    if limit is not None and kinds != ["shm"]:
        console.print(
            f"kvlink moved the cache at {gbps / limit:.0%} of what iperf3 gets over the same "
            "paths: near or above 100% means the network, not kvlink, is the limit (both share "
            "this host's cores, so expect some noise from run to run)."
        )
    elif limit is not None:
        console.print(
            f"kvlink moved the cache at {gbps / limit:.0%} of what iperf3 gets over TCP on the "
            f"same host and at {gbps / copy_gbps:.0%} of one core's memcpy: same-host paths "
            "skip the sockets (both processes share this host's cores: expect some noise)."
        )
    console.print(f"aggregate:            {gbps:.2f} GB/s")
    if first_layer_s is not None:
        console.print(f"time to first layer:  {first_layer_s * 1e3:.1f} ms")
    console.print(
        f"total transfer time:  {xfer_s * 1e3:.1f} ms (wall incl. progress {seconds * 1e3:.1f} ms)"
    )
    if check["corrupt_bytes"] == 0:
        console.print(
            f"[green]verified every byte[/green] on the receiver: {total:,} bytes, 0 mismatches "
            f"({verify_s * 1e3:.0f} ms), notification tag {bytes.fromhex(notes[0]['tag'])!r}"
        )
        return 0
    console.print(
        f"[red]verification failed[/red]: {check['corrupt_bytes']} bytes differ, the first at "
        f"offset {check['first_bad_offset']}"
    )
    return 1


def build_parser(prog: str = "kvlink-bench demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--paths",
        type=int_range(1, MAX_PATHS),
        default=4,
        help=f"loopback paths, 1 to {MAX_PATHS} (default: 4)",
    )
    p.add_argument(
        "--layers", type=int_range(1), default=32, help="layers of the KV cache (default: 32)"
    )
    p.add_argument(
        "--blocks", type=int_range(1), default=512, help="KV blocks per layer (default: 512)"
    )
    p.add_argument(
        "--block-kib",
        type=int_range(1),
        default=32,
        help="KiB per block per K/V plane (default: 32)",
    )
    p.add_argument("--timeout", type=_positive_s, default=60.0,
                   help="seconds any one step may take before the demo fails with the reason "
                   "(default: 60)")  # fmt: skip
    _logging.add_log_level(p)
    return p


def main(argv: list[str] | None = None, prog: str = "kvlink-bench demo") -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(prog).parse_args(argv)
    _logging.setup(args.log_level, prog)
    if err := check_environment():
        print(f"kvlink-bench demo: {err}", file=sys.stderr)
        return 2
    try:
        return sender(args)
    except (WorkerError, kvlink.KvlinkError, iperf3.Iperf3Error) as exc:
        print(f"kvlink-bench demo: failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # whatever it was, the reason and a non-zero exit, at once
        print(f"kvlink-bench demo: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
