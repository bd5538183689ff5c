"""Link-flap soak on the multi-NIC testbed (root): pushes while links go down
and up, change rate and all go down at once.

    .venv/bin/python bench/soak.py --pushes 300 [--links 4] [--rate 2gbit] [--seed 1]

A sender and a receiver agent run in the testbed's two namespaces
(kvlink.bench.pair, as bench/multinic.py uses them).  One thread
pushes 64 MiB after 64 MiB (the receiver's buffer zeroed before each, every
byte checked after each that reported success); another injects a random
fault every 0.3-1.5 s: a link down for 0.2-3 s, a link's rate changed, or
(one event in ten) every link down for 0.5-3 s.  Reports pushes done and
failed (with reasons), corrupt bytes (must be 0), hangs (a wait past the
transfer's deadline; must be 0), reconnects and hedges.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import threading
import time
from typing import Any

import kvlink.testbed as kt
from kvlink.bench import share_run_secret
from kvlink.bench.pair import Pair

MiB = 1 << 20
SIZE = 64 * MiB
DEADLINE_S = 20.0
RATES = ["200mbit", "500mbit", "1gbit", "2gbit"]


def faults(
    tb: kt.Testbed,
    rate: str,
    stop: threading.Event,
    rng: random.Random,
    counts: collections.Counter[str],
) -> None:
    n = tb.links
    while not stop.wait(rng.uniform(0.3, 1.5)):
        roll = rng.random()
        if roll < 0.1:
            for i in range(n):
                tb.link_down(i)
            counts["all_down"] += 1
            stop.wait(rng.uniform(0.5, 3.0))
            for i in range(n):
                tb.link_up(i)
        elif roll < 0.6:
            i = rng.randrange(n)
            tb.link_down(i)
            counts["link_down"] += 1
            stop.wait(rng.uniform(0.2, 3.0))
            tb.link_up(i)
        else:
            i = rng.randrange(n)
            tb.set_rate(i, rng.choice(RATES))
            counts["rate_change"] += 1
    for i in range(n):
        tb.link_up(i)
        tb.set_rate(i, rate)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pushes", type=int, default=300, help="pushes of 64 MiB (default 300)")
    ap.add_argument("--links", type=int, default=4, help="emulated links (default 4)")
    ap.add_argument("--rate", default="2gbit", help="rate of each link (default 2gbit)")
    ap.add_argument("--seed", type=int, default=1, help="fault schedule seed (default 1)")
    ap.add_argument("--json", metavar="FILE", help="also append the result as a JSON line")
    args = ap.parse_args(argv)
    share_run_secret()  # testbed agents listen on 198.18.x addresses
    ok, why = kt.is_available()
    if not ok:
        print(f"soak: the testbed cannot run here: {why}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    counts: collections.Counter[str] = collections.Counter()
    failures: collections.Counter[str] = collections.Counter()
    result: dict[str, Any] = {}
    with kt.Testbed(links=args.links, rate=args.rate, tag="soak") as tb:
        pair = Pair(tb, SIZE, DEADLINE_S)
        try:
            pair.add("s", list(range(args.links)), {})
            pair.warm("s")
            stop = threading.Event()
            injector = threading.Thread(target=faults, args=(tb, args.rate, stop, rng, counts))
            injector.start()
            done = corrupt = hangs = 0
            slowest = 0.0
            t0 = time.monotonic()
            try:
                for _ in range(args.pushes):
                    pair.rx.call("zero", key="dst")
                    try:
                        sub = pair.tx.call(
                            "push", agent="tx-s", peer="rx-s", local="src", remote="kv", nbytes=SIZE
                        )
                    except Exception as exc:  # refused at submit: every path known dead
                        failures[type(exc).__name__ + ": " + str(exc)[:60]] += 1
                        time.sleep(0.2)
                        continue
                    w = pair.tx.call(
                        "wait",
                        answer_s=DEADLINE_S + 30,
                        id=sub["id"],
                        wait_s=DEADLINE_S + 5,
                        capture=True,
                    )
                    slowest = max(slowest, w["waited_s"])
                    if w["state"] == "RUNNING":
                        hangs += 1
                    elif w["error"]:
                        failures[w["error"].split(";")[0][:90]] += 1
                    else:
                        done += 1
                        corrupt += pair.rx.call("verify", key="dst", nbytes=SIZE)["corrupt_bytes"]
            finally:
                stop.set()
                injector.join()
            paths = pair.paths("s")
            result = {
                "pushes": args.pushes,
                "ok": done,
                "failed": sum(failures.values()),
                "corrupt_bytes": corrupt,
                "hangs": hangs,
                "slowest_s": round(slowest, 2),
                "reconnects": sum(p["reconnects"] for p in paths),
                "hedges": sum(p["hedges"] for p in paths),
                "faults": dict(counts),
                "failure_reasons": dict(failures),
                "seconds": round(time.monotonic() - t0, 1),
                "seed": args.seed,
            }
        finally:
            pair.tx.close()
            pair.rx.close()
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if result.get("corrupt_bytes") == 0 and result.get("hangs") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
