"""Fairness under a misbehaving admitted peer (issue 22): legitimate pushes, pulls and PINGs
while one admitted peer runs each attack of tests/attacks.py at full speed.

    python bench/fairness.py [--attacks announce-lockout,notify-flood] [--pushes 20]
                             [--size 64MiB] [--secret] [--json FILE]

Targets (issue 22), for each attack, against the same run's baseline without it:
    legitimate 64 MiB pushes that succeed            20 of 20
    their median latency                             <= 2 x the baseline's
    PING round trip from a third connection          <= 10 ms (p50 and max)
    the target's RSS growth while attacked           <= 64 MiB (one attacking peer)
    ... and after the attacker left (--settle-s)     <= 8 MiB over its start

How it measures, for each attack in turn (everything fresh for each):
  * the target agent runs in a benchmark worker (kvlink.bench.worker) of its own, so its RSS
    is its /proc/PID/status VmRSS, sampled every 50 ms; it exposes one region "kv" of
    --size, remote_read and remote_write (the attacks that need a key take it from the
    target's metadata, as any admitted peer can);
  * a legitimate sender agent here pushes --size from a buffer into "kv" and pulls it back
    into another, comparing every byte (the source changes one byte per page each round);
    seconds are push() -> wait();
  * a raw connection here (tests/attacks.Peer "pinger") sends PING every 20 ms and times its
    PONG; one unanswered for 2 s counts as lost (and as 2000 ms in max);
  * baseline: --pushes rounds without the attack. Then the attacker starts in a process of its
    own (python -m tests.attacks), and once it says it is at full pressure (or after 10 s)
    a second sender agent, connected only now (its handshake under attack), does --pushes
    rounds; each push and pull has --timeout-s. Then the attacker leaves (its process ends)
    and after --settle-s the target's RSS is read again. RSS figures are relative to the
    target's RSS just before the attack.

One JSON object per attack (a ``kvlink-bench table`` row: ``ratio`` is the push latency
ratio, ``met`` whether every target above was met, the figures in ``detail`` and in fields of
their own). This machine has 2 cores shared with other work: run it under ``nice``; figures
are noisy, counts and RSS less so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import select
import statistics
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests.attacks, when run as bench/fairness.py
    sys.path.insert(0, str(ROOT))

import kvlink  # noqa: E402
from kvlink.bench import Worker  # noqa: E402
from kvlink.bench.measure import MiB, fmt_size, size_arg  # noqa: E402
from kvlink.bench.report import JsonLinesFile, run_info  # noqa: E402
from tests import attacks  # noqa: E402
from tests import wire_client as wc  # noqa: E402

TARGET_LATENCY = 2.0  # x the baseline's median
TARGET_PING_MS = 10.0
TARGET_RSS_DURING_MIB = 64.0  # per attacking peer
TARGET_RSS_AFTER_MIB = 8.0
PING_EVERY_S = 0.02
PING_LOST_S = 2.0
READY_S = 10.0
SECRET = "kvlink-fairness-bench-secret-0123456789"


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"process {pid}: no VmRSS")


class RssSampler:
    """The target's VmRSS every 50 ms, with the time of each sample."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(OSError, RuntimeError):
                self.samples.append((time.monotonic(), rss_kib(self.pid)))

    def max_between(self, t0: float, t1: float) -> int:
        return max((k for t, k in self.samples if t0 <= t <= t1), default=0)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(2)


