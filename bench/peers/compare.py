"""kvlink against peer libraries: the same 1 GiB host-memory write between two processes.

    python bench/peers/compare.py --where loopback|testbed|both [--size 1GiB] [--iters 3]
                                  [--peers mooncake,nixl,ucxx,iperf3] [--json out.jsonl]

Install the peers first: ``bash bench/peers/setup.sh`` (one virtual environment per peer under
bench/peers/.venvs/). A peer that is not installed, does not import or fails to run is still a
row of the table, with the reason. The testbed needs root (it builds the ``kvlpc*``
namespaces: 4 veth links with tbf at 2gbit on both ends, removed at the end).

Targets (the issue's; each checked on the ratio of medians, paired per-iteration medians
shown beside):
    loopback  kvlink / Mooncake TCP >= 1.5   kvlink / NIXL-UCX >= 1.5   kvlink / iperf3 >= 0.9
    testbed   kvlink / NIXL-UCX >= 1.8       kvlink / Mooncake TCP >= 3.5
              kvlink / iperf3 >= 0.97
ucxx is measured and its ratio printed, with no target.

What runs (every tool in two fresh processes per run; on the testbed the writer is in
namespace a and the target in namespace b):
  * kvlink: kvlink.bench.Worker agents, nics ``loopback:4`` on
    loopback (kvlink's way to open several TCP paths on one host) or the side's four testbed
    addresses. Seconds are the engine's t_done - t_submit (t_done: the last chunk's verified
    acknowledgement came back). Both buffers are checked with blake2b afterwards.
  * mooncake / nixl / ucxx: bench/peers/<peer>_worker.py in the peer's venv (see each
    worker's docstring for the API calls and for how it was given the links). Seconds run
    from the initiator starting the write to the target knowing the data is in its memory
    (nixl: the WRITE's notification arrives; ucxx: its receive completes). Mooncake's public
    API gives the target no such signal, so its clock ends when transfer_sync_write returns
    (by then its last few MB may still be in socket buffers: under 1% of 1 GiB). The
    target's buffer is checked word by word afterwards.
  * iperf3: loopback ``-n SIZE``, one stream; testbed one stream per link (SIZE/4 each), all
    four at once, seconds = the longest stream's bytes / receiver-side rate.
  * Every tool's first write is an untimed warm-up of min(SIZE, 256 MiB) in the same
    processes (connections, lanes, kvlink's path estimates); iperf3 has none. Every timed
    write starts after 1 s of quiet (kvlink's NIC monitor counts earlier traffic as load).
  * CPU s: both processes over the timed write (peers: getrusage in the workers; kvlink:
    /proc/PID/stat; iperf3: wait4 of client and server, whole runs). Softirq work that runs in
    ksoftirqd is charged to no tool.
  * Device byte counters around each timed write: "wire" is the bytes sent over the payload
    (about 1.0 for TCP; near 0 would mean shared memory; on loopback the counter is the
    host's lo, which other work shares); "links" is how many of the four testbed veths (side
    a) carried at least 5% of the bytes.
  * Tools are interleaved, order reversed every iteration (A/B/A/B); medians reported. A tool
    that fails stops being run in that place and keeps its row, with the reason.
  * Contrast rows, only when named in ``--peers``: ``nixl-defrails`` (NIXL with the four
    devices named but UCX's default rail limits), ``nixl-spin`` (NIXL polling
    check_xfer_state without sleeping, as its examples do) and ``kvlink-1path`` (kvlink over
    one TCP connection: loopback:1, or link 0 of the testbed).

GB/s are 1e9 bytes per second. The JSON output has one object per line: a "meta" line, one
"run" (or "failure") line per run, one "summary" per tool and place, one "ratio" per peer.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VENVS = HERE / ".venvs"


def _reexec_with_kvlink_venv() -> None:
    """The issue's command is `python bench/peers/compare.py`: use the venv kvlink lives in."""
    try:
        import kvlink  # noqa: F401
    except ImportError:
        py = ROOT / ".venv" / "bin" / "python"
        # Compare prefixes, not interpreters: a venv's python is a symlink to the base one.
        if py.exists() and Path(sys.prefix).resolve() != py.parent.parent.resolve():
            os.execv(str(py), [str(py), *sys.argv])
        raise


