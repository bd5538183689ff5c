"""kvlink over several emulated NICs vs iperf3 on the same links, with links cut and slowed.

    python bench/multinic.py [--rate 2gbit] [--size 2GiB] [--iters 3] [--json out.jsonl]
                             [--plot docs/img/linkcut.png]
                             [--scenarios aggregate,hetero,linkcut,ratedrop,kvlayers]

Needs root (it builds kvlink.testbed namespaces, "kvlmn*") and iperf3.  Scenarios and targets
(the issue's acceptance criteria, each checked against a baseline measured in the same run):

  aggregate  4 x RATE links.  iperf3, one stream per link, four at once, vs a kvlink push over
             all 4 paths and over 1 path.  kvlink4 / iperf3 >= 0.97; kvlink4 / kvlink1 >= 3.8.
  hetero     links at RATE, RATE, RATE/2, RATE/4.  iperf3 (four streams at once, bytes in
             proportion to each link's rate so all four end together) vs kvlink with the
             earliest-finish scheduler (>= 0.95) and, for contrast, round-robin (no target).
  linkcut    4 x RATE; link 1 taken down (both ends) at 30% of the clean kvlink time of the
             same iteration.  total / ideal <= 1.15 with ideal = clean x (0.3 + 0.7 x 4/3);
             detection latency (paths()[1].t_down_ns - the moment `ip link set down` started)
             <= 300 ms; every received byte checked.
  ratedrop   4 x RATE; link 2 re-shaped to RATE/10 at 30%.  total / ideal <= 1.10 with
             ideal = clean x (0.3 + 0.7 x 4/3.1).
  kvlayers   a 32-layer paged KV cache of SIZE (2 planes per layer, 32 KiB blocks: Llama-3-8B
             geometry) pushed with kv.block_segments over 4 x RATE: time to the first chunk
             event that completes layer 0, over the whole transfer's time, <= 2/32.

How it measures:
  * Each scenario gets its own testbed and one worker process per side (kvlink.bench.worker,
    sender in namespace a, receiver in b) holding one agent per configuration, all sharing
    one SIZE buffer per side: the sender's is filled with a pattern (64-bit word i holds i),
    the receiver's is zeroed (pre-faulted) before every push and checked byte by byte after.
  * Every measured run, kvlink or iperf3, starts after 1 s of quiet links: an agent's NIC
    monitor counts the previous run's traffic as foreign load and discounts that NIC for about
    a second after it stops (0.3-weighted EWMA per 100 ms tick).
  * Agents connect, and push min(SIZE, 512 MiB) once untimed, before anything is measured:
    long-lived agents with path-rate estimates, as in serving.  After each fault the link is
    restored, the path waited for (UP again, 20 s at most) and the warm push repeated, so the
    next clean run does not start from the fault's estimates.
  * kvlink seconds are the engine's own t_done - t_submit (CLOCK_MONOTONIC; t_done is when the
    last chunk's verified acknowledgement arrived).  Fault times (FaultSchedule.fired, the
    moment before `ip`/`tc` ran), chunk event times and paths()' t_down_ns are all
    CLOCK_MONOTONIC on the same host, so they are compared directly.
  * iperf3: one `iperf3 -s -1 -B <b addr>` per link in namespace b, then one
    `iperf3 -c <b addr> -B <a addr> -n <bytes> --json` per link from namespace a, all at once.
    Each stream's seconds are its bytes sent / its receiver-side rate (as bench/loopback.py);
    the aggregate is total bytes / the longest stream's seconds.
  * Configurations alternate order every iteration (this 2-core machine is noisy); tables show
    medians, and targets are checked on ratios of medians (paired per-iteration medians shown
    beside them).

GB/s are 1e9 bytes per second.  The JSON output has one object per line: a "meta" line, one
"result" line per configuration and scenario, one "ratio" line per target and, for the plot,
one "linkcut_events" line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import kvlink
import kvlink.testbed as kt
from kvlink.bench import BenchError, iperf3, share_run_secret
from kvlink.bench.measure import GiB, MiB, fmt_size, median, size_arg
from kvlink.bench.pair import KV_BLOCK_BYTES, QUIET_S, KvRun, Pair, kv_geometry
from kvlink.bench.report import JsonLinesFile

SCENARIOS = ("aggregate", "hetero", "linkcut", "ratedrop", "kvlayers")
TAGS = {s: "mn" + s[:4] for s in SCENARIOS}  # namespaces kvlmnaggra, kvlmnheta, ...
CUT_AT = 0.3  # of the clean transfer time

Emit = Callable[[dict[str, Any]], None]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- iperf3 ----------------------------------------------------------------------


@dataclass
class IperfRun:
    """One round of concurrent iperf3 streams, one per link."""

    size_bytes: int
    seconds: float  # the longest stream's
    stream_bytes: list[int]
    stream_seconds: list[float]
    stream_gbit: list[float]  # receiver-side rate per stream
    retransmits: list[int]

    @property
    def gbps(self) -> float:
        return self.size_bytes / self.seconds / 1e9


def run_iperf3(tb: kt.Testbed, stream_bytes: list[int], timeout_s: float) -> IperfRun:
    """One iperf3 stream per link, all at once, ``stream_bytes[i]`` over link i."""
    time.sleep(QUIET_S)
    res = iperf3.run(
        [
            iperf3.Stream(tb.address("b", i), tb.address("a", i), nbytes=n,
                          server_prefix=tb.exec_prefix("b"), client_prefix=tb.exec_prefix("a"))
            for i, n in enumerate(stream_bytes)
        ],
        timeout_s=timeout_s,
    )  # fmt: skip
    sent = [r.sent_bytes for r in res]
    secs = [r.seconds for r in res]
    return IperfRun(
        size_bytes=sum(sent),
        seconds=max(secs),
        stream_bytes=sent,
        stream_seconds=secs,
        stream_gbit=[r.received_bps / 1e9 for r in res],
        retransmits=[r.retransmits for r in res],
    )


# ---- reporting ---------------------------------------------------------------------


class Report:
    """Tables on stdout, JSON lines, and the PASS/FAIL of every target."""

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.passed: list[bool] = []

    def ratio(
        self,
        scenario: str,
        name: str,
        value: float,
        op: str | None,
        target: float | None,
        paired: list[float] | None = None,
        note: str = "",
    ) -> None:
        ok = None
        if op is not None and target is not None:
            ok = value >= target if op == ">=" else value <= target
            self.passed.append(ok)
        line: dict[str, Any] = {
            "kind": "ratio",
            "scenario": scenario,
            "ratio": name,
            "value": round(value, 4),
            "target": f"{op} {target}" if op else None,
            "pass": ok,
        }
        if paired:
            line["paired_median"] = round(median(paired), 4)
            line["paired"] = [round(x, 4) for x in paired]
        if note:
            line["note"] = note
        self.emit(line)
        tgt = f"target {op} {target:g}" if op is not None and target is not None else "(contrast)"
        verdict = "" if ok is None else ("PASS" if ok else "FAIL")
        extra = f"  (paired median {median(paired):.3f})" if paired else ""
        print(f"  {name:<34}{value:>9.3f}  {tgt:<16}{verdict:<5}{extra}")
        if note:
            print(f"      {note}")


def gb_list(xs: list[int]) -> str:
    return "/".join(f"{x / 1e9:.2f}" for x in xs)


def print_throughput(title: str, rows: list[tuple[str, list[Any]]]) -> None:
    print(f"\n{title}")
    hdr = f"  {'config':<26}{'GB/s':>7}{'min-max':>12}{'s':>8}  {'per path (GB sent | Gbit/s)'}"
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    for label, runs in rows:
        g = [r.gbps for r in runs]
        s = median([r.seconds for r in runs])
        mid = sorted(runs, key=lambda r: r.gbps)[len(runs) // 2]
        if isinstance(mid, IperfRun):
            per = "/".join(f"{x:.2f}" for x in mid.stream_gbit) + " Gbit/s"
            per += f", retransmits {sum(mid.retransmits)}"
        else:
            per = f"{gb_list(mid.path_bytes)} GB, retries {mid.retries}, "
            per += f"hedges {sum(mid.path_hedges)}"
        print(f"  {label:<26}{median(g):>7.3f}{f'{min(g):.3f}-{max(g):.3f}':>12}{s:>8.3f}  {per}")


def result_line(emit: Emit, scenario: str, config: str, runs: list[Any], **extra: Any) -> None:
    emit(
        {
            "kind": "result",
            "scenario": scenario,
            "config": config,
            "gbps": round(median([r.gbps for r in runs]), 4),
            "seconds": round(median([r.seconds for r in runs]), 4),
            "samples": [asdict(r) | {"gbps": r.gbps} for r in runs],
            **extra,
        }
    )


# ---- scenarios ---------------------------------------------------------------------


@dataclass
class Ctx:
    args: argparse.Namespace
    rate_bps: int
    report: Report
    emit: Emit
    linkcut_plot: dict[str, Any] | None = None


def wait_budget(size: int, slowest_bps: int) -> float:
    """Seconds any one transfer of ``size`` may take: 4x its time on the slowest link alone."""
    return 4 * size * 8 / slowest_bps + 30


def scenario_aggregate(ctx: Ctx) -> None:
    a = ctx.args
    rate = kt.format_rate(ctx.rate_bps)
    wait_s = wait_budget(a.size, ctx.rate_bps)
    runs: dict[str, list[Any]] = {"iperf3": [], "k4": [], "k1": []}
    with kt.Testbed(links=4, rate=rate, tag=TAGS["aggregate"]) as tb:
        pair = Pair(tb, a.size, wait_s, a.kvlink_config)
        try:
            pair.add("k4", [0, 1, 2, 3], {})
            pair.add("k1", [0], {})
            for label in ("k4", "k1"):
                pair.warm(label)
            order = ["iperf3", "k4", "k1"]
            for it in range(a.iters):
                for c in order if it % 2 == 0 else order[::-1]:
                    if c == "iperf3":
                        r: Any = run_iperf3(tb, [a.size // 4] * 4, wait_s)
                    else:
                        r, _ = pair.run(c)
                    runs[c].append(r)
                    log(f"  aggregate iter {it + 1}/{a.iters} {c:<7} {r.gbps:.3f} GB/s")
        finally:
            pair.close()
    print_throughput(
        f"aggregate: 4 x {rate}, {fmt_size(a.size)}, medians of {a.iters} interleaved runs",
        [
            ("iperf3, 4 streams at once", runs["iperf3"]),
            ("kvlink, 4 paths", runs["k4"]),
            ("kvlink, 1 path (link 0)", runs["k1"]),
        ],
    )
    for c in runs:
        result_line(ctx.emit, "aggregate", c, runs[c], rate=rate)
    g = {c: median([r.gbps for r in rs]) for c, rs in runs.items()}
    pairs = list(zip(runs["k4"], runs["iperf3"], runs["k1"], strict=True))
    ctx.report.ratio(
        "aggregate", "kvlink4 / iperf3 sum", g["k4"] / g["iperf3"], ">=", 0.97,
        [k.gbps / i.gbps for k, i, _ in pairs],
    )  # fmt: skip
    ctx.report.ratio(
        "aggregate", "kvlink4 / kvlink1", g["k4"] / g["k1"], ">=", 3.8,
        [k.gbps / o.gbps for k, _, o in pairs],
    )  # fmt: skip


def scenario_hetero(ctx: Ctx) -> None:
    a = ctx.args
    top = ctx.rate_bps
    rates_bps = [top, top, top // 2, top // 4]
    rates = [kt.format_rate(r) for r in rates_bps]
    wait_s = wait_budget(a.size, rates_bps[-1])
    # bytes in proportion to each link's rate: the four streams end together
    share = [a.size * r // sum(rates_bps) // 8 * 8 for r in rates_bps]
    runs: dict[str, list[Any]] = {"iperf3": [], "ef": [], "rr": []}
    with kt.Testbed(links=4, rates=rates, tag=TAGS["hetero"]) as tb:
        pair = Pair(tb, a.size, wait_s, a.kvlink_config)
        try:
            pair.add("ef", [0, 1, 2, 3], {})
            pair.add("rr", [0, 1, 2, 3], {"scheduler": "round_robin"})
            for label in ("ef", "rr"):
                pair.warm(label)
            order = ["iperf3", "ef", "rr"]
            for it in range(a.iters):
                for c in order if it % 2 == 0 else order[::-1]:
                    if c == "iperf3":
                        r: Any = run_iperf3(tb, share, wait_s)
                    else:
                        r, _ = pair.run(c)
                    runs[c].append(r)
                    log(f"  hetero iter {it + 1}/{a.iters} {c:<7} {r.gbps:.3f} GB/s")
        finally:
            pair.close()
    print_throughput(
        f"hetero: links {', '.join(rates)}, {fmt_size(a.size)}, medians of {a.iters} "
        "interleaved runs",
        [
            ("iperf3, 4 streams at once", runs["iperf3"]),
            ("kvlink, earliest_finish", runs["ef"]),
            ("kvlink, round_robin", runs["rr"]),
        ],
    )
    for c in runs:
        result_line(ctx.emit, "hetero", c, runs[c], rates=rates)
    g = {c: median([r.gbps for r in rs]) for c, rs in runs.items()}
    ctx.report.ratio(
        "hetero", "kvlink earliest_finish / iperf3", g["ef"] / g["iperf3"], ">=", 0.95,
        [k.gbps / i.gbps for k, i in zip(runs["ef"], runs["iperf3"], strict=True)],
    )  # fmt: skip
    ctx.report.ratio(
        "hetero", "kvlink round_robin / iperf3", g["rr"] / g["iperf3"], None, None,
        [k.gbps / i.gbps for k, i in zip(runs["rr"], runs["iperf3"], strict=True)],
    )  # fmt: skip


def scenario_fault(ctx: Ctx, kind: str) -> None:
    """linkcut (link 1 down) or ratedrop (link 2 to RATE/10) at 30% of the clean time."""
    a = ctx.args
    rate = kt.format_rate(ctx.rate_bps)
    if kind == "linkcut":
        link, left_share, limit = 1, 3.0, 1.15
        action: tuple[Any, ...] = ("down", link)
        what = f"link {link} cut"
    else:
        slow = kt.format_rate(ctx.rate_bps // 10)
        link, left_share, limit = 2, 3.1, 1.10
        action = ("rate", link, slow)
        what = f"link {link} slowed to {slow}"
    factor = CUT_AT + (1 - CUT_AT) * 4 / left_share
    wait_s = wait_budget(a.size, ctx.rate_bps)
    clean: list[KvRun] = []
    faulted: list[KvRun] = []
    rows: list[dict[str, Any]] = []
    with kt.Testbed(links=4, rate=rate, tag=TAGS[kind]) as tb:
        pair = Pair(tb, a.size, wait_s, a.kvlink_config)
        try:
            pair.add("k4", [0, 1, 2, 3], {})
            pair.warm("k4")
            for it in range(a.iters):
                c, _ = pair.run("k4")
                clean.append(c)
                cut_after_s = CUT_AT * c.seconds
                sched: list[kt.FaultSchedule] = []

                def arm(
                    t_submit_ns: int,
                    cut_after_s: float = cut_after_s,
                    sched: list[kt.FaultSchedule] = sched,
                ) -> None:
                    # relative to the submit, not to now: the RPC took a moment
                    due = t_submit_ns / 1e9 + cut_after_s - time.monotonic()
                    fs = kt.FaultSchedule(tb, [(max(0.0, due), action)])
                    fs.start()
                    sched.append(fs)

                try:
                    f, w = pair.run("k4", on_submit=arm)
                finally:
                    for fs in sched:
                        fs.stop()
                        fs.join(30, raise_errors=False)
                fs = sched[0]
                fired = fs.fired
                if not fired or fired[0].error:
                    raise BenchError(f"{kind}: the fault did not fire: {fired}")
                fired_s = fired[0].fired_at
                t_sub = f.t_submit_ns / 1e9
                p = w["paths"][link]
                detect_s = None
                if kind == "linkcut" and p["t_down_ns"] / 1e9 > fired_s:
                    detect_s = p["t_down_ns"] / 1e9 - fired_s
                # restore, wait for the path, re-learn its rate
                if kind == "linkcut":
                    tb.link_up(link)
                    up_s, _ = pair.wait_path_up("k4", link)
                else:
                    tb.set_rate(link, rate)
                    up_s = 0.0
                rewarm_s = pair.warm("k4")
                ideal = c.seconds * factor
                row = {
                    "iter": it + 1,
                    "clean_s": c.seconds,
                    "total_s": f.seconds,
                    "ideal_s": ideal,
                    "ratio": f.seconds / ideal,
                    "fault_at_s": fired_s - t_sub,
                    "fault_done_s": fired[0].done_at - t_sub,
                    "detect_s": detect_s,
                    "t_down_s": (p["t_down_ns"] / 1e9 - t_sub) if p["t_down_ns"] else None,
                    "last_error": p["last_error"],
                    "state_after": p["state"],
                    "retries": f.retries,
                    "corrupt_bytes": f.corrupt_bytes + c.corrupt_bytes,
                    "path_bytes": f.path_bytes,
                    "path_hedges": f.path_hedges,
                    "est_gbps_after": f.path_est_gbps,
                    "path_up_again_s": up_s,
                    "rewarm_s": rewarm_s,
                }
                f.extra.update(row)
                rows.append(row)
                faulted.append(f)
                det = f"{detect_s * 1e3:.0f} ms" if detect_s is not None else "-"
                log(
                    f"  {kind} iter {it + 1}/{a.iters} clean {c.seconds:.3f} s, faulted "
                    f"{f.seconds:.3f} s (ideal {ideal:.3f}, x{f.seconds / ideal:.3f}), fault at "
                    f"{row['fault_at_s']:.3f} s, detection {det}, retries {f.retries}"
                )
                if kind == "linkcut":
                    w["fault_at_s"] = row["fault_at_s"]
                    w["t_down_s"] = row["t_down_s"]
                    w["ratio"] = row["ratio"]
                    w["iter"] = it + 1
                    rows[-1]["_events"] = w
        finally:
            pair.close()

    print(
        f"\n{kind}: 4 x {rate}, {fmt_size(a.size)}, {what} at {CUT_AT:.0%} of the clean time; "
        f"ideal = clean x ({CUT_AT} + {1 - CUT_AT:.1f} x 4/{left_share:g}) = clean x {factor:.4f}"
    )
    hdr = (
        f"  {'iter':<5}{'clean s':>8}{'total s':>8}{'ideal s':>8}{'ratio':>7}{'fault@':>7}"
        f"{'detect':>8}{'retries':>8}{'corrupt':>8}  per path GB sent (hedges)"
    )
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    for r in rows:
        det = f"{r['detect_s'] * 1e3:.0f}ms" if r["detect_s"] is not None else "-"
        print(
            f"  {r['iter']:<5}{r['clean_s']:>8.3f}{r['total_s']:>8.3f}{r['ideal_s']:>8.3f}"
            f"{r['ratio']:>7.3f}{r['fault_at_s']:>6.2f}s{det:>8}{r['retries']:>8}"
            f"{r['corrupt_bytes']:>8}  {gb_list(r['path_bytes'])} ({sum(r['path_hedges'])})"
        )
    med_clean = median([r.seconds for r in clean])
    med_total = median([r.seconds for r in faulted])
    print(
        f"  {'med':<5}{med_clean:>8.3f}{med_total:>8.3f}{med_clean * factor:>8.3f}"
        f"{med_total / (med_clean * factor):>7.3f}"
    )
    if rows:
        print(f"  path {link} after the fault: {rows[-1]['last_error'] or '-'}")
    result_line(ctx.emit, kind, "clean", clean, rate=rate)
    result_line(
        ctx.emit, kind, "faulted", faulted, rate=rate, fault=list(action), factor=factor,
        iterations=[{k: v for k, v in r.items() if k != "_events"} for r in rows],
    )  # fmt: skip
    ctx.report.ratio(
        kind, "total / ideal", med_total / (med_clean * factor), "<=", limit,
        [r["ratio"] for r in rows],
    )  # fmt: skip
    if kind == "linkcut":
        dets = [r["detect_s"] for r in rows if r["detect_s"] is not None]
        if len(dets) < len(rows):
            ctx.report.ratio(
                kind, "detection latency s", float("inf"), "<=", 0.3,
                note=f"path {link} never went down in {len(rows) - len(dets)} of {len(rows)} runs",
            )  # fmt: skip
        else:
            ctx.report.ratio(kind, "detection latency s", median(dets), "<=", 0.3, dets)
        # the plot shows the run with the median total time
        mid = sorted(rows, key=lambda r: r["total_s"])[len(rows) // 2]
        ctx.linkcut_plot = mid["_events"] | {"rate": rate, "size": a.size, "link": link}
        ctx.emit({"kind": "linkcut_events", **ctx.linkcut_plot})
    bad = sum(r["corrupt_bytes"] for r in rows)
    ctx.report.ratio(kind, "corrupt bytes (all runs)", bad, "<=", 0)


def scenario_kvlayers(ctx: Ctx) -> None:
    a = ctx.args
    rate = kt.format_rate(ctx.rate_bps)
    geo = kv_geometry(a.size)
    wait_s = wait_budget(a.size, ctx.rate_bps)
    runs: list[KvRun] = []
    firsts: list[float] = []
    with kt.Testbed(links=4, rate=rate, tag=TAGS["kvlayers"]) as tb:
        pair = Pair(tb, a.size, wait_s, a.kvlink_config)
        try:
            pair.add("k4", [0, 1, 2, 3], {})
            layout = pair.rx.call("layout", agent="rx-k4", key="dst", **geo)["layout"]
            pair.warm("k4")
            for it in range(a.iters):
                r, w = pair.run("k4", kv_layout=layout)
                ev = w["events"]
                t0 = w["t_submit_ns"]
                first = min(e[5] for e in ev if e[3] <= 0 < e[4])
                layer_done = [
                    min((e[5] for e in ev if e[3] <= lay < e[4]), default=0) for lay in range(32)
                ]
                r.extra.update(
                    first_layer_s=(first - t0) / 1e9,
                    layer_done_s=[round((t - t0) / 1e9, 4) for t in layer_done],
                    chunk_bytes=sorted({e[2] for e in ev}),
                )
                runs.append(r)
                firsts.append((first - t0) / 1e9)
                log(
                    f"  kvlayers iter {it + 1}/{a.iters} total {r.seconds:.3f} s, layer 0 at "
                    f"{firsts[-1] * 1e3:.0f} ms ({r.gbps:.3f} GB/s, {r.chunks} chunks)"
                )
        finally:
            pair.close()
    print(
        f"\nkvlayers: 4 x {rate}, {fmt_size(a.size)} paged KV cache: {geo['layers']} layers x "
        f"{geo['planes']} planes x {geo['num_blocks']} blocks of {KV_BLOCK_BYTES // 1024} KiB "
        f"({runs[0].extra['segments']} segments), medians of {a.iters}"
    )
    hdr = (
        f"  {'iter':<5}{'layer 0 s':>10}{'total s':>9}{'ratio':>8}{'GB/s':>7}{'chunks':>7}"
        f"{'chunk MiB':>10}{'corrupt':>8}"
    )
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    for i, r in enumerate(runs):
        cb = "/".join(f"{x / MiB:g}" for x in r.extra["chunk_bytes"])
        print(
            f"  {i + 1:<5}{firsts[i]:>10.3f}{r.seconds:>9.3f}{firsts[i] / r.seconds:>8.4f}"
            f"{r.gbps:>7.3f}{r.chunks:>7}{cb:>10}{r.corrupt_bytes:>8}"
        )
    result_line(ctx.emit, "kvlayers", "k4", runs, rate=rate, geometry=geo)
    med_first = median(firsts)
    med_total = median([r.seconds for r in runs])
    ctx.report.ratio(
        "kvlayers", "first layer / total", med_first / med_total, "<=", 2 / 32,
        [f / r.seconds for f, r in zip(firsts, runs, strict=True)],
        note=f"layer 0 after {med_first * 1e3:.0f} ms of {med_total:.3f} s",
    )  # fmt: skip
    ctx.report.ratio(
        "kvlayers", "corrupt bytes (all runs)", sum(r.corrupt_bytes for r in runs), "<=", 0
    )


# ---- the plot ----------------------------------------------------------------------


def plot_linkcut(data: dict[str, Any], out: Path) -> None:
    """Cumulative bytes verified per path over one link-cut push."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = data["t_submit_ns"]
    events = sorted(data["events"], key=lambda e: e[5])
    n_paths = len(data["paths"])
    t_end = (data["t_done_ns"] - t0) / 1e9
    fig, ax = plt.subplots(figsize=(9.5, 4.5), dpi=120)
    for p in range(n_paths):
        xs, ys, tot = [0.0], [0.0], 0
        for e in events:
            if e[1] == p:
                xs.append((e[5] - t0) / 1e9)
                tot += e[2]
                ys.append(tot / 1e9)
        xs.append(t_end)
        ys.append(tot / 1e9)
        # equal links draw the same staircase: markers keep each one visible
        ax.step(
            xs, ys, where="post", label=f"path {p} (link {p})", linewidth=1.6,
            marker="os^vD"[p % 5], markevery=list(range(1, len(xs) - 1)), markersize=5,
            markerfacecolor="none",
        )  # fmt: skip
    ax.axvline(data["fault_at_s"], color="red", linestyle="--", linewidth=1.2)
    ax.text(
        data["fault_at_s"], 0.98, f" link {data['link']} cut\n {data['fault_at_s']:.2f} s",
        transform=ax.get_xaxis_transform(), va="top", ha="left", color="red", fontsize=9,
    )  # fmt: skip
    if data.get("t_down_s") is not None and data["t_down_s"] >= data["fault_at_s"]:
        ax.axvline(data["t_down_s"], color="darkorange", linestyle=":", linewidth=1.5)
        det_ms = (data["t_down_s"] - data["fault_at_s"]) * 1e3
        ax.text(
            data["t_down_s"], 0.45, f" path {data['link']} marked down\n +{det_ms:.0f} ms",
            transform=ax.get_xaxis_transform(), va="top", ha="left", color="darkorange",
            fontsize=9,
        )  # fmt: skip
    ax.set_xlabel("seconds since submit")
    ax.set_ylabel("GB verified per path (1e9 bytes)")
    ax.set_title(
        f"kvlink push, {fmt_size(data['size'])} over 4 x {data['rate']}: link {data['link']} "
        f"cut mid-transfer\n(done in {t_end:.2f} s, {data['ratio']:.2f} x ideal; "
        "steps are chunks verified at the receiver)",
        fontsize=10,
    )
    ax.set_xlim(0, t_end * 1.02)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


