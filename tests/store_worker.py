"""A process that works a kvlink.store until it is killed (tests/integration/test_store_crash.py,
bench/store_crash.py): random puts, gets, deletes, prefetches and pins over a host and a disk
tier, every block's bytes a function of its key so any wrong byte served is caught.

At start it re-opens the store's directory and checks every block the re-index kept. It prints
one line per event on stdout ("open <blocks> <discarded>", "ops <n>", "WRONG ...", "done
<peak RSS KiB> <files>") and exits 3 on a wrong byte.

    python -m tests.store_worker DIR --ops N --seed S [--owner ETCD_URL NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import time

import numpy as np

import kvlink
from kvlink.store import Store, StoreConfig

BLOCK_BYTES = 16384
KEYS = 120  # more than the two tiers hold: evictions and drops all the time
HOST_SLOTS, DISK_SLOTS = 8, 48


def key(i: int) -> bytes:
    return hashlib.sha256(b"crash-test-%d" % i).digest()


def content(k: bytes) -> bytes:
    rng = np.random.default_rng(int.from_bytes(k[:8], "little"))
    return rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes()


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--ops", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-through", action="store_true")
    args = ap.parse_args()
    slot = 4096 + BLOCK_BYTES
    agent = kvlink.Agent(f"crash-{os.getpid()}", kvlink.Config(nics=["127.0.0.1"]))
    store = Store(
        agent,
        StoreConfig(
            block_bytes=BLOCK_BYTES,
            host_bytes=HOST_SLOTS * slot,
            disk_path=args.dir,
            disk_bytes=DISK_SLOTS * slot,
            write_policy="write-through" if args.write_through else "write-back",
            eviction="arc" if args.seed % 2 else "lru",
            remote=False,
        ),
    )
    st = store.stats()
    # every block the re-index kept must be exactly what was put under its key
    for i in range(KEYS):
        got = store.get_bytes(key(i))
        if got is not None and got != content(key(i)):
            say(f"WRONG at open: key {i}")
            return 3
    say(f"open {st.blocks['disk']} {st.discarded}")
    rng = np.random.default_rng(args.seed)
    pinned: list[bytes] = []
    for n in range(1, args.ops + 1):
        r = rng.random()
        k = key(int(rng.integers(0, KEYS)))
        if r < 0.4:
            with contextlib.suppress(kvlink.store.StoreFullError):
                store.put_bytes(k, content(k))
        elif r < 0.75:
            got = store.get_bytes(k)
            if got is not None and got != content(k):
                say(f"WRONG: op {n}")
                return 3
        elif r < 0.85:
            store.delete([k])
        elif r < 0.95:
            first = int(rng.integers(0, KEYS - 4))
            pf = store.prefetch([key(first + j) for j in range(4)], policy="best-effort")
            pf.wait(timeout_s=1.0)
            pf.release()
        elif len(pinned) < 3 and store.pin([k]):
            pinned.append(k)
        elif pinned:
            store.unpin([pinned.pop()])
        if n % 100 == 0:
            say(f"ops {n}")
    store.unpin(pinned)
    store.close()
    agent.close()
    # the peak of this process's own memory (ru_maxrss would carry the parent's from fork)
    with open("/proc/self/status") as f:
        rss = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    say(f"done {rss} {len(os.listdir(args.dir))}")
    time.sleep(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
