"""What serving and scraping metrics costs the data path: loopback 1 GiB pushes with and without.

    python bench/metrics_overhead.py [--size 1GiB] [--iters 7] [--paths 2] [--scrape-ms 100]

Two sender/receiver pairs of in-process agents share one source and one destination buffer:
pair "off" has no metrics; pair "on" serves them (``Config(metrics_port=0)``) and, for each of
its pushes, a separate scraper process fetches its /metrics every ``--scrape-ms`` (started
before the push, after its first scrape answered; stopped after it), as Prometheus would.
Iterations interleave the pairs, flipping the order each time (this 2-core machine is noisy);
seconds are push() to wait() return; the destination is checked after every push. Prints the
median GB/s of each, the ratio of medians and the median of per-iteration ratios, and how many
scrapes ran during the "on" pushes.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

import kvlink
from kvlink.bench.measure import fmt_size, size_arg

SCRAPER = r"""
import sys, time, httpx
url, period = sys.argv[1], float(sys.argv[2])
n = 0
with httpx.Client(timeout=2) as c:
    while True:
        t = time.monotonic()
        assert c.get(url).status_code == 200
        n += 1
        if n == 1:
            print("ready", flush=True)
        sys.stderr.write(f"{n}\n"); sys.stderr.flush()
        time.sleep(max(0.0, period - (time.monotonic() - t)))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=size_arg, default=1 << 30)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--paths", type=int, default=2)
    ap.add_argument("--scrape-ms", type=int, default=100)
    args = ap.parse_args()
    size = args.size
    nics = f"loopback:{args.paths}"
    src = np.random.default_rng(7).integers(0, 255, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    pairs = {}
    for tag, extra in (("off", {}), ("on", {"metrics_port": 0})):
        tx = kvlink.Agent(f"tx-{tag}", kvlink.Config(nics=nics, **extra))
        rx = kvlink.Agent(f"rx-{tag}", kvlink.Config(nics=nics))
        tx.register(src)
        rx.register(dst, remote_write=True, name="kv")
        tx.add_peer(rx.metadata())
        tx.push(f"rx-{tag}", src, "kv", nbytes=64 << 20).wait(30)  # warm the connections
        pairs[tag] = (tx, rx)
    host, port = pairs["on"][0].metrics_address
    url = f"http://{host}:{port}/metrics"
    gbps: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}  # this process (both agents), s/GiB
    scraper_cpu = []
    scrapes = []
    for it in range(args.iters):
        order = ("off", "on") if it % 2 == 0 else ("on", "off")
        for tag in order:
            tx, _ = pairs[tag]
            dst[:] = 0
            scraper = None
            if tag == "on":
                scraper = subprocess.Popen(
                    [sys.executable, "-c", SCRAPER, url, str(args.scrape_ms / 1e3)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                assert scraper.stdout is not None and scraper.stdout.readline() == "ready\n"
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            tx.push(f"rx-{tag}", src, "kv").wait(120)
            dt = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            used = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
            cpu[tag].append(used / (size / (1 << 30)))
            if scraper is not None:
                c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                scraper.kill()
                _, err = scraper.communicate(timeout=10)
                c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                scraper_cpu.append((c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime))
                scrapes.append(int(err.split()[-1]) if err.split() else 0)
            if not np.array_equal(dst, src):
                print(f"iteration {it} {tag}: destination differs", file=sys.stderr)
                return 1
            gbps[tag].append(size / dt / 1e9)
            print(
                f"iter {it} {tag:>3}: {size / dt / 1e9:.2f} GB/s, {cpu[tag][-1]:.3f} CPU s/GiB",
                flush=True,
            )
    for tx, rx in pairs.values():
        tx.close()
        rx.close()
    off, on = statistics.median(gbps["off"]), statistics.median(gbps["on"])
    paired = statistics.median(b / a for a, b in zip(gbps["off"], gbps["on"], strict=True))
    print(f"\n{fmt_size(size)} push, {args.paths} loopback paths, {args.iters} iterations each")
    print(f"metrics off: median {off:.2f} GB/s ({min(gbps['off']):.2f}-{max(gbps['off']):.2f})")
    print(
        f"metrics on : median {on:.2f} GB/s ({min(gbps['on']):.2f}-{max(gbps['on']):.2f}), "
        f"scraped every {args.scrape_ms} ms: {statistics.median(scrapes):.0f} scrapes per push "
        "(median, including the one before it)"
    )
    print(f"ratio on/off of medians: {on / off:.3f}; median of per-iteration ratios: {paired:.3f}")
    c_off, c_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    print(
        f"CPU of the agents' process per GiB: off {c_off:.3f} s, on {c_on:.3f} s "
        f"(ratio {c_on / c_off:.3f}); the scraper process: "
        f"{statistics.median(scraper_cpu):.3f} s per push (its whole life, start included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