# ---- main ----------------------------------------------------------------------------


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the with-blocks: testbeds come down


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rate", default="2gbit", help="rate of each link (the top rate in hetero)")
    ap.add_argument("--size", type=size_arg, default=2 * GiB, help="bytes per transfer (2GiB)")
    ap.add_argument("--iters", type=int, default=3, help="interleaved runs per configuration")
    ap.add_argument("--json", type=Path, help="write one JSON object per line here")
    ap.add_argument("--plot", type=Path, help="PNG of one link-cut run (needs matplotlib)")
    ap.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"subset of {','.join(SCENARIOS)}"
    )
    ap.add_argument(
        "--kvlink-config",
        type=json.loads,
        default={},
        metavar="JSON",
        help="kvlink Config overrides for every agent, e.g. '{\"chunk_bytes\": 16777216}' "
        "(defaults otherwise; the published figures use the defaults)",
    )
    ap.add_argument(
        "--plot-from",
        type=Path,
        metavar="JSONL",
        help="only redraw --plot from the linkcut_events line of an earlier --json file",
    )
    args = ap.parse_args(argv)
    share_run_secret()  # testbed agents listen on 198.18.x addresses
    if args.plot_from is not None:
        if args.plot is None:
            ap.error("--plot-from needs --plot (where to write the PNG)")
        with open(args.plot_from) as f:
            saved = [json.loads(ln) for ln in f if '"linkcut_events"' in ln]
        if not saved:
            ap.error(f"--plot-from: no linkcut_events line in {args.plot_from}")
        plot_linkcut(saved[-1], args.plot)
        print(f"plot: {args.plot}")
        return 0
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if bad := [s for s in args.scenarios if s not in SCENARIOS]:
        ap.error(f"--scenarios: unknown {bad}; choose from {','.join(SCENARIOS)}")
    if args.iters < 1:
        ap.error("--iters: at least 1")
    if args.size % 8 or args.size < 64 * MiB:
        ap.error("--size: at least 64MiB and a multiple of 8 bytes")
    try:
        rate_bps = kt.parse_rate(args.rate, name="--rate")
    except kt.TestbedConfigError as exc:
        ap.error(str(exc))
    ok, why = kt.is_available()
    if not ok:
        ap.error(why)
    if {"aggregate", "hetero"} & set(args.scenarios) and shutil.which("iperf3") is None:
        ap.error("iperf3 is not installed (apt-get install iperf3), or leave out aggregate,hetero")
    if args.plot is not None:
        if "linkcut" not in args.scenarios:
            ap.error("--plot draws a link-cut run: include linkcut in --scenarios")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib (pip install matplotlib)")
    if "kvlayers" in args.scenarios:
        try:
            kv_geometry(args.size)
        except BenchError as exc:
            ap.error(str(exc))

    signal.signal(signal.SIGTERM, _sigterm)
    jf = JsonLinesFile(args.json)
    emit = jf.emit

    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "kind": "meta",
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "utc": now.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "kvlink": kvlink.__version__,
        "iperf3": iperf3.version(),
        "rate": kt.format_rate(rate_bps),
        "tbf": asdict(kt.tbf_parameters(rate_bps)),
        "size_bytes": args.size,
        "iters": args.iters,
        "scenarios": args.scenarios,
        "kvlink_config": args.kvlink_config,
    }
    emit(meta)
    print(
        f"multinic: {meta['utc']} UTC, {fmt_size(args.size)}, {meta['rate']} per link, "
        f"{args.iters} iters, load average {' '.join(f'{x:.2f}' for x in meta['loadavg'])}"
        + (f", kvlink config {args.kvlink_config}" if args.kvlink_config else "")
    )
    ctx = Ctx(args=args, rate_bps=rate_bps, report=Report(emit), emit=emit)
    runners: dict[str, Callable[[Ctx], None]] = {
        "aggregate": scenario_aggregate,
        "hetero": scenario_hetero,
        "linkcut": lambda c: scenario_fault(c, "linkcut"),
        "ratedrop": lambda c: scenario_fault(c, "ratedrop"),
        "kvlayers": scenario_kvlayers,
    }
    try:
        for s in args.scenarios:
            t0 = time.monotonic()
            runners[s](ctx)
            log(f"  ({s}: {time.monotonic() - t0:.0f} s)")
        if args.plot is not None and ctx.linkcut_plot is not None:
            plot_linkcut(ctx.linkcut_plot, args.plot)
            print(f"\nplot: {args.plot}")
    finally:
        jf.close()
        left = sorted(ns for ns in kt._list_netns() if ns.startswith("kvlmn"))
        if left:
            log(f"warning: namespaces left behind: {left}")
    return 0 if all(ctx.report.passed) else 1


if __name__ == "__main__":
    sys.exit(main())
