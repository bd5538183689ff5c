"""``kvlink top`` during a testbed link cut (root): the capture in docs/cluster.md.

    sudo .venv/bin/python bench/top_link_cut.py [--links 2] [--rate 1gbit] [--size 512MiB]

Builds a testbed, starts a sender on side a serving its metrics on 127.0.0.1:9400 inside its
namespace and a receiver on side b, pushes ``--size``, cuts link 1 after 0.5 s, prints
``kvlink top --once`` (run inside side a's namespace) while the push goes on without the
link, then again after the push, and checks every byte arrived. The testbed is taken down
at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import threading
import time

import kvlink.testbed as kt
from kvlink.bench import Worker
from kvlink.bench.measure import size_arg

PORT = 9400


def top(tb: kt.Testbed) -> str:
    cmd = [*tb.exec_prefix("a"), sys.executable, "-m", "kvlink.cli.main", "top",
           f"127.0.0.1:{PORT}", "--once", "--interval-ms", "200"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                         env={**os.environ, "COLUMNS": "180"})  # fmt: skip
    return out.stdout + out.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--size", type=size_arg, default=512 << 20)
    args = ap.parse_args()
    ok, why = kt.is_available()
    if not ok:
        print(f"the testbed is not available here: {why}", file=sys.stderr)
        return 2
    os.environ.setdefault("KVLINK_SECRET", secrets.token_hex(16))
    tag = "top" + secrets.token_hex(2)
    tb = kt.Testbed(links=args.links, rate=args.rate, tag=tag)
    tb.up()
    workers: list[Worker] = []
    try:
        rx = Worker("rx", name="decode-3", nics=",".join(tb.addresses("b")),
                    prefix=tb.exec_prefix("b"))  # fmt: skip
        workers.append(rx)
        tx = Worker("tx", name="prefill-0", nics=",".join(tb.addresses("a")),
                    config={"metrics_port": PORT}, prefix=tb.exec_prefix("a"))  # fmt: skip
        workers.append(tx)
        rx.call("alloc", key="kv", nbytes=args.size, remote_write=True, name="kv")
        tx.call("alloc", key="src", nbytes=args.size, seed=1)
        tx.call("add_peer", metadata=rx.metadata.decode())
        xid = int(tx.call("push", peer="decode-3", local="src", remote="kv")["id"])
        cut = threading.Timer(0.5, tb.link_down, args=(1,))
        cut.start()
        time.sleep(1.6)
        during = top(tb)
        info = tx.call("wait", id=xid, wait_s=120, answer_s=130)
        cut.join()
        after = top(tb)
        same = tx.call("digest", key="src")["digest"] == rx.call("digest", key="kv")["digest"]
        print(f"== {args.links} links at {args.rate}, {args.size >> 20} MiB push, link 1 cut "
              f"at 0.5 s; kvlink top 1.6 s after the push started ==")
        print(during)
        print(f"== after the push ({info.get('retries')} chunk retries; every byte verified: "
              f"{same}) ==")
        print(after)
        return 0 if same else 1
    finally:
        for w in workers:
            w.close()
        tb.down()


if __name__ == "__main__":
    sys.exit(main())