class Pinger:
    """PING / PONG on a raw control connection of its own, every PING_EVERY_S; each RTT
    (None: lost) with its send time."""

    def __init__(self, target: attacks.Target) -> None:
        self.s, _ = attacks.Peer(target, "pinger").open(wc.CONTROL)
        self.samples: list[tuple[float, float | None]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        buf = bytearray()
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                token = time.monotonic_ns()
                self.s.sendall(wc.frame(wc.PING, struct.pack("<Q", token)))
                rtt = self._pong(buf, token, t0 + PING_LOST_S)
                self.samples.append((t0, rtt))
                self._stop.wait(max(0.0, PING_EVERY_S - (time.monotonic() - t0)))
        except OSError:
            pass

    def _pong(self, buf: bytearray, token: int, deadline: float) -> float | None:
        while (left := deadline - time.monotonic()) > 0:
            while len(buf) >= attacks.HDR.size:
                _, _, t, _, blen, _, plen = attacks.HDR.unpack_from(buf)
                size = attacks.HDR.size + blen + (plen + 4 if plen else 0)
                if len(buf) < size:
                    break
                got = struct.unpack_from("<Q", buf, attacks.HDR.size)[0] if blen >= 8 else -1
                del buf[:size]
                if t == wc.PONG and got == token:
                    return (time.monotonic_ns() - token) / 1e6
            r, _, _ = select.select([self.s], [], [], left)
            if r:
                data = self.s.recv(1 << 16)
                if not data:
                    raise ConnectionError("the target closed the pinger's connection")
                buf += data
        return None

    def between(self, t0: float, t1: float) -> list[float | None]:
        return [rtt for t, rtt in self.samples if t0 <= t <= t1]

    def stop(self) -> None:
        self._stop.set()
        self._t.join(PING_LOST_S + 1)
        self.s.close()


@dataclass
class Rounds:
    """What --pushes rounds of push, pull and compare gave."""

    push_s: list[float] = field(default_factory=list)  # of the pushes that succeeded
    pushed: int = 0
    pulled: int = 0
    verified: int = 0
    errors: list[str] = field(default_factory=list)


def rounds(agent: kvlink.Agent, src: np.ndarray[Any, Any], back: np.ndarray[Any, Any], n: int,
           timeout_s: float, seed: int) -> Rounds:  # fmt: skip
    out = Rounds()
    for i in range(n):
        src[::4096] = (seed + i) % 251  # one byte per page: each round's bytes are new
        t0 = time.perf_counter()
        try:
            agent.push("target", src=src, dst="kv", timeout_s=timeout_s).wait(timeout_s + 1)
            out.push_s.append(time.perf_counter() - t0)
            out.pushed += 1
        except kvlink.KvlinkError as exc:
            out.errors.append(f"push: {type(exc).__name__}: {exc}"[:300])
            continue
        back[::4096] = 255 - (seed + i) % 251  # what the pull must overwrite
        try:
            agent.pull("target", src="kv", dst=back, timeout_s=timeout_s).wait(timeout_s + 1)
            out.pulled += 1
        except kvlink.KvlinkError as exc:
            out.errors.append(f"pull: {type(exc).__name__}: {exc}"[:300])
            continue
        out.verified += bool(np.array_equal(src, back))
    return out


def ping_figures(rtts: list[float | None]) -> dict[str, Any]:
    got = [r for r in rtts if r is not None]
    lost = len(rtts) - len(got)
    return {
        "ping_n": len(rtts),
        "ping_lost": lost,
        "ping_p50_ms": round(statistics.median(got), 3) if got else None,
        "ping_max_ms": round(max(got + [PING_LOST_S * 1e3] * bool(lost)), 3) if rtts else None,
    }


def run_attack(kind: str, args: argparse.Namespace, cmd: list[str]) -> dict[str, Any]:
    secret = SECRET if args.secret else None
    cfg: dict[str, Any] = {"secret": secret} if secret else {}
    size = args.size
    target = Worker("target", name="target", nics="loopback:1", config=cfg)
    senders: list[kvlink.Agent] = []
    pinger = rss = attack = None
    try:
        target.call("alloc", key="kv", nbytes=size, remote_read=True, remote_write=True,
                    name="kv")  # fmt: skip
        # the attacker's writes and reads go here (tests/attacks.py picks "attack"), not
        # into "kv", whose bytes the legitimate peers compare
        target.call("alloc", key="attack", nbytes=1 << 20, remote_read=True, remote_write=True,
                    name="attack")  # fmt: skip
        md = target.metadata
        tgt = attacks.Target.from_metadata(md, secret)
        src = np.frombuffer(np.random.default_rng(7).bytes(size), np.uint8).copy()
        back = np.zeros(size, np.uint8)

        def sender(name: str) -> kvlink.Agent:
            a = kvlink.Agent(name, kvlink.Config(nics="loopback:1", secret=secret))
            senders.append(a)
            a.register(src)
            a.register(back)
            a.add_peer(md)
            return a

        legit = sender("legit")
        rounds(legit, src, back, 2, args.timeout_s, 0)  # warm-up: buffers, paths
        rss = RssSampler(target.pid)
        pinger = Pinger(tgt)
        time.sleep(0.5)
        b0 = time.monotonic()
        base = rounds(legit, src, back, args.pushes, args.timeout_s, 1)
        b1 = time.monotonic()
        rss_start = rss_kib(target.pid)
        a0 = time.monotonic()
        attack = attacks.AttackProcess(kind, md, secret)
        ready = attack.wait_ready(READY_S)
        t_ready = time.monotonic() - a0
        try:
            second = sender("legit2")  # its handshake under attack
            under = rounds(second, src, back, args.pushes, args.timeout_s, 101)
        except kvlink.KvlinkError as exc:  # add_peer: no push could even start
            under = Rounds(errors=[f"add_peer: {type(exc).__name__}: {exc}"[:300]])
        a1 = time.monotonic()
        rss_peak = rss.max_between(a0, a1)
        stats = attack.stop()
        time.sleep(args.settle_s)
        rss_after = rss_kib(target.pid)
    finally:
        if attack is not None:
            attack.stop()
        if pinger is not None:
            pinger.stop()
        if rss is not None:
            rss.stop()
        for a in senders:
            a.close()
        target.close()
    base_p50 = statistics.median(base.push_s) if base.push_s else None
    under_p50 = statistics.median(under.push_s) if under.push_s else None
    ratio = round(under_p50 / base_p50, 3) if base_p50 and under_p50 else None
    ping_base = ping_figures(pinger.between(b0, b1))
    ping_under = ping_figures(pinger.between(a0, a1))
    grow = (rss_peak - rss_start) / 1024
    left = (rss_after - rss_start) / 1024
    checks = {
        "pushes": under.pushed == args.pushes and under.verified == args.pushes,
        "latency": ratio is not None and ratio <= TARGET_LATENCY,
        "ping": ping_under["ping_lost"] == 0
        and (ping_under["ping_max_ms"] or 1e9) <= TARGET_PING_MS,
        "rss_during": grow <= TARGET_RSS_DURING_MIB,
        "rss_after": left <= TARGET_RSS_AFTER_MIB,
    }
    n = args.pushes
    detail = (
        f"{under.pushed}/{n} pushed, {under.verified}/{n} verified; push p50 "
        f"{_ms(under_p50)} vs {_ms(base_p50)} ms; PING p50/max {ping_under['ping_p50_ms']}/"
        f"{ping_under['ping_max_ms']} ms, {ping_under['ping_lost']} lost (baseline "
        f"{ping_base['ping_p50_ms']}/{ping_base['ping_max_ms']}); RSS +{grow:.0f} MiB during, "
        f"{left:+.0f} MiB after"
    )
    row: dict[str, Any] = {
        "scenario": f"fairness: {kind}, {fmt_size(size)} pushes while attacked",
        "section": "fairness-under-a-misbehaving-peer",
        "baseline": "the same pushes without the attack, same run",
        "ratio": ratio,
        "target": f"{n}/{n}, <= {TARGET_LATENCY:g} x, PING <= {TARGET_PING_MS:g} ms, RSS "
        f"<= +{TARGET_RSS_DURING_MIB:g} MiB (+{TARGET_RSS_AFTER_MIB:g} after)",
        "met": all(checks.values()),
        "failed_checks": [k for k, ok in checks.items() if not ok],
        "detail": detail,
        **run_info("python", ["bench/fairness.py", *argv_of(cmd), "--attacks", kind]),
        "attack": kind,
        "secret": bool(secret),
        "attack_ready": ready,
        "attack_ready_s": round(t_ready, 2),
        "attack_stats": {k: v for k, v in stats.items() if k != "kind"},
        "pushes": n,
        "pushed": under.pushed,
        "pulled": under.pulled,
        "verified": under.verified,
        "baseline_pushed": base.pushed,
        "baseline_verified": base.verified,
        "push_p50_s": under_p50,
        "baseline_push_p50_s": base_p50,
        **ping_under,
        **{f"baseline_{k}": v for k, v in ping_base.items()},
        "rss_start_mib": round(rss_start / 1024, 1),
        "rss_growth_mib": round(grow, 1),
        "rss_after_mib": round(left, 1),
        "first_errors": under.errors[:3],
    }
    if ratio is None:
        row["ratio_text"] = f"{under.pushed}/{n} pushes succeeded"
    return row


def argv_of(argv: list[str]) -> list[str]:
    """argv without --attacks (each row names its own) and --json (where this run wrote)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--attacks", "--json"):
            skip = True
        elif not a.startswith(("--attacks=", "--json=")):
            out.append(a)
    return out


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'attack':<17} {'ok':>6} {'ratio':>6} {'ping p50/max ms':>16} {'lost':>4} "
            f"{'rss+ MiB':>8} {'after':>6}  failed")  # fmt: skip
    lines = [head]
    for r in rows:
        ok = f"{r['verified']}/{r['pushes']}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        ping = f"{r['ping_p50_ms']}/{r['ping_max_ms']}"
        lines.append(
            f"{r['attack']:<17} {ok:>6} {ratio:>6} {ping:>16} {r['ping_lost']:>4} "
            f"{r['rss_growth_mib']:>8.0f} {r['rss_after_mib']:>6.0f}  "
            f"{','.join(r['failed_checks']) or '-'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attacks", default=",".join(attacks.ATTACKS),
                    help=f"a subset of {','.join(attacks.ATTACKS)} (default: all)")  # fmt: skip
    ap.add_argument("--pushes", type=int, default=20, help="rounds per phase (default 20)")
    ap.add_argument("--size", type=size_arg, default=64 * MiB, help="push size (64MiB)")
    ap.add_argument("--timeout-s", type=float, default=10.0, help="per push and pull (10)")
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="after the attacker left, before RSS is read again (5)")  # fmt: skip
    ap.add_argument("--secret", action="store_true",
                    help="agents share a cluster secret (the attacker has it)")  # fmt: skip
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON lines")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.attacks.split(",") if k.strip()]
    if bad := [k for k in kinds if k not in attacks.ATTACKS]:
        ap.error(f"--attacks: unknown {bad}; choose from {','.join(attacks.ATTACKS)}")
    cmd = list(argv if argv is not None else sys.argv[1:])
    out = JsonLinesFile(args.json)
    rows = []
    try:
        for kind in kinds:
            row = run_attack(kind, args, cmd)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            out.emit(row)
    finally:
        out.close()
    print(table(rows))
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    logging.getLogger("kvlink").setLevel(logging.ERROR)  # the attacks' refusals, by the 1000
    sys.exit(main())
