"""`kvlink-bench demo`: a prefill process pushes a 32-layer paged KV cache to a
decode process over several loopback paths, and the decode side verifies
every byte.

The sender runs in this process; the receiver is a child process
(``python -m kvlink.cli.demo --receiver``) that talks JSON lines on stdio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import numpy as np

import kvlink
from kvlink import kv

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # spreads indices over all 64 bits
VERIFY_STEP = 8 << 20  # words per verification slice (64 MiB)


def fill_pattern(words: np.ndarray[Any, Any], start: int = 0) -> None:
    """Word i of the cache holds (start + i) * GOLDEN: every byte is predictable."""
    step = VERIFY_STEP
    for lo in range(0, words.size, step):
        hi = min(lo + step, words.size)
        idx = np.arange(start + lo, start + hi, dtype=np.uint64)
        np.multiply(idx, GOLDEN, out=words[lo:hi])


def count_mismatches(words: np.ndarray[Any, Any]) -> int:
    bad = 0
    expect = np.empty(min(VERIFY_STEP, words.size), np.uint64)
    for lo in range(0, words.size, VERIFY_STEP):
        hi = min(lo + VERIFY_STEP, words.size)
        e = expect[: hi - lo]
        np.multiply(np.arange(lo, hi, dtype=np.uint64), GOLDEN, out=e)
        bad += int(np.count_nonzero(words[lo:hi] != e))
    return bad


def cache_shape(args: argparse.Namespace) -> tuple[int, ...]:
    return (args.layers, 2, args.blocks, args.block_kib * 1024 // 8)


def receiver(args: argparse.Namespace) -> int:
    cfg = kvlink.Config(nics=f"loopback:{args.paths}")
    with kvlink.Agent("decode-0", cfg) as agent:
        cache = np.empty(cache_shape(args), np.uint64)
        cache.fill(0)  # a serving engine allocates its KV cache up front
        agent.register(cache, remote_write=True, name="kv")
        layout = kv.PagedLayout.from_tensors(agent, list(cache), planes=2)
        print(json.dumps({"metadata": agent.metadata().decode(), "layout": layout.to_dict()}))
        sys.stdout.flush()
        notes = agent.notifications(timeout_s=args.timeout)
        if not notes:
            print(json.dumps({"error": "no notification from the sender"}))
            return 1
        t0 = time.perf_counter()
        bad = count_mismatches(cache.reshape(-1))
        print(
            json.dumps(
                {
                    "tag": notes[0].tag.decode(),
                    "verified_bytes": cache.nbytes,
                    "mismatched_words": bad,
                    "verify_s": time.perf_counter() - t0,
                }
            )
        )
        return 0 if bad == 0 else 1


def sender(args: argparse.Namespace, child_argv: list[str]) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TransferSpeedColumn
    from rich.table import Table

    console = Console()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlink.cli.demo", "--receiver", *child_argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        hello = json.loads(proc.stdout.readline() or "{}")
        if "metadata" not in hello:
            console.print("[red]receiver did not start[/red]")
            return 1
        cfg = kvlink.Config(nics=f"loopback:{args.paths}")
        with kvlink.Agent("prefill-0", cfg) as agent:
            cache = np.empty(cache_shape(args), np.uint64)
            fill_pattern(cache.reshape(-1))
            agent.register(cache, remote_read=True, name="kv")
            src = kv.PagedLayout.from_tensors(agent, list(cache), planes=2)
            dst = kv.PagedLayout.from_dict(hello["layout"])
            agent.add_peer(hello["metadata"].encode())
            segs = kv.block_segments(src, dst, range(args.blocks), range(args.blocks))
            total = int(segs["len"].sum())
            console.print(
                f"pushing a {args.layers}-layer paged KV cache ({total / 2**30:.2f} GiB, "
                f"{len(segs)} segments) from prefill-0 to decode-0 over {args.paths} loopback paths"
            )
            t0 = time.perf_counter()
            h = agent.push("decode-0", segments=segs, notify=b"req-demo")
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
        result = json.loads(proc.stdout.readline() or "{}")
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    table = Table(title="kvlink demo: per-path throughput")
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
    console.print(f"aggregate:            {total / xfer_s / 1e9:.2f} GB/s")
    console.print(f"time to first layer:  {first_layer_s * 1e3:.1f} ms" if first_layer_s else "")
    console.print(
        f"total transfer time:  {xfer_s * 1e3:.1f} ms (wall incl. progress {seconds * 1e3:.1f} ms)"
    )
    ok = result.get("mismatched_words") == 0 and result.get("verified_bytes") == total
    if ok:
        console.print(
            f"[green]verified every byte[/green] on the receiver: {total:,} bytes, 0 mismatches "
            f"({result['verify_s'] * 1e3:.0f} ms), notification tag {result['tag']!r}"
        )
        return 0
    console.print(f"[red]verification failed[/red]: {result}")
    return 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlink-bench demo", description=__doc__)
    p.add_argument("--paths", type=int, default=4, help="loopback paths (default 4)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=512, help="KV blocks per layer")
    p.add_argument("--block-kib", type=int, default=32, help="KiB per block per K/V plane")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up")
    p.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.receiver:
        return receiver(args)
    return sender(args, [a for a in argv if a != "--receiver"])


if __name__ == "__main__":
    sys.exit(main())
