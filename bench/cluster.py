"""Discovery through a real etcd: how soon a new peer can be pushed to, and many agents at once.

    python bench/cluster.py first-push [--iters 10]
    python bench/cluster.py many [--agents 50] [--rounds 6] [--keep-data]

``first-push``: an agent (this process) pushes 1 MiB to ``decode-i``, a peer started as a
new process for each iteration, found only through etcd; it retries from the moment the
process is spawned until a push is verified. Reports the time from the spawn, and from the
peer's ``Agent()`` call (CLOCK_MONOTONIC is shared by the processes), to that first verified
push, and how the peer's own start splits: interpreter and imports, ``Agent()`` (listen and
publish), ``register()``.

``many``: ``--agents`` agents, one thread each in this process (a 2-core machine cannot run 50
interpreters at once usefully), publish themselves in one etcd and wait until every one lists
every other; then, for ``--rounds`` rounds, each pushes its own pattern into its slot of a
random peer's region, looking the peer up through etcd the first time, and every slot is
checked. In the middle of the rounds etcd is restarted without its data (``--keep-data``:
with it), while pushes go on: look-ups that find etcd down are retried until it is back.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

import kvlink
from kvlink.bench.etcd import EtcdServer

SECRET = "bench-cluster-secret-0123456789abcdef"
MiB = 1 << 20

PEER = r"""
import sys, time
t_main = time.monotonic()
import numpy as np, kvlink
t_import = time.monotonic()
name, url, secret = sys.argv[1:4]
t_agent = time.monotonic()
a = kvlink.Agent(name, kvlink.Config(nics="loopback:1", discovery=url, secret=secret))
t_made = time.monotonic()
buf = np.zeros(1 << 20, np.uint8)
a.register(buf, remote_write=True, name="kv")
t_reg = time.monotonic()
print(t_main, t_import, t_agent, t_made, t_reg, flush=True)
sys.stdin.read()  # until the driver closes the pipe
a.close()
"""


def first_push(args: argparse.Namespace) -> int:
    with EtcdServer() as etcd:
        url = etcd.url("bench")
        tx = kvlink.Agent("prefill", kvlink.Config(nics="loopback:1", discovery=url, secret=SECRET))
        src = np.random.default_rng(1).integers(0, 255, MiB, dtype=np.uint8)
        tx.register(src)
        rows = []
        for i in range(args.iters):
            name = f"decode-{i}"
            t_spawn = time.monotonic()
            p = subprocess.Popen(
                [sys.executable, "-c", PEER, name, url, SECRET],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            tries = 0
            errors: dict[str, int] = {}
            deadline = t_spawn + 60
            while True:
                tries += 1
                try:
                    tx.push(name, src, "kv").wait(10)
                    break
                except kvlink.KvlinkError as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    if time.monotonic() > deadline:
                        print(f"{name}: no push verified within 60 s: {exc}", file=sys.stderr)
                        p.kill()
                        return 1
                    time.sleep(0.005)
            t_ok = time.monotonic()
            assert p.stdout is not None
            _t_main, t_import, t_agent, t_made, t_reg = map(float, p.stdout.readline().split())
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(30)
            tx.remove_peer(name)
            row = {
                "spawn_to_push_ms": (t_ok - t_spawn) * 1e3,
                "agent_to_push_ms": (t_ok - t_agent) * 1e3,
                "interpreter_imports_ms": (t_import - t_spawn) * 1e3,
                "agent_ms": (t_made - t_agent) * 1e3,
                "register_ms": (t_reg - t_made) * 1e3,
                "tries": tries,
            }
            rows.append(row)
            print(
                f"{name}: spawn -> first verified push {row['spawn_to_push_ms']:.0f} ms, "
                f"Agent() -> push {row['agent_to_push_ms']:.0f} ms (start: interpreter+imports "
                f"{row['interpreter_imports_ms']:.0f} ms, Agent() {row['agent_ms']:.0f} ms, "
                f"register {row['register_ms']:.1f} ms); {tries} tries {errors}",
                flush=True,
            )
        tx.close()
    print()
    for k in ("spawn_to_push_ms", "agent_to_push_ms", "interpreter_imports_ms", "agent_ms"):
        v = [r[k] for r in rows]
        print(f"{k}: median {statistics.median(v):.0f} ms, min {min(v):.0f}, max {max(v):.0f}")
    return 0


def many(args: argparse.Namespace) -> int:
    n, slot = args.agents, args.slot_kib * 1024
    with EtcdServer() as etcd:
        url = etcd.url("bench")
        cfg = kvlink.Config(nics="loopback:1", discovery=url, secret=SECRET)
        agents: list[Any] = [None] * n
        dsts = [np.zeros(n * slot, np.uint8) for _ in range(n)]
        srcs = [np.zeros(slot, np.uint8) for _ in range(n)]
        t0 = time.monotonic()
        for i in range(n):
            agents[i] = kvlink.Agent(f"agent-{i:03d}", cfg)
            agents[i].register(dsts[i], remote_write=True, name="kv")
            agents[i].register(srcs[i])
        t_started = time.monotonic() - t0

        def converged() -> bool:
            return all(sum(p.discovered for p in a.peers()) == n - 1 for a in agents)

        deadline = time.monotonic() + 120
        while not converged():
            if time.monotonic() > deadline:
                print("agents did not all see each other within 120 s", file=sys.stderr)
                return 1
            time.sleep(0.1)
        t_converged = time.monotonic() - t0
        print(
            f"{n} agents started in {t_started:.1f} s; every agent lists every other after "
            f"{t_converged:.1f} s",
            flush=True,
        )
        rng = random.Random(5)
        lat: list[float] = []
        retried = {"lookups": 0}
        failures: list[str] = []
        lock = threading.Lock()

        def push_round(r: int) -> None:
            targets = [rng.choice([j for j in range(n) if j != i]) for i in range(n)]
            for i in range(n):
                srcs[i][:] = (i * 7 + r * 13) % 251 + 1

            def one(i: int) -> None:
                t = targets[i]
                end = time.monotonic() + 60
                while True:
                    try:
                        t1 = time.monotonic()
                        agents[i].push(
                            f"agent-{t:03d}",
                            srcs[i],
                            "kv",
                            dst_offset=i * slot,
                            notify=f"{i}:{r}".encode(),
                        ).wait(30)
                        with lock:
                            lat.append(time.monotonic() - t1)
                        return
                    except (kvlink.DiscoveryError, kvlink.UnknownPeerError) as exc:
                        with lock:
                            retried["lookups"] += 1
                        if time.monotonic() > end:
                            with lock:
                                failures.append(f"round {r} agent {i} -> {t}: {exc}")
                            return
                        time.sleep(0.2)
                    except kvlink.KvlinkError as exc:
                        with lock:
                            failures.append(f"round {r} agent {i} -> {t}: {exc}")
                        return

            threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            for i in range(n):
                got = dsts[targets[i]][i * slot : (i + 1) * slot]
                if not (got == (i * 7 + r * 13) % 251 + 1).all():
                    failures.append(f"round {r}: agent {i}'s bytes at agent {targets[i]} differ")

        restart_info: dict[str, float] = {}

        def restart() -> None:
            t1 = time.monotonic()
            etcd.restart(wipe=not args.keep_data, down_s=1.0)
            t_back = time.monotonic()
            restart_info["down_s"] = t_back - t1
            deadline = t_back + 60
            while time.monotonic() < deadline:
                # every agent wrote its record since etcd came back (or, with its data kept,
                # still finds it there)
                if args.keep_data:
                    if all(a.discovery.lookup(a.name) is not None for a in agents):
                        restart_info["republished_s"] = time.monotonic() - t_back
                        return
                elif all(a.discovery.published_at > t_back for a in agents):
                    last = max(a.discovery.published_at for a in agents)
                    restart_info["republished_s"] = last - t_back
                    return
                time.sleep(0.05)

        restarter = None
        for r in range(args.rounds):
            if r == args.rounds // 2:
                restarter = threading.Thread(target=restart)
                restarter.start()
            t1 = time.monotonic()
            push_round(r)
            print(
                f"round {r}: {n} pushes in {time.monotonic() - t1:.2f} s"
                + (" (etcd restarting)" if restarter and restarter.is_alive() else ""),
                flush=True,
            )
        if restarter is not None:
            restarter.join()
        republished = sum(a.discovery.republished for a in agents)
        removed = sum(a.discovery.removed for a in agents)
        for a in agents:
            a.close()
    lat.sort()
    verified = len(lat)
    print(
        f"\n{n} agents, {args.rounds} rounds, {slot // 1024} KiB per push; etcd restarted "
        f"{'with' if args.keep_data else 'without'} its data in round {args.rounds // 2} "
        f"(down {restart_info.get('down_s', float('nan')):.1f} s; every agent listed again "
        f"{restart_info.get('republished_s', float('nan')):.1f} s after it was back; "
        f"{republished} re-publications; peers removed by discovery: {removed})"
    )
    print(
        f"pushes verified: {verified} of {n * args.rounds}; failed: {len(failures)}; "
        f"look-ups retried while etcd was away: {retried['lookups']}"
    )
    if lat:
        print(
            f"push latency: median {lat[len(lat) // 2] * 1e3:.1f} ms, "
            f"p99 {lat[int(len(lat) * 0.99) - 1] * 1e3:.1f} ms"
        )
    for f in failures[:10]:
        print("FAILED:", f)
    return 0 if not failures and verified == n * args.rounds else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    fp = sub.add_parser("first-push")
    fp.add_argument("--iters", type=int, default=10)
    m = sub.add_parser("many")
    m.add_argument("--agents", type=int, default=50)
    m.add_argument("--rounds", type=int, default=6)
    m.add_argument("--slot-kib", type=int, default=64)
    m.add_argument("--keep-data", action="store_true")
    args = ap.parse_args()
    return first_push(args) if args.cmd == "first-push" else many(args)


if __name__ == "__main__":
    sys.exit(main())
