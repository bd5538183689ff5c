"""kvlink vs iperf3 over loopback, side by side in one run.

    python bench/loopback.py [--size 1GiB] [--iters 3] [--json out.jsonl]
    python bench/loopback.py --chunk-sweep [--size 1GiB] [--iters 3]
    python bench/loopback.py --configs kvlink1 --iters 1 --perf /tmp/prof

Targets (the issue's acceptance criteria, checked as ratios of medians):
    kvlink 1 path  >= 0.9 x iperf3 single stream  (GB/s)
    kvlink 4 paths >= 0.9 x iperf3 -P 4           (GB/s)
    kvlink CPU s/GiB <= 1.3 x iperf3's            (both processes, same config)
    peak RSS of each kvlink process <= its registered memory + 64 MiB

How it measures:
  * kvlink: receiver and sender are two benchmark workers (kvlink.bench.worker), fresh for
    every iteration; buffers are allocated, filled or pre-faulted and
    registered, and the peer connected, before the clock starts.  Seconds are
    the sender's push() -> wait() return; CPU is getrusage(RUSAGE_SELF) deltas
    of both processes over the transfer (the receiver's from just before the
    push to its notification).  The received data is checked afterwards.
  * iperf3: ``iperf3 -s -1`` and ``iperf3 -c 127.0.0.1 -n SIZE [-P 4] --json``;
    GB/s from end.sum_received.bits_per_second; CPU from wait4() rusage of
    both processes, less the server's CPU before the client starts (what the
    client spends before its test starts is a few ms); peak RSS from VmHWM.
  * ``--perf DIR`` records both kvlink processes over the transfer only (and
    both iperf3 processes whole) with ``perf record -e cpu-clock -g`` and
    prints where the CPU went; the figures of such a run are not clean.
  * Configurations are interleaved, and the order flips every iteration,
    because this 2-core machine is noisy; medians are reported.
  * Softirq work done in a task's context is charged to that task (this kernel
    has no IRQ time accounting); what runs in ksoftirqd is charged to neither
    tool, so its CPU over the transfer is shown apart ("ksirqd").

GB/s are 1e9 bytes per second.  The JSON output has one object per line:
a "meta" line, one "result" line per table row and one "ratio" line per target.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvlink.bench import BenchError, iperf3
from kvlink.bench.measure import GiB, MiB, fmt_size, size_arg
from kvlink.bench.report import JsonLinesFile
from kvlink.bench.worker import Worker

CONFIGS = ("kvlink1", "iperf1", "kvlink4", "iperf4")


# ---- host accounting ---------------------------------------------------------


def _ksoftirqd_pids() -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as f:
                    if f.read().startswith("ksoftirqd/"):
                        pids.append(int(d))
            except OSError:
                pass
    return pids


_KSOFTIRQD = _ksoftirqd_pids()


def ksoftirqd_s() -> float:
    """CPU seconds the ksoftirqd threads have run, ns resolution.

    This kernel has no IRQ time accounting, so softirq work done in a task's
    context (most of the loopback receive path) is charged to that task; what
    overflows into ksoftirqd is charged to neither tool and shown apart."""
    total = 0
    for pid in _KSOFTIRQD:
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total / 1e9


# cpu-clock samples with call graphs, at a rate that is not a multiple of the tick
PERF_RECORD = ["perf", "record", "-q", "-e", "cpu-clock", "-F", "4999", "-g"]


class Perf:
    """``perf record`` attached to a running process (only the transfer)."""

    def __init__(self, pid: int, out: Path) -> None:
        self.out = out
        self.p = subprocess.Popen(
            [*PERF_RECORD, "-p", str(pid), "-o", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        self.p.send_signal(signal.SIGINT)
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


# Where perf's cpu-clock samples land, grouped for tuning.  Order matters: the
# first matching group wins.
_PERF_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("crc32c", ("vclmul_update", "hw_update", "sw_update", "hw_zeros", "kvl_crc32c")),
    ("kernel copy", ("_copy_from_iter", "_copy_to_iter", "copy_user", "rep_movs", "memcpy")),
    # hrtimer samples taken with interrupts off are delivered when they are
    # switched back on, so these names stand for "softirq / irq-off work".
    ("softirq/irq-off", ("handle_softirqs", "_raw_spin_unlock_irq", "__local_bh_enable")),
    (
        "scheduler, wakeups, epoll",
        (
            "finish_task_switch",
            "__schedule",
            "schedule_h",
            "schedule_t",
            "wake_up",
            "try_to_wake",
            "futex",
            "epoll",
            "ep_poll",
            "do_select",
            "core_sys_select",
            "pv_queued",
            "read_tsc",
        ),
    ),
    ("page alloc/free", ("page", "folio", "alloc", "free", "kmem_cache")),
    (
        "tcp/ip, skb, syscalls",
        (
            "tcp",
            "ip_",
            "skb",
            "sock",
            "net",
            "dev_",
            "sk_",
            "inet",
            "syscall",
            "entry_",
            "iov",
            "sendmsg",
            "recvmsg",
            "readv",
            "check_object",
            "virt_addr",
            "datagram",
        ),
    ),
]


def perf_summary(path: Path) -> list[tuple[str, float, str]]:
    """(group, ms, top symbols) from a perf.data file, biggest first."""
    text = subprocess.run(
        [
            "perf",
            "report",
            "-i",
            str(path),
            "--no-children",
            "-F",
            "period,dso,sym",
            "--stdio",
            "-g",
            "none",
            "-t",
            "|",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    groups: dict[str, float] = {}
    tops: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("#") or "|" not in line:
            continue
        period, dso, sym = (x.strip() for x in line.split("|", 2))
        name = sym.split("] ", 1)[-1]
        kernel = "[k]" in sym
        group = (
            "python interpreter"
            if "python" in dso
            else ("other kernel" if kernel else "other user space")
        )
        for g, keys in _PERF_GROUPS:
            if any(k in name for k in keys):
                group = g
                break
        ms = int(period) / 1e6
        groups[group] = groups.get(group, 0.0) + ms
        if len(tops.setdefault(group, [])) < 3:
            tops[group].append(name)
    return sorted(((g, ms, ", ".join(tops[g])) for g, ms in groups.items()), key=lambda x: -x[1])


def print_perf(perf_dir: Path) -> None:
    for f in sorted(perf_dir.glob("*.data")):
        rows = perf_summary(f)
        total = sum(ms for _, ms, _ in rows) or 1.0
        print(f"\nperf {f.name}: {total:.0f} ms sampled")
        for g, ms, top in rows:
            print(f"  {g:<28}{ms:>7.0f} ms {100 * ms / total:>5.1f}%  {top}")


@dataclass
class Sample:
    """One transfer."""

    tool: str
    op: str
    size_bytes: int
    paths: int
    seconds: float
    cpu_s: float
    cpu_tx_s: float
    cpu_rx_s: float
    sys_s: float  # of cpu_s, the kernel's share
    rss_tx_mib: float
    rss_rx_mib: float
    registered_tx_mib: float
    registered_rx_mib: float
    ksoftirqd_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.size_bytes / self.seconds / 1e9


def kvlink_config(chunk_bytes: int | None, min_chunk_bytes: int | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    if chunk_bytes is not None:
        cfg["chunk_bytes"] = chunk_bytes
    if min_chunk_bytes is not None:
        cfg["min_chunk_bytes"] = min_chunk_bytes
    return cfg


def run_kvlink(
    size: int,
    paths: int,
    *,
    config: dict[str, Any] | None = None,
    touch: bool = True,
    sizes: list[int] | None = None,
    reps: int = 1,
    warm: bool = False,
    perf_dir: Path | None = None,
    tag: str = "",
) -> list[Sample]:
    """One worker pair.  Pushes ``size`` bytes once (or each of ``sizes``,
    ``reps`` times each, then one Sample per size with the median time)."""
    nics = f"loopback:{paths}"
    config = config or {}
    todo = sizes or [size]
    region = max(todo)
    rx = Worker("kvlink-rx")
    tx = Worker("kvlink-tx")
    perfs: list[Perf] = []
    region = (region + 7) // 8 * 8
    try:
        # Both set up at once: filling and faulting 1 GiB takes a while.
        rx.send("agent", name="rx", nics=nics, config=config)
        tx.send("agent", name="tx", nics=nics, config=config)
        rxi = rx.recv(60)
        txi = tx.recv(60)
        rx.send("alloc", key="buf", nbytes=region, fill="zero" if touch else "none",
                remote_write=True, name="kv")  # fmt: skip
        tx.send("alloc", key="buf", nbytes=region, fill="pattern")
        rx_reg = rx.recv(300)
        rxi["registered_bytes"] = rx_reg["nbytes"]
        txi["registered_bytes"] = tx.recv(300)["nbytes"]
        tx.call("add_peer", metadata=rx_reg["metadata"])  # with the new region's access key
        if warm:
            tx.call("push", peer="rx", local="buf", remote="kv", nbytes=min(region, 64 * MiB),
                    wait=120)  # fmt: skip
        if perf_dir is not None:
            perf_dir.mkdir(parents=True, exist_ok=True)
            perfs = [
                Perf(w.pid, perf_dir / f"{tag or 'kvlink'}-{paths}p-{w.tag[-2:]}.data")
                for w in (tx, rx)
            ]
            time.sleep(1.0)  # perf needs a moment to attach
        out = []
        for nbytes in todo:
            rx.call("arm")
            k0 = ksoftirqd_s()
            pt = tx.call(
                "push_timed",
                answer_s=600,
                peer="rx",
                local="buf",
                remote="kv",
                nbytes=nbytes,
                reps=reps,
                notify=True,
                deadline_s=300,
            )
            col = rx.call("collect", answer_s=150, count=reps, timeout_s=120)
            out.append((nbytes, pt, col, ksoftirqd_s() - k0))
        for pf in perfs:
            pf.stop()
        perfs = []
        # Peak RSS before the check below, whose temporaries are the bench's.
        txm = tx.call("stats")
        rxm = rx.call("stats")
        ver = rx.call("verify", answer_s=300, key="buf", nbytes=max(todo))
        if ver["corrupt_bytes"]:
            raise BenchError(
                f"kvlink: received data is wrong: {ver['corrupt_bytes']} bytes, the first at "
                f"byte {ver['first_bad_offset']}"
            )
    finally:
        for pf in perfs:
            pf.stop()
        tx.close()
        rx.close()
    samples = []
    for nbytes, pt, col, ksirq in out:
        if pt["retries"] or len(pt["path_bytes"]) != len(pt["path_bytes_before"]):
            print(
                f"  warning: kvlink {paths} paths, {fmt_size(nbytes)}: {pt['retries']} retries; "
                f"paths before the push {pt['path_bytes_before']}, after {pt['path_bytes']} "
                f"{pt['paths_states']}",
                file=sys.stderr,
            )
        cpu_tx = pt["user_s"] + pt["sys_s"]
        cpu_rx = col["user_s"] + col["sys_s"]
        samples.append(
            Sample(
                tool="kvlink",
                op="push",
                size_bytes=nbytes,
                paths=paths,
                seconds=statistics.median(pt["times_s"]),
                # per transfer, so reps > 1 stays comparable
                cpu_s=(cpu_tx + cpu_rx) / reps,
                cpu_tx_s=cpu_tx / reps,
                cpu_rx_s=cpu_rx / reps,
                sys_s=(pt["sys_s"] + col["sys_s"]) / reps,
                # VmHWM, not ru_maxrss, which exec inherits from this script
                rss_tx_mib=txm["hwm_kib"] / 1024,
                rss_rx_mib=rxm["hwm_kib"] / 1024,
                registered_tx_mib=txi["registered_bytes"] / MiB,
                registered_rx_mib=rxi["registered_bytes"] / MiB,
                ksoftirqd_s=ksirq / reps,
                extra={
                    "config": config,
                    "touch": touch,
                    "reps": reps,
                    "times_s": pt["times_s"],
                    "chunks": pt["chunks_total"],
                    "retries": pt["retries"],
                    "path_bytes": pt["path_bytes"],
                    "path_bytes_before": pt["path_bytes_before"],
                    "paths_states": pt["paths_states"],
                    "rss_base_tx_mib": txi["rss_base_kib"] / 1024,
                    "rss_base_rx_mib": rxi["rss_base_kib"] / 1024,
                    "rss_agent_tx_mib": txi["rss_agent_kib"] / 1024,
                    "rss_agent_rx_mib": rxi["rss_agent_kib"] / 1024,
                },
            )
        )
    return samples


# ---- iperf3 ------------------------------------------------------------------


def run_iperf3(size: int, streams: int, perf_dir: Path | None = None) -> Sample:
    wrap_s: list[str] = []
    wrap_c: list[str] = []
    if perf_dir is not None:
        perf_dir.mkdir(parents=True, exist_ok=True)
        for wrap, side in ((wrap_s, "rx"), (wrap_c, "tx")):
            wrap += [*PERF_RECORD, "-o", str(perf_dir / f"iperf3-{streams}p-{side}.data"), "--"]
    k0 = ksoftirqd_s()
    (r,) = iperf3.run(
        [iperf3.Stream("127.0.0.1", nbytes=size, parallel=streams, server_prefix=wrap_s,
                       client_prefix=wrap_c)],
        timeout_s=300,
    )  # fmt: skip
    ksirq = ksoftirqd_s() - k0
    end = r.report["end"]
    return Sample(
        tool="iperf3",
        op="send",
        size_bytes=r.sent_bytes,
        paths=streams,
        seconds=r.seconds,
        cpu_s=r.cpu_client_s + r.cpu_server_s,
        cpu_tx_s=r.cpu_client_s,
        cpu_rx_s=r.cpu_server_s,
        sys_s=r.sys_s,
        rss_tx_mib=r.hwm_client_kib / 1024,
        rss_rx_mib=r.hwm_server_kib / 1024,
        registered_tx_mib=0.0,
        registered_rx_mib=0.0,
        ksoftirqd_s=ksirq,
        extra={
            "sum_received": end["sum_received"],
            "sum_sent": end["sum_sent"],
            "congestion": [end.get("sender_tcp_congestion"), end.get("receiver_tcp_congestion")],
            "iperf3_cpu_pct": end.get("cpu_utilization_percent", {}),
            "retransmits": r.retransmits,
        },
    )


# ---- summary -----------------------------------------------------------------


@dataclass
class Row:
    """The median of several Samples of one configuration."""

    label: str
    tool: str
    op: str
    size_bytes: int
    paths: int
    seconds: float
    gbps: float
    gbps_min: float
    gbps_max: float
    cpu_s: float
    cpu_s_per_gib: float
    cpu_tx_s: float
    cpu_rx_s: float
    sys_share: float
    rss_tx_mib: float
    rss_rx_mib: float
    registered_mib: float
    rss_overhead_mib: float  # max over both processes of peak RSS - registered
    ksoftirqd_s: float
    n: int
    samples_gbps: list[float]
    samples_cpu_s: list[float]
    extra: dict[str, Any] = field(default_factory=dict)


def summarise(label: str, samples: list[Sample], **extra: Any) -> Row:
    med = statistics.median
    s0 = samples[0]
    gb = [s.gbps for s in samples]
    cpu = med([s.cpu_s for s in samples])
    size = med([s.size_bytes for s in samples])
    return Row(
        label=label,
        tool=s0.tool,
        op=s0.op,
        size_bytes=int(size),
        paths=s0.paths,
        seconds=med([s.seconds for s in samples]),
        gbps=med(gb),
        gbps_min=min(gb),
        gbps_max=max(gb),
        cpu_s=cpu,
        cpu_s_per_gib=med([s.cpu_s / (s.size_bytes / GiB) for s in samples]),
        cpu_tx_s=med([s.cpu_tx_s for s in samples]),
        cpu_rx_s=med([s.cpu_rx_s for s in samples]),
        sys_share=med([s.sys_s / s.cpu_s for s in samples if s.cpu_s > 0] or [0.0]),
        rss_tx_mib=max(s.rss_tx_mib for s in samples),
        rss_rx_mib=max(s.rss_rx_mib for s in samples),
        registered_mib=max(s.registered_rx_mib for s in samples),
        rss_overhead_mib=max(
            max(s.rss_tx_mib - s.registered_tx_mib, s.rss_rx_mib - s.registered_rx_mib)
            for s in samples
        ),
        ksoftirqd_s=med([s.ksoftirqd_s for s in samples]),
        n=len(samples),
        samples_gbps=gb,
        samples_cpu_s=[s.cpu_s for s in samples],
        extra=extra,
    )


def print_rows(rows: list[Row], title: str) -> None:
    print(f"\n{title}")
    hdr = (
        f"{'config':<22}{'size':>7}{'GB/s':>7}{'min-max':>12}{'s':>7}{'cpu s':>7}"
        f"{'s/GiB':>7}{'tx':>6}{'rx':>6}{'sys%':>5}{'ksirqd':>7}{'RSS tx':>8}{'RSS rx':>8}"
        f"{'reg':>6}{'ovh':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r.label:<22}{fmt_size(r.size_bytes):>7}{r.gbps:>7.2f}"
            f"{f'{r.gbps_min:.2f}-{r.gbps_max:.2f}':>12}{r.seconds:>7.3f}{r.cpu_s:>7.3f}"
            f"{r.cpu_s_per_gib:>7.3f}{r.cpu_tx_s:>6.2f}{r.cpu_rx_s:>6.2f}"
            f"{100 * r.sys_share:>5.0f}{r.ksoftirqd_s:>7.3f}{r.rss_tx_mib:>8.0f}"
            f"{r.rss_rx_mib:>8.0f}{r.registered_mib:>6.0f}{r.rss_overhead_mib:>6.0f}"
        )
    print(
        "(GB/s = 1e9 B/s; cpu s = both processes, per transfer; tx/rx = each process; "
        "sys% = kernel share;\n ksirqd = CPU s of ksoftirqd (charged to neither); "
        "RSS = peak MiB; ovh = max(peak RSS - registered), MiB)"
    )


def ratio_lines(rows: dict[str, Row], paired: dict[str, list[float]]) -> list[dict[str, Any]]:
    out = []

    def add(name: str, value: float, op: str, target: float, note: str = "") -> None:
        ok = value >= target if op == ">=" else value <= target
        line = {
            "kind": "ratio",
            "ratio": name,
            "value": round(value, 4),
            "target": f"{op} {target}",
            "pass": ok,
        }
        if name in paired:
            line["paired_median"] = round(statistics.median(paired[name]), 4)
            line["paired"] = [round(x, 4) for x in paired[name]]
        if note:
            line["note"] = note
        out.append(line)

    for kv, ip, name in (
        ("kvlink1", "iperf1", "kvlink_1path/iperf3_1stream"),
        ("kvlink4", "iperf4", "kvlink_4path/iperf3_P4"),
    ):
        if kv in rows and ip in rows:
            add(name, rows[kv].gbps / rows[ip].gbps, ">=", 0.9)
    for kv, ip, name in (
        ("kvlink1", "iperf1", "cpu_per_gib kvlink_1path/iperf3_1stream"),
        ("kvlink4", "iperf4", "cpu_per_gib kvlink_4path/iperf3_P4"),
    ):
        if kv in rows and ip in rows:
            add(name, rows[kv].cpu_s_per_gib / rows[ip].cpu_s_per_gib, "<=", 1.3)
    for kv in ("kvlink1", "kvlink4"):
        if kv in rows:
            r = rows[kv]
            add(
                f"rss_overhead_mib {kv}",
                r.rss_overhead_mib,
                "<=",
                64,
                f"tx peak {r.rss_tx_mib:.0f} MiB, rx peak {r.rss_rx_mib:.0f} MiB, "
                f"registered {r.registered_mib:.0f} MiB each; before the agent existed the "
                f"workers had {r.extra['rss_base_mib']:.0f} MiB (interpreter + numpy + kvlink)",
            )
    return out


def print_ratios(lines: list[dict[str, Any]]) -> None:
    print()
    for ln in lines:
        extra = f"  (paired median {ln['paired_median']:.3f})" if "paired_median" in ln else ""
        note = f"  [{ln['note']}]" if "note" in ln else ""
        print(
            f"{ln['ratio']:<42}{ln['value']:>9.3f}  target {ln['target']:<7} "
            f"{'PASS' if ln['pass'] else 'FAIL'}{extra}{note}"
        )


# ---- scenarios ---------------------------------------------------------------


def compare(args: argparse.Namespace, emit: Any) -> int:
    configs = [c for c in CONFIGS if c in args.configs]
    samples: dict[str, list[Sample]] = {c: [] for c in configs}
    config = kvlink_config(args.chunk_bytes, args.min_chunk_bytes)
    for i in range(args.iters):
        order = configs if i % 2 == 0 else configs[::-1]
        for c in order:
            n = int(c[-1])
            if c.startswith("kvlink"):
                s = run_kvlink(
                    args.size,
                    n,
                    config=config,
                    touch=not args.no_touch,
                    perf_dir=args.perf,
                    tag=f"kvlink-it{i}",
                )[0]
            else:
                s = run_iperf3(args.size, n, perf_dir=args.perf)
            samples[c].append(s)
            print(
                f"  iter {i + 1}/{args.iters} {c:<8} {s.gbps:6.2f} GB/s  "
                f"cpu {s.cpu_s:.3f} s (tx {s.cpu_tx_s:.3f} rx {s.cpu_rx_s:.3f})  "
                f"ksoftirqd {s.ksoftirqd_s:.3f} s",
                file=sys.stderr,
                flush=True,
            )
    names = {
        "kvlink1": "kvlink 1 path",
        "iperf1": "iperf3 1 stream",
        "kvlink4": "kvlink 4 paths",
        "iperf4": "iperf3 -P 4",
    }
    rows = {c: summarise(names[c], samples[c]) for c in configs}
    for c, r in rows.items():
        if c.startswith("kvlink"):
            r.extra["rss_base_mib"] = max(
                max(s.extra["rss_base_tx_mib"], s.extra["rss_base_rx_mib"]) for s in samples[c]
            )
    paired: dict[str, list[float]] = {}
    for kv, ip, name in (
        ("kvlink1", "iperf1", "kvlink_1path/iperf3_1stream"),
        ("kvlink4", "iperf4", "kvlink_4path/iperf3_P4"),
    ):
        if kv in samples and ip in samples:
            paired[name] = [a.gbps / b.gbps for a, b in zip(samples[kv], samples[ip], strict=True)]
    print_rows(
        list(rows.values()),
        f"loopback push, {fmt_size(args.size)}, medians of {args.iters} interleaved runs",
    )
    lines = ratio_lines(rows, paired)
    print_ratios(lines)
    for c, r in rows.items():
        emit(
            {"kind": "result", "config": c, **asdict(r), "samples": [asdict(s) for s in samples[c]]}
        )
    for ln in lines:
        emit(ln)
    return 0 if all(ln["pass"] for ln in lines) else 1


def chunk_sweep(args: argparse.Namespace, emit: Any) -> int:
    """Part 1: chunk size at --size over 4 paths (min_chunk_bytes = chunk_bytes
    pins the chunk size).  Part 2: the min-chunk floor, which only binds for
    transfers smaller than paths x 4 x floor: small pushes, many reps each."""
    chunks = args.sweep_chunks
    floors = args.sweep_floors
    small = args.sweep_sizes
    part1: dict[int, list[Sample]] = {c: [] for c in chunks}
    part2: dict[tuple[int, int], list[Sample]] = {(f, s): [] for f in floors for s in small}
    for i in range(args.iters):
        order = chunks if i % 2 == 0 else chunks[::-1]
        for c in order:
            s = run_kvlink(args.size, 4, config=kvlink_config(c, c), touch=not args.no_touch)[0]
            part1[c].append(s)
            print(
                f"  iter {i + 1}/{args.iters} chunk {fmt_size(c):>7} {s.gbps:6.2f} GB/s "
                f"({s.extra['chunks']} chunks) cpu {s.cpu_s:.3f} s",
                file=sys.stderr,
                flush=True,
            )
        forder = floors if i % 2 == 0 else floors[::-1]
        for f in forder:
            got = run_kvlink(
                max(small),
                4,
                config=kvlink_config(None, f),
                sizes=small,
                reps=args.sweep_reps,
                warm=True,
            )
            for s in got:
                part2[(f, s.size_bytes)].append(s)
                print(
                    f"  iter {i + 1}/{args.iters} floor {fmt_size(f):>7} size "
                    f"{fmt_size(s.size_bytes):>7} {s.gbps:6.2f} GB/s ({s.extra['chunks']} "
                    f"chunks)",
                    file=sys.stderr,
                    flush=True,
                )
    rows1 = []
    for c in chunks:
        r = summarise(
            f"chunk {fmt_size(c)} ({part1[c][0].extra['chunks']} ch)",
            part1[c],
            chunk_bytes=c,
            min_chunk_bytes=c,
        )
        rows1.append(r)
        emit(
            {
                "kind": "result",
                "sweep": "chunk_bytes",
                "chunk_bytes": c,
                "min_chunk_bytes": c,
                "chunks": part1[c][0].extra["chunks"],
                **asdict(r),
                "samples": [asdict(x) for x in part1[c]],
            }
        )
    print_rows(
        rows1,
        f"chunk-size sweep: kvlink 4 paths, {fmt_size(args.size)} push, "
        f"min_chunk_bytes = chunk_bytes, medians of {args.iters}",
    )
    print(
        f"\nmin-chunk floor sweep: kvlink 4 paths, chunk_bytes 64MiB, warm connections, "
        f"median push time of {args.sweep_reps} reps x {args.iters} runs; GB/s (chunks)"
    )
    print(f"{'size':>8}" + "".join(f"{'floor ' + fmt_size(f):>18}" for f in floors))
    for sz in small:
        cells = []
        for f in floors:
            ss = part2[(f, sz)]
            t = statistics.median([x for s in ss for x in s.extra["times_s"]])
            cpu = statistics.median([s.cpu_s for s in ss])
            ch = ss[0].extra["chunks"]
            cells.append(f"{sz / t / 1e9:>8.2f} ({ch:>3})    ")
            emit(
                {
                    "kind": "result",
                    "sweep": "min_chunk_bytes",
                    "tool": "kvlink",
                    "op": "push",
                    "paths": 4,
                    "size_bytes": sz,
                    "chunk_bytes": 64 * MiB,
                    "min_chunk_bytes": f,
                    "chunks": ch,
                    "seconds": t,
                    "gbps": sz / t / 1e9,
                    "cpu_s": cpu,
                    "cpu_s_per_gib": cpu / (sz / GiB),
                    "reps": args.sweep_reps,
                    "iters": args.iters,
                }
            )
        print(f"{fmt_size(sz):>8}" + "".join(f"{c:>18}" for c in cells))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=size_arg, default=GiB, help="bytes per transfer (1GiB)")
    ap.add_argument("--iters", type=int, default=3, help="interleaved runs per configuration")
    ap.add_argument("--json", type=Path, help="write one JSON object per line here")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument("--chunk-bytes", type=size_arg, help="kvlink Config.chunk_bytes")
    ap.add_argument("--min-chunk-bytes", type=size_arg, help="kvlink Config.min_chunk_bytes")
    ap.add_argument(
        "--no-touch",
        action="store_true",
        help="do not pre-fault the receiver's buffer (first-touch faults in the transfer)",
    )
    ap.add_argument(
        "--perf",
        type=Path,
        metavar="DIR",
        help="perf record each process into DIR (numbers are then not clean)",
    )
    ap.add_argument(
        "--chunk-sweep",
        action="store_true",
        help="kvlink 4 paths: chunk_bytes and min_chunk_bytes sweeps instead",
    )
    ap.add_argument(
        "--sweep-chunks",
        type=lambda t: [size_arg(x) for x in t.split(",")],
        help="chunk sizes of the chunk sweep (1MiB,4MiB,16MiB,64MiB)",
        default=[1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB],
    )
    ap.add_argument(
        "--sweep-floors",
        type=lambda t: [size_arg(x) for x in t.split(",")],
        help="min_chunk_bytes values of the floor sweep (64KiB,256KiB,1MiB,4MiB)",
        default=[64 << 10, 256 << 10, 1 * MiB, 4 * MiB],
    )
    ap.add_argument(
        "--sweep-sizes",
        type=lambda t: [size_arg(x) for x in t.split(",")],
        help="transfer sizes of the floor sweep (4MiB,16MiB,64MiB)",
        default=[4 * MiB, 16 * MiB, 64 * MiB],
    )
    ap.add_argument("--sweep-reps", type=int, default=20, help="pushes per size in the floor sweep")
    args = ap.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",")]
    if bad := [c for c in args.configs if c not in CONFIGS]:
        ap.error(f"--configs: unknown {bad}; choose from {','.join(CONFIGS)}")
    if args.iters < 1:
        ap.error("--iters: at least 1")
    wants_iperf = not args.chunk_sweep and any(c.startswith("iperf") for c in args.configs)
    if wants_iperf and shutil.which("iperf3") is None:
        ap.error("iperf3 is not installed (apt-get install iperf3), or leave it out: --configs")
    if args.perf is not None and shutil.which("perf") is None:
        ap.error("--perf: perf is not installed (apt-get install linux-perf)")

    jf = JsonLinesFile(args.json)
    emit = jf.emit

    import kvlink

    emit(
        {
            "kind": "meta",
            "argv": sys.argv,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "kvlink": kvlink.__version__,
            "iperf3": iperf3.version(),
            "loadavg": os.getloadavg(),
        }
    )
    try:
        rc = chunk_sweep(args, emit) if args.chunk_sweep else compare(args, emit)
        if args.perf is not None:
            print_perf(args.perf)
        return rc
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        jf.close()


if __name__ == "__main__":
    sys.exit(main())
