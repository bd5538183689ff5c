"""kvlink over UCX vs iperf3 / NIXL / kvlink TCP, interleaved rounds (docs/BENCHMARKS.md,
"kvlink over UCX against iperf3 and NIXL").

    .venv/bin/python bench/ucx_figures.py --where testbed|loopback --size 2GiB \
        --rounds 3 --tools kvlink-ucx,iperf3,nixl-defrails,kvlink-tcp --json out.jsonl
    .venv/bin/python bench/ucx_figures_summary.py out.jsonl

Reuses bench/peers/compare.py's run_iperf3 and kvlink.bench.peers.run_peer (NIXL workers from
bench/peers/.venvs/nixl: bench/peers/setup.sh, or a link to a venv with nixl-cu12).
kvlink runs in kvlink.bench.Worker processes as compare.py's run_kvlink does, with the
transport set through the environment (KVLINK_TRANSPORT reaches Config.load in each worker),
and each side's paths() read before and after the timed push (transport, bytes_put).
Every round runs the tools in the given order (A B C A B C ...). Each row carries the UTC time
and the load average at its start.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # the repository
PEERS_DIR = ROOT / "bench" / "peers"
SECRET = "ucxfig-benchmark-secret-0123456789abcdef"
UCX_BASE = {"UCX_MODULES": "^ib,ib_mlx5,ib_mlx5_ext"}

# A clean environment for every tool: nothing of KVLINK_* / UCX_* leaks from ours.
for k in list(os.environ):
    if k.startswith(("KVLINK_", "UCX_")):
        del os.environ[k]

spec = importlib.util.spec_from_file_location("compare", ROOT / "bench/peers/compare.py")
compare = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
sys.modules["compare"] = compare
spec.loader.exec_module(compare)  # type: ignore[union-attr]

from kvlink.bench import peers as _peers  # noqa: E402
from kvlink.bench.measure import proc_cpu_s, size_arg  # noqa: E402
from kvlink.bench.peers import QUIET_S, WARM_BYTES, Run, TestbedWhere, Where, transfer_timeout_s  # noqa: E402
from kvlink.bench.worker import Worker  # noqa: E402

KV_ENV = {
    "kvlink-ucx": {
        "KVLINK_TRANSPORT": "ucx", "KVLINK_SECRET": SECRET, "UCX_TLS": "tcp", **UCX_BASE
    },
    # UCX_TLS unset: UCX may pick shared memory between two processes on one host.
    "kvlink-ucx-notls": {"KVLINK_TRANSPORT": "ucx", "KVLINK_SECRET": SECRET, **UCX_BASE},
    "kvlink-tcp": {"KVLINK_TRANSPORT": "tcp", "KVLINK_SECRET": SECRET},
}


def path_summary(ps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("transport", "transport_note", "bytes_put", "bytes_sent", "bytes_recv", "state",
            "local", "remote", "chunks_done", "reconnects", "hedges")
    return [{k: p.get(k) for k in keep if k in p} for p in ps]


def run_kvlink(where: Where, tool: str, size: int, it: int, npaths: int) -> Run:
    env = KV_ENV[tool]
    procs: list[Worker] = []
    try:
        if isinstance(where, TestbedWhere):
            nics = {s: ",".join(where.tb.addresses(s)) for s in "ab"}
        else:
            nics = {s: f"loopback:{npaths}" for s in "ab"}
        rx = Worker(f"rx{it}", name=f"rx{it}", nics=nics["b"], prefix=where.prefix("b"), env=env)
        procs.append(rx)
        tx = Worker(f"tx{it}", name=f"tx{it}", nics=nics["a"], prefix=where.prefix("a"), env=env)
        procs.append(tx)
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
        p0 = tx.call("paths")["paths"]
        links0 = where.link_tx_bytes()
        c0 = [proc_cpu_s(p.pid) for p in (tx, rx)]
        sub = tx.call("push", peer=peer, local="src", remote="kv")
        w = tx.call("wait", answer_s=wait_s + 30, id=sub["id"], wait_s=wait_s)
        c1 = [proc_cpu_s(p.pid) for p in (tx, rx)]
        links1 = where.link_tx_bytes()
        p1 = tx.call("paths")["paths"]
        prx = rx.call("paths")["paths"]
        tx.send("digest", key="src")
        rx.send("digest", key="dst")
        digests = [tx.recv(300)["digest"], rx.recv(300)["digest"]]
        put = sum(int(b.get("bytes_put") or 0) - int(a.get("bytes_put") or 0)
                  for a, b in zip(p0, p1, strict=True))
        sent = sum(int(b.get("bytes_sent") or 0) - int(a.get("bytes_sent") or 0)
                   for a, b in zip(p0, p1, strict=True))
        return Run(
            tool=tool, where=where.name, iteration=it, size_bytes=size,
            seconds=(w["t_done_ns"] - w["t_submit_ns"]) / 1e9,
            cpu_s=(c1[0] - c0[0]) + (c1[1] - c0[1]),
            cpu_tx_s=c1[0] - c0[0], cpu_rx_s=c1[1] - c0[1],
            verified=digests[0] == digests[1], warm_s=warm_s,
            link_bytes=[b - a for a, b in zip(links0, links1, strict=True)],
            extra={"nics_a": nics["a"], "retries": w.get("retries"), "chunks": w.get("chunks"),
                   "bytes_put_delta": put, "bytes_sent_delta": sent,
                   "put_share": put / size, "tx_transports": [p.get("transport") for p in p1],
                   "rx_transports": [p.get("transport") for p in prx],
                   "tx_paths": path_summary(p1), "env": {k: v for k, v in env.items()
                                                         if k != "KVLINK_SECRET"}},
        )  # fmt: skip
    finally:
        for p in reversed(procs):
            p.close()


def run_tool(where: Where, tool: str, size: int, it: int, npaths: int) -> Run:
    if tool in KV_ENV:
        return run_kvlink(where, tool, size, it, npaths)
    if tool == "iperf3":
        return compare.run_iperf3(where, size, it)
    return _peers.run_peer(PEERS_DIR, tool, where, size, it)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--where", choices=("loopback", "testbed"), required=True)
    ap.add_argument("--size", type=size_arg, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tools", required=True)
    ap.add_argument("--paths", type=int, default=2, help="loopback paths for kvlink")
    ap.add_argument("--tag", default="mf")
    ap.add_argument("--subnet-base", type=int, default=40)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    tools = [t.strip() for t in a.tools.split(",") if t.strip()]
    out = a.json.open("a")

    def emit(d: dict[str, Any]) -> None:
        out.write(json.dumps(d) + "\n")
        out.flush()

    emit({"kind": "meta", "argv": sys.argv, "utc": now(), "loadavg": os.getloadavg(),
          "tools": tools})  # fmt: skip
    with contextlib.ExitStack() as st:
        if a.where == "testbed":
            import kvlink.testbed as kt

            tb = st.enter_context(kt.Testbed(links=4, rate="2gbit", tag=a.tag,
                                             subnet_base=a.subnet_base))  # fmt: skip
            where: Where = TestbedWhere(tb)
        else:
            where = Where()
        for r in range(a.rounds):
            for tool in tools:
                la, t0 = os.getloadavg(), now()
                try:
                    run = run_tool(where, tool, a.size, r, a.paths)
                except Exception as exc:
                    emit({"kind": "failure", "tool": tool, "round": r, "utc": t0,
                          "loadavg": la, "reason": f"{type(exc).__name__}: {exc}"})
                    print(f"{t0} r{r} {tool} FAILED {exc}", flush=True)
                    continue
                d = run.as_dict() | {"round": r, "utc": t0, "loadavg": la,
                                     "loadavg_end": os.getloadavg(),
                                     "cpu_s_per_gib": run.cpu_s / (run.size_bytes / 2**30)}
                emit(d)
                print(f"{t0} load {la[0]:.2f} r{r} {tool:<16} {run.gbps:6.3f} GB/s "
                      f"cpu {run.cpu_s:5.2f} s (tx {run.cpu_tx_s:.2f} rx {run.cpu_rx_s:.2f}) "
                      f"ver {run.verified} links {d.get('links_used')} "
                      f"put {d.get('put_share', '-')} {d.get('tx_transports', '')}", flush=True)
    return 0


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")


if __name__ == "__main__":
    sys.exit(main())