if __name__ == "__main__":
    _reexec_with_kvlink_venv()

from kvlink.bench import BenchError, iperf3  # noqa: E402
from kvlink.bench import peers as _peers  # noqa: E402
from kvlink.bench.measure import GiB, MiB, fmt_size, median, proc_cpu_s, size_arg  # noqa: E402
from kvlink.bench.peers import (  # noqa: E402
    PEER_VARIANTS,
    PEERS,
    QUIET_S,
    WARM_BYTES,
    PeerError,
    PeerUnavailable,
    Run,
    TestbedWhere,
    Where,
    transfer_timeout_s,
)
from kvlink.bench.report import JsonLinesFile  # noqa: E402
from kvlink.bench.worker import Worker  # noqa: E402

# Contrast rows, run only when named in --peers: kvlink's own is kvlink-1path, kvlink with one
# address per side, so one TCP connection (like the peers on loopback; on the testbed, one
# link); the NIXL ones are described in kvlink/bench/peers.py.
VARIANTS = (*PEER_VARIANTS, "kvlink-1path")
TOOLS = ("kvlink", *PEERS, *VARIANTS, "iperf3")
LABEL = {
    "kvlink": "kvlink",
    "mooncake": "Mooncake TE (TCP)",
    "nixl": "NIXL (UCX, TCP)",
    "nixl-defrails": "NIXL, default rails",
    "nixl-spin": "NIXL, spin polling",
    "kvlink-1path": "kvlink, 1 path",
    "ucxx": "ucxx (UCX, TCP)",
    "iperf3": "iperf3",
}
# (where, peer, minimum of kvlink GB/s / peer GB/s); peers absent here get a ratio, no target.
TARGETS: dict[tuple[str, str], float] = {
    ("loopback", "mooncake"): 1.5,
    ("loopback", "nixl"): 1.5,
    ("loopback", "iperf3"): 0.9,
    ("testbed", "nixl"): 1.8,
    ("testbed", "mooncake"): 3.5,
    ("testbed", "iperf3"): 0.97,
}
TB_LINKS, TB_RATE, TB_TAG = 4, "2gbit", "pc"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_peer(peer: str, where: Where, size: int, it: int) -> Run:
    return _peers.run_peer(HERE, peer, where, size, it)


# ---- kvlink ----------------------------------------------------------------------------


def run_kvlink(where: Where, size: int, it: int, one_path: bool = False) -> Run:
    procs: list[Worker] = []
    try:
        nics = {side: where.kvlink_nics(side, one_path) for side in "ab"}
        rx = Worker(f"rx{it}", name=f"rx{it}", nics=nics["b"], prefix=where.prefix("b"))
        procs.append(rx)
        tx = Worker(f"tx{it}", name=f"tx{it}", nics=nics["a"], prefix=where.prefix("a"))
        procs.append(tx)
        # Both at once: generating and registering 1 GiB takes seconds in each process.
        rx.send("alloc", key="dst", nbytes=size, remote_write=True, name="kv")
        tx.send("alloc", key="src", nbytes=size, seed=it + 1)
        rx.recv(300)
        tx.recv(300)
        peer = tx.call("add_peer", metadata=rx.metadata.decode())["peer"]
        wait_s = transfer_timeout_s(size)
        sub = tx.call("push", peer=peer, local="src", remote="kv", nbytes=min(size, WARM_BYTES))
        w = tx.call("wait", answer_s=wait_s + 30, id=sub["id"], wait_s=wait_s)
        warm_s = (w["t_done_ns"] - w["t_submit_ns"]) / 1e9
        time.sleep(QUIET_S)
        links0 = where.link_tx_bytes()
        c0 = [proc_cpu_s(p.pid) for p in (tx, rx)]
        sub = tx.call("push", peer=peer, local="src", remote="kv")
        w = tx.call("wait", answer_s=wait_s + 30, id=sub["id"], wait_s=wait_s)
        c1 = [proc_cpu_s(p.pid) for p in (tx, rx)]
        links1 = where.link_tx_bytes()
        # Both digests at once (blake2b of 1 GiB takes about a second each).
        tx.send("digest", key="src")
        rx.send("digest", key="dst")
        digests = [tx.recv(300)["digest"], rx.recv(300)["digest"]]
        return Run(
            tool="kvlink-1path" if one_path else "kvlink",
            where=where.name,
            iteration=it,
            size_bytes=size,
            seconds=(w["t_done_ns"] - w["t_submit_ns"]) / 1e9,
            cpu_s=(c1[0] - c0[0]) + (c1[1] - c0[1]),
            cpu_tx_s=c1[0] - c0[0],
            cpu_rx_s=c1[1] - c0[1],
            verified=digests[0] == digests[1],
            warm_s=warm_s,
            link_bytes=[b - a for a, b in zip(links0, links1, strict=True)],
            extra={"retries": w.get("retries"), "chunks": w.get("chunks"),
                   "nics_a": nics["a"]},
        )  # fmt: skip
    finally:
        for p in reversed(procs):
            p.close()


