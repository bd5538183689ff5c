"""Relayed paths on a three-host testbed: prefill a, decode b, neighbour r (docs/relays.md).

    python bench/relay_testbed.py [--topology "a-b:2x2gbit,a-r:1x8gbit,r-b:2x2gbit"]
                                  [--size 2GiB] [--iters 3] [--json out.jsonl]
                                  [--scenarios aggregate,kill,yield]

Needs root (kvlink.testbed.Topology, namespaces "kvlrly*") and iperf3.  Links are numbered as
the spec writes them: 0-1 a-b, 2 a-r, 3-4 r-b.  Scenarios, each against a baseline of the same
run (the issue's targets in brackets):

  aggregate  a -> b, SIZE, pushed by an agent of a with the two a-b NICs only (direct) and by
             one with all three NICs routing through r (relayed), alternating per iteration.
             iperf3 one stream per link over the direct links alone, and over the direct links
             plus the relay's links (a-b 0, a-b 1, r-b 3, r-b 4) at once.
             [relayed / direct >= 1.8; relayed / iperf3 over the same capacity >= 0.95]
             For context, what this machine gives any relay: iperf3 a -> b over the direct links
             plus two streams a -> r -> b through plain splice forwarders in r (no kvlink, no
             sealing), all at once ("iperf3_plain_relay": a, b and r share its cores).
  kill       the relay's process killed (SIGKILL) at 30% of the median relayed time.
             ideal = 0.3 x relayed + 0.7 x direct (bytes before at the full rate, the rest on
             the direct links); [total / ideal <= 1.15]; every byte checked.
  yield      r's own iperf3 to b on link 3 for 3 s, alone, then started 1 s into a relayed push
             of 2 x SIZE.  [its rate with kvlink >= 0.9 x alone]; the time from iperf3's start
             to the relayed path through link 3 going down at a is reported [<= 300 ms].
  (cpu)      part of aggregate: the relay process's CPU seconds per GiB forwarded during the
             relayed pushes, against the plain forwarders' (two sockets, splice through a pipe,
             bench/fwd_splice.py) in the iperf3_plain_relay runs: the same two streams
             a -> r -> b beside the same direct traffic.  CPU is getrusage of the process, so
             it includes the softirq work its sends trigger (b's receive side over veth).
             [relay / plain <= 1.3]

kvlink seconds are the engine's own t_done - t_submit.  Every measured run starts after 1.5 s
of quiet links (the NIC monitors count the previous run as foreign traffic for about a second).
GB/s are 1e9 bytes per second.  One JSON object per line: "meta", "result", "ratio".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kvlink import testbed as kt
from kvlink._units import parse_size
from kvlink.bench import Worker, iperf3, share_run_secret

TAG = "rly"
RELAY3 = "a-b:2x2gbit,a-r:1x8gbit,r-b:2x2gbit"
HERE = os.path.dirname(os.path.abspath(__file__))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Emit:
    def __init__(self, path: str | None) -> None:
        self.f = open(path, "a") if path else None  # noqa: SIM115 (closed at exit)

    def __call__(self, **row: Any) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if self.f:
            self.f.write(line + "\n")
            self.f.flush()


def quiet() -> None:
    time.sleep(1.5)


class Bed:
    """The topology and one worker per host: a holds the direct and the relayed agent."""

    def __init__(self, topo: kt.Topology, size: int) -> None:
        self.topo = topo
        self.size = size
        a_direct = topo.addresses("a", peer="b")
        a_all = topo.addresses("a")
        self.b = Worker("b", name="b", nics=",".join(topo.addresses("b")),
                        prefix=topo.exec_prefix("b"))  # fmt: skip
        self.start_relay()
        self.a = Worker("a", name="a-direct", nics=",".join(a_direct),
                        prefix=topo.exec_prefix("a"))  # fmt: skip
        self.a.call("agent", name="a-relay", nics=",".join(a_all),
                    config={"relays": [self.r_md]})  # fmt: skip
        self.b.call("alloc", key="dst", nbytes=size, remote_write=True, name="kv")
        self.a.call("alloc", key="src", nbytes=size, fill="pattern", seed=11)
        self.a.call("register", key="src", agent="a-relay")
        md = self.b.call("hello")["metadata"]
        for ag in ("a-direct", "a-relay"):
            self.a.call("add_peer", metadata=md, agent=ag)
        self.wait_relayed_up()

    def start_relay(self) -> None:
        self.r = Worker("r", name="r", nics=",".join(self.topo.addresses("r")),
                        config={"relay": True, "accept_relayed": False},
                        prefix=self.topo.exec_prefix("r"))  # fmt: skip
        self.r_md = self.r.call("hello")["metadata"]

    def paths(self, agent: str) -> list[dict[str, Any]]:
        return list(self.a.call("paths", agent=agent)["paths"])

    def wait_relayed_up(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            via = [p for p in self.paths("a-relay") if p["relay"]]
            if len(via) == 2 and all(p["state"] == "UP" for p in via):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"relayed paths not up within {timeout_s} s: {via}")
            time.sleep(0.1)

    def push(self, agent: str, wait_s: float = 120.0) -> dict[str, Any]:
        """One SIZE push a -> b by ``agent``; its seconds, per-path bytes; every byte checked."""
        self.b.call("zero", key="dst")
        i0, t0 = cpu_ticks()
        x = self.a.call("push", peer="b", agent=agent, local="src", remote="kv")
        w = self.a.call("wait", id=x["id"], wait_s=wait_s)
        i1, t1 = cpu_ticks()
        bad = self.b.call("verify", key="dst", seed=11)["corrupt_bytes"]
        if bad:
            raise RuntimeError(f"{agent}: {bad} corrupt bytes at b")
        secs = (w["t_done_ns"] - w["t_submit_ns"]) / 1e9
        via = sum(d["bytes_sent"] for d, p in zip(w["path_delta"], w["paths"], strict=True)
                  if p["relay"])  # fmt: skip
        return {"seconds": secs, "gbps": self.size / secs / 1e9, "relayed_bytes": via,
                "retries": w["retries"], "t_submit_ns": w["t_submit_ns"],
                "idle": (i1 - i0) / max(1, t1 - t0)}  # fmt: skip

    def close(self) -> None:
        for w in (self.a, self.b, self.r):
            w.close()


def iperf(topo: kt.Topology, flows: list[tuple[str, str, int]], nbytes: int) -> float:
    """GB/s of one iperf3 stream per (src, dst, link) at once, ``nbytes`` each."""
    streams = [
        iperf3.Stream(topo.address(dst, link), topo.address(src, link), nbytes=nbytes,
                      server_prefix=topo.exec_prefix(dst), client_prefix=topo.exec_prefix(src))
        for src, dst, link in flows
    ]  # fmt: skip
    return iperf3.aggregate_gbps(iperf3.run(streams, timeout_s=300))


def plain_relay(topo: kt.Topology, nbytes: int) -> tuple[float, float, int]:
    """Four iperf3 streams at once, ``nbytes`` each: a -> b over links 0 and 1, and a -> r -> b
    through a plain splice forwarder in r per r-b link (3, 4).  GB/s, and the forwarders' CPU
    seconds and bytes forwarded."""
    fwds = [
        topo.run("r", [sys.executable, os.path.join(HERE, "fwd_splice.py"), topo.address("r", 2),
                       str(5400 + i), topo.address("b", link), str(5410 + i),
                       topo.address("r", link)], stdout=subprocess.PIPE, text=True)
        for i, link in enumerate((3, 4))
    ]  # fmt: skip
    servers = [topo.run("b", ["iperf3", "-s", "-1", "-B", topo.address("b", link), "-p", str(port)],
                        stdout=subprocess.DEVNULL)
               for link, port in ((0, 5420), (1, 5421), (3, 5410), (4, 5411))]  # fmt: skip
    time.sleep(0.7)
    targets = [(topo.address("b", 0), 5420, topo.address("a", 0)),
               (topo.address("b", 1), 5421, topo.address("a", 1)),
               (topo.address("r", 2), 5400, topo.address("a", 2)),
               (topo.address("r", 2), 5401, topo.address("a", 2))]  # fmt: skip
    clients = [topo.run("a", ["iperf3", "-c", host, "-p", str(port), "-B", bind, "-n", str(nbytes),
                              "--json"], stdout=subprocess.PIPE, text=True)
               for host, port, bind in targets]  # fmt: skip
    secs = []
    for c in clients:
        out, _ = c.communicate(timeout=300)
        end = json.loads(out)["end"]
        # as iperf3.Result.seconds: bytes sent over the receiver's rate
        secs.append(end["sum_sent"]["bytes"] * 8 / end["sum_received"]["bits_per_second"])
    for p in servers:
        p.wait(timeout=30)
    cpu, moved = 0.0, 0
    for p in fwds:
        p.terminate()
        out, _ = p.communicate(timeout=30)
        rep = json.loads(out.strip().splitlines()[-1])
        cpu += rep["cpu_s"]
        moved += rep["bytes"]
    return 4 * nbytes / max(secs) / 1e9, cpu, moved


def cpu_ticks() -> tuple[int, int]:
    """(idle, total) jiffies of the whole machine so far (/proc/stat)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return vals[3] + vals[4], sum(vals)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def scenario_aggregate(bed: Bed, iters: int, emit: Emit) -> dict[str, float]:
    topo, size = bed.topo, bed.size
    direct_flows = [("a", "b", 0), ("a", "b", 1)]
    same_flows = [*direct_flows, ("r", "b", 3), ("r", "b", 4)]
    for ag in ("a-direct", "a-relay"):  # warm: path estimates, as long-lived agents have
        bed.push(ag)
    runs: dict[str, list[float]] = {"direct": [], "relayed": [], "iperf3_direct": [],
                                    "iperf3_same": [], "iperf3_plain_relay": []}  # fmt: skip
    relayed_share = []
    cpu_r = cpu_plain = 0.0
    fwd_bytes = plain_bytes = 0
    idle: dict[str, list[float]] = {k: [] for k in runs}
    for it in range(iters):
        order = ["direct", "relayed", "iperf3_direct", "iperf3_same", "iperf3_plain_relay"]
        if it % 2:
            order.reverse()
        for what in order:
            quiet()
            i0, t0 = cpu_ticks()
            if what == "direct":
                res = bed.push("a-direct")
                runs[what].append(res["gbps"])
                i0, t0 = 0, 0  # the push measured its own
            elif what == "relayed":
                c0 = bed.r.call("cpu")["cpu_s"]
                s0 = bed.r.call("relay_stats")["relayed_bytes"]
                res = bed.push("a-relay")
                cpu_r += bed.r.call("cpu")["cpu_s"] - c0
                fwd_bytes += bed.r.call("relay_stats")["relayed_bytes"] - s0
                runs[what].append(res["gbps"])
                relayed_share.append(res["relayed_bytes"] / size)
                i0, t0 = 0, 0
            elif what == "iperf3_plain_relay":
                gbps, cpu, moved = plain_relay(topo, size // 4)
                runs[what].append(gbps)
                cpu_plain += cpu
                plain_bytes += moved
            else:
                flows = direct_flows if what == "iperf3_direct" else same_flows
                runs[what].append(iperf(topo, flows, size // len(flows)))
            i1, t1 = cpu_ticks()
            # the machine's idle share over the transfer (kvlink: submit to done; iperf3: the
            # whole run, its processes' start included)
            idle[what].append(res["idle"] if what in ("direct", "relayed")
                              else (i1 - i0) / max(1, t1 - t0))  # fmt: skip
            log(f"aggregate {it}: {what} {runs[what][-1]:.3f} GB/s, "
                f"machine {idle[what][-1]:.0%} idle")
    for what, xs in runs.items():
        emit(kind="result", scenario="aggregate", config=what, gbps=xs, median_gbps=med(xs),
             machine_idle=idle[what])  # fmt: skip
    emit(kind="result", scenario="aggregate", config="relayed_share", share=relayed_share)
    emit(kind="ratio", scenario="aggregate", name="relayed/direct",
         value=med(runs["relayed"]) / med(runs["direct"]), target=">= 1.8")  # fmt: skip
    emit(kind="ratio", scenario="aggregate", name="relayed/iperf3_same_capacity",
         value=med(runs["relayed"]) / med(runs["iperf3_same"]), target=">= 0.95")  # fmt: skip
    emit(kind="ratio", scenario="aggregate", name="relayed/iperf3_plain_relay",
         value=med(runs["relayed"]) / med(runs["iperf3_plain_relay"]),
         target="(context: this machine's ceiling for any relay)")  # fmt: skip
    emit(kind="ratio", scenario="aggregate", name="direct/iperf3_direct",
         value=med(runs["direct"]) / med(runs["iperf3_direct"]), target="(context)")
    # the relay process (its forwarder, and an idle agent and worker) against the plain
    # forwarders, both carrying two streams a -> r -> b beside the direct traffic
    relay_cpu = cpu_r / (fwd_bytes / (1 << 30)) if fwd_bytes else float("nan")
    plain_cpu = cpu_plain / (plain_bytes / (1 << 30)) if plain_bytes else float("nan")
    emit(kind="result", scenario="cpu", relay_cpu_s_per_gib=relay_cpu,
         plain_cpu_s_per_gib=plain_cpu, relay_bytes=fwd_bytes, plain_bytes=plain_bytes)
    emit(kind="ratio", scenario="cpu", name="relay/plain_forwarder", value=relay_cpu / plain_cpu,
         target="<= 1.3")  # fmt: skip
    log(f"cpu: relay {relay_cpu:.3f} s/GiB, plain forwarders {plain_cpu:.3f} s/GiB")
    return {"direct_s": size / med(runs["direct"]) / 1e9,
            "relayed_s": size / med(runs["relayed"]) / 1e9}


def scenario_kill(bed: Bed, clean: dict[str, float], emit: Emit) -> None:
    quiet()
    t_kill = 0.3 * clean["relayed_s"]
    bed.b.call("zero", key="dst")
    x = bed.a.call("push", peer="b", agent="a-relay", local="src", remote="kv")
    time.sleep(t_kill)
    bed.r.kill()
    killed_ns = time.monotonic_ns()
    w = bed.a.call("wait", id=x["id"], wait_s=120)
    bad = bed.b.call("verify", key="dst", seed=11)["corrupt_bytes"]
    total = (w["t_done_ns"] - w["t_submit_ns"]) / 1e9
    ideal = 0.3 * clean["relayed_s"] + 0.7 * clean["direct_s"]
    emit(kind="result", scenario="kill", seconds=total, ideal_s=ideal, corrupt_bytes=bad,
         killed_after_s=(killed_ns - w["t_submit_ns"]) / 1e9, retries=w["retries"])  # fmt: skip
    emit(kind="ratio", scenario="kill", name="total/ideal", value=total / ideal,
         target="<= 1.15")  # fmt: skip
    log(f"kill: {total:.2f} s against ideal {ideal:.2f} s, {bad} corrupt bytes")
    bed.r.close()
    bed.start_relay()


def scenario_yield(bed: Bed, emit: Emit, iters: int) -> None:
    topo = bed.topo
    flow = iperf3.Stream(topo.address("b", 3), topo.address("r", 3), seconds=3,
                         server_prefix=topo.exec_prefix("b"),
                         client_prefix=topo.exec_prefix("r"))  # fmt: skip
    # a fresh relayed agent: the relay restarted after the kill scenario
    name = f"a-relay-{int(time.time())}"
    bed.a.call("agent", name=name, nics=",".join(topo.addresses("a")),
               config={"relays": [bed.r_md]})  # fmt: skip
    bed.a.call("register", key="src", agent=name)
    bed.a.call("add_peer", metadata=bed.b.call("hello")["metadata"], agent=name)
    alone, shared, handback = [], [], []
    for it in range(iters):
        quiet()
        alone.append(iperf3.run([flow])[0].received_bps / 8e9)
        quiet()
        via3 = topo.address("b", 3)
        bed.b.call("zero", key="dst")
        ids = [bed.a.call("push", peer="b", agent=name, local="src", remote="kv")["id"]
               for _ in range(2)]  # fmt: skip
        time.sleep(1.0)
        box: dict[str, Any] = {}

        def run_iperf(box: dict[str, Any] = box) -> None:
            box["t0"] = time.monotonic_ns()
            box["res"] = iperf3.run([flow])[0]

        th = threading.Thread(target=run_iperf)
        th.start()
        t_down = None
        while th.is_alive() and t_down is None:
            for p in bed.a.call("paths", agent=name)["paths"]:
                if p["relay"] and p["remote"].startswith(via3) and p["state"] in ("DOWN",
                                                                                  "PROBING"):
                    t_down = time.monotonic_ns()
            time.sleep(0.02)
        th.join()
        for i in ids:
            bed.a.call("wait", id=i, wait_s=120)
        shared.append(box["res"].received_bps / 8e9)
        # iperf3 -c starts from the moment its process is spawned: an upper bound
        handback.append((t_down - box["t0"]) / 1e6 if t_down else float("nan"))
        log(f"yield {it}: alone {alone[-1]:.3f} GB/s, beside kvlink {shared[-1]:.3f} GB/s, "
            f"relayed path down {handback[-1]:.0f} ms after iperf3 was started")
    emit(kind="result", scenario="yield", alone_gbps=alone, shared_gbps=shared,
         handback_ms=handback, relay=bed.r.call("relay_stats"))  # fmt: skip
    emit(kind="ratio", scenario="yield", name="iperf3_beside_kvlink/alone",
         value=med(shared) / med(alone), target=">= 0.9")  # fmt: skip
    emit(kind="ratio", scenario="yield", name="handback_ms", value=med(handback),
         target="<= 300")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default=RELAY3)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--scenarios", default="aggregate,kill,yield")
    args = ap.parse_args()
    size = parse_size(args.size)
    scen = args.scenarios.split(",")
    emit = Emit(args.json)
    share_run_secret()
    emit(kind="meta", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
         host=platform.node(), cpus=os.cpu_count(), topology=args.topology, size=size,
         iters=args.iters, iperf3=iperf3.version())  # fmt: skip
    kt.teardown(TAG)
    with kt.Topology(args.topology, tag=TAG) as topo:
        bed = Bed(topo, size)
        try:
            clean = {"direct_s": 0.0, "relayed_s": 0.0}
            if "aggregate" in scen or "kill" in scen:
                clean = scenario_aggregate(bed, args.iters, emit)
            if "kill" in scen:
                scenario_kill(bed, clean, emit)
            if "yield" in scen:
                scenario_yield(bed, emit, args.iters)
        finally:
            bed.close()
    return 0


_: Callable[..., Any] = main

if __name__ == "__main__":
    sys.exit(main())