# ---- iperf3 ----------------------------------------------------------------------------


def run_iperf3(where: Where, size: int, it: int) -> Run:
    if not iperf3.available():
        raise PeerUnavailable(f"iperf3 is not installed ({iperf3.INSTALL_HINT})")
    tb = getattr(where, "tb", None)
    n = 1 if tb is None else tb.links
    each = [size // n + (1 if i < size % n else 0) for i in range(n)]
    streams = [
        iperf3.Stream(
            "127.0.0.1" if tb is None else tb.address("b", i),
            None if tb is None else tb.address("a", i),
            nbytes=each[i], server_prefix=where.prefix("b"), client_prefix=where.prefix("a"),
        )
        for i in range(n)
    ]  # fmt: skip
    time.sleep(QUIET_S)
    links0 = where.link_tx_bytes()
    res = iperf3.run(streams, timeout_s=transfer_timeout_s(size))
    links1 = where.link_tx_bytes()
    cpu_tx = sum(r.cpu_client_s for r in res)
    cpu_rx = sum(r.cpu_server_s for r in res)
    secs = [r.seconds for r in res]
    return Run(
        tool="iperf3",
        where=where.name,
        iteration=it,
        size_bytes=sum(r.sent_bytes for r in res),
        seconds=max(secs),
        cpu_s=cpu_tx + cpu_rx,
        cpu_tx_s=cpu_tx,
        cpu_rx_s=cpu_rx,
        verified=True,  # nothing to check: iperf3 sends one buffer over and over
        link_bytes=[b - a for a, b in zip(links0, links1, strict=True)],
        extra={
            "streams": n,
            "stream_gbit": [r.received_bps / 1e9 for r in res],
            "retransmits": [r.retransmits for r in res],
        },
    )


# ---- the loop --------------------------------------------------------------------------


@dataclass
class Outcome:
    runs: list[Run] = field(default_factory=list)
    failure: str | None = None  # why the tool has no (more) runs


def run_tool(tool: str, where: Where, size: int, it: int) -> Run:
    if tool in ("kvlink", "kvlink-1path"):
        return run_kvlink(where, size, it, one_path=tool == "kvlink-1path")
    if tool == "iperf3":
        return run_iperf3(where, size, it)
    return run_peer(tool, where, size, it)


def measure(
    where: Where, tools: list[str], size: int, iters: int, emit: Callable[[dict[str, Any]], None]
) -> dict[str, Outcome]:
    out = {t: Outcome() for t in tools}
    for it in range(iters):
        order = tools if it % 2 == 0 else tools[::-1]
        for tool in order:
            o = out[tool]
            if o.failure:
                continue
            log(f"[{where.name}] iteration {it + 1}/{iters}: {tool}")
            try:
                run = run_tool(tool, where, size, it)
            except Exception as exc:  # any failure of one tool is a row with its reason
                o.failure = (
                    str(exc)
                    if isinstance(exc, (BenchError, PeerError))
                    else f"{type(exc).__name__}: {exc}"
                )
                log(f"[{where.name}] {tool} FAILED: {o.failure}")
                emit({"kind": "failure", "tool": tool, "where": where.name, "iteration": it,
                      "reason": o.failure})  # fmt: skip
                continue
            o.runs.append(run)
            emit(run.as_dict())
            used = run.links_used()
            log(
                f"[{where.name}] {tool}: {run.gbps:.3f} GB/s, {run.seconds:.3f} s, "
                f"CPU {run.cpu_s:.2f} s, verified {run.verified}"
                + ("" if used is None else f", links used {used} {run.link_bytes}")
            )
            if not run.verified:
                o.failure = f"data check failed in iteration {it + 1} ({run.extra})"
    return out


@contextlib.contextmanager
def testbed_where() -> Iterator[TestbedWhere]:
    import kvlink.testbed as kt

    ok, why = kt.is_available()
    if not ok:
        raise BenchError(f"testbed unavailable: {why}")
    with kt.Testbed(links=TB_LINKS, rate=TB_RATE, tag=TB_TAG) as tb:
        yield TestbedWhere(tb)


# ---- report ----------------------------------------------------------------------------


def short_reason(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else text
    return first if len(first) <= 110 else first[:107] + "..."


def print_table(where: str, out: dict[str, Outcome]) -> None:
    print(f"\n{where}:")
    head = (
        f"{'tool':<20} {'GB/s':>7} {'min-max':>13} {'s':>7} {'CPU s':>6} {'wire':>5} "
        f"{'links':>5}  note"
    )
    print(head)
    print("-" * len(head))
    for tool, o in out.items():
        if not o.runs:
            print(f"{LABEL[tool]:<20} {'-':>7} {'-':>13} {'-':>7} {'-':>6} {'-':>5} {'-':>5}  "
                  f"cannot run: {short_reason(o.failure or 'no runs')}")  # fmt: skip
            continue
        g = [r.gbps for r in o.runs]
        used = sorted({u for r in o.runs if (u := r.links_used()) is not None})
        links = "/".join(str(u) for u in used) or "-"
        note = f"{len(o.runs)} runs"
        if o.failure:
            note += f"; then failed: {short_reason(o.failure)}"
        if not all(r.verified for r in o.runs):
            note += "; DATA CHECK FAILED"
        print(
            f"{LABEL[tool]:<20} {median(g):>7.3f} {min(g):>6.3f}-{max(g):<6.3f} "
            f"{median([r.seconds for r in o.runs]):>7.3f} "
            f"{median([r.cpu_s for r in o.runs]):>6.2f} "
            f"{median([r.wire_ratio() or 0.0 for r in o.runs]):>5.2f} {links:>5}  {note}"
        )


def ratios(
    where: str, out: dict[str, Outcome], emit: Callable[[dict[str, Any]], None]
) -> list[bool]:
    kv = out.get("kvlink")
    print(f"\n{where}: kvlink / peer (GB/s, ratio of medians; paired = median of per-iteration "
          "ratios)")  # fmt: skip
    verdicts = []
    for tool, o in out.items():
        if tool == "kvlink":
            continue
        target = TARGETS.get((where, tool))
        want = f">= {target}" if target is not None else "(no target)"
        if not kv or not kv.runs or not o.runs:
            who = "kvlink" if not kv or not kv.runs else LABEL[tool]
            why = (kv.failure if who == "kvlink" and kv else o.failure) or "no runs"
            print(f"  kvlink / {LABEL[tool]:<20} {want:<12} n/a   ({who} could not run: "
                  f"{short_reason(why)})")  # fmt: skip
            emit({"kind": "ratio", "where": where, "peer": tool, "target": target,
                  "ratio": None, "pass": None, "reason": why})  # fmt: skip
            if target is not None:
                verdicts.append(False)
            continue
        r = median([x.gbps for x in kv.runs]) / median([x.gbps for x in o.runs])
        # Pair by iteration: a tool that failed part-way has fewer runs.
        theirs = {x.iteration: x for x in o.runs}
        paired = median(
            [a.gbps / theirs[a.iteration].gbps for a in kv.runs if a.iteration in theirs]
        )
        ok = None if target is None else r >= target
        verdict = "" if ok is None else ("PASS" if ok else "FAIL")
        print(f"  kvlink / {LABEL[tool]:<20} {want:<12} {r:6.2f}  (paired {paired:.2f})  "
              f"{verdict}")  # fmt: skip
        emit({"kind": "ratio", "where": where, "peer": tool, "target": target, "ratio": r,
              "paired": paired, "pass": ok})  # fmt: skip
        if ok is not None:
            verdicts.append(ok)
    return verdicts


# ---- main ------------------------------------------------------------------------------


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the with-blocks: the testbed comes down


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--where", choices=("loopback", "testbed", "both"), default="both")
    ap.add_argument("--size", type=size_arg, default=GiB, help="bytes per write (1GiB)")
    ap.add_argument("--iters", type=int, default=3, help="interleaved runs per tool")
    ap.add_argument("--peers", default=",".join((*PEERS, "iperf3")),
                    help="which peers to run beside kvlink; contrast rows: "
                    f"{', '.join(VARIANTS)} (see the top of this file)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write one JSON object per line here")
    args = ap.parse_args(argv)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    known = (*PEERS, *VARIANTS, "iperf3")
    if bad := [p for p in peers if p not in known]:
        ap.error(f"--peers: unknown {bad}; choose from {','.join(known)}")
    if args.iters < 1:
        ap.error("--iters: at least 1")
    if args.size % (8 * TB_LINKS) or args.size < 64 * MiB:
        ap.error(f"--size: at least 64MiB and a multiple of {8 * TB_LINKS} bytes")
    import kvlink

    tools = ["kvlink", *[t for t in TOOLS if t in peers]]
    wheres = ["loopback", "testbed"] if args.where == "both" else [args.where]
    signal.signal(signal.SIGTERM, _sigterm)
    jf = JsonLinesFile(args.json)
    emit = jf.emit

    versions: dict[str, str | None] = {"kvlink": kvlink.__version__}
    for p in PEERS:
        pip = VENVS / p / "bin" / "pip"
        if pip.exists():
            listed = subprocess.run([str(pip), "list", "--format=json"], capture_output=True,
                                    text=True, timeout=60, check=False).stdout  # fmt: skip
            with contextlib.suppress(json.JSONDecodeError):
                versions[p] = ", ".join(
                    f"{d['name']} {d['version']}" for d in json.loads(listed)
                    if re.match(r"(mooncake|nixl|ucxx|libucx)", d["name"], re.I)
                )  # fmt: skip
    versions["iperf3"] = iperf3.version()
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "kind": "meta",
        "command": shlex.join(["python", *sys.argv]),
        "utc": now.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "versions": versions,
        "size_bytes": args.size,
        "iters": args.iters,
        "tools": tools,
        "where": wheres,
        "testbed": {"links": TB_LINKS, "rate": TB_RATE, "tag": TB_TAG},
        "warm_bytes": min(args.size, WARM_BYTES),
        "quiet_s": QUIET_S,
    }
    emit(meta)
    print(f"peers: {meta['utc']} UTC, {fmt_size(args.size)} write, {args.iters} iters, "
          f"load average {' '.join(f'{x:.2f}' for x in meta['loadavg'])}")  # fmt: skip
    for k, v in versions.items():
        print(f"  {k}: {v or 'not installed'}")
    results: dict[str, dict[str, Outcome]] = {}
    verdicts: list[bool] = []
    try:
        for w in wheres:
            if w == "loopback":
                results[w] = measure(Where(), tools, args.size, args.iters, emit)
            else:
                try:
                    with testbed_where() as tw:
                        results[w] = measure(tw, tools, args.size, args.iters, emit)
                except BenchError as exc:
                    results[w] = {t: Outcome(failure=str(exc)) for t in tools}
        for w, out in results.items():
            where_label = w if w == "loopback" else f"testbed {TB_LINKS} x {TB_RATE}"
            print_table(where_label, out)
            for tool, o in out.items():
                if o.runs:
                    emit({"kind": "summary", "where": w, "tool": tool,
                          "gbps_median": median([r.gbps for r in o.runs]),
                          "gbps_min": min(r.gbps for r in o.runs),
                          "gbps_max": max(r.gbps for r in o.runs),
                          "cpu_s_median": median([r.cpu_s for r in o.runs]),
                          "runs": len(o.runs), "failure": o.failure})  # fmt: skip
                else:
                    emit({"kind": "summary", "where": w, "tool": tool, "runs": 0,
                          "failure": o.failure})  # fmt: skip
        for w, out in results.items():
            verdicts += ratios(w, out, emit)
    finally:
        jf.close()
    if verdicts:
        print(f"\n{sum(verdicts)} of {len(verdicts)} targets pass")
    else:
        print("\nno targets in this selection (contrast rows only)")
    return 0 if verdicts and all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
