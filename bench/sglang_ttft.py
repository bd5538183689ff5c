"""Decode-side time and end-to-end TTFT of real SGLang prefill/decode pairs with kvlink's
transfer backend and with SGLang's own ``mooncake_tcp`` backend, in one run.

    .venv/bin/python bench/sglang_ttft.py --model big --json /tmp/sglang_ttft.jsonl
    .venv/bin/python bench/sglang_ttft.py --model big --testbed 4x2gbit --json /tmp/sgl_tb.jsonl

Every backend's pair runs at once (prefills pinned to core 0, decodes to core 1: SGLang on CPU,
tests/sglang/harness.py, from .venv-sglang; `make sglang-venv` builds it), and the rounds
interleave the backends, so each row's backends saw the same machine. Per request (greedy, one
output token) the client sends the same body to prefill and decode at once, as SGLang's router
does, and records:

- ``ttft_ms``: from sending to decode's answer (its first token) arriving, end to end;
- ``decode_side_ms``: from the end of prefill's forward pass (SGLang's own
  ``prefill_finished_time``, prefill runs with ``--enable-metrics``) to decode's answer: the
  KV transfer, decode noticing it and decode's first step. Both clocks are this host's.

Backends (``--backends``): ``kvlink`` (its default transport: on one host, two processes copy
process to process, "shm"; on the testbed TCP over every link), ``kvlink_tcp``
(``KVLINK_TRANSPORT=tcp``: kvlink's TCP on loopback too), ``mooncake_tcp`` (SGLang's Mooncake
backend with its TCP transport; needs ``apt-get install libibverbs1``).

``--testbed 4x2gbit`` (root): a kvlink.testbed.Testbed, prefill in namespace a and decode in b,
4 veth links shaped to 2gbit each. kvlink uses its side's 4 addresses; Mooncake and SGLang's
control plane use link 0 (``SGLANG_HOST_IP``). The client runs in namespace a (this script
re-runs itself there).

Each answer's token is compared across backends (they must agree). One JSON row per request,
then a summary row per (backend, length) with medians; ``--json`` appends rows to a file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.sglang import harness

# (layers, hidden, heads, kv-heads, head-dim): tiny = tests' model (2 KiB of fp32 KV a token);
# big = 16 layers x 8 KV heads x 128: 128 KiB a token, 237 MiB for a 1900-token prompt.
MODELS = {
    "tiny": [],
    "big": ["--layers", "16", "--hidden", "256", "--heads", "8", "--kv-heads", "8",
            "--head-dim", "128"],
}
SECRET = "kvlink-bench-sglang-secret-0123456789"
BACKENDS = ("kvlink", "kvlink_tcp", "mooncake_tcp")


def backend_env(backend: str, addrs: list[str], host: str) -> tuple[str, dict[str, str]]:
    """(SGLang's --disaggregation-transfer-backend, environment) of one server."""
    env = {"SGLANG_HOST_IP": host}
    if backend.startswith("kvlink"):
        env["KVLINK_SECRET"] = SECRET
        env["KVLINK_NICS"] = ",".join(addrs) if addrs != ["127.0.0.1"] else "loopback:4"
        if backend == "kvlink_tcp":
            env["KVLINK_TRANSPORT"] = "tcp"
        return "kvlink", env
    env["MC_TCP_ENABLE_CONNECTION_POOL"] = "true"
    return "mooncake_tcp", env


def inner(a: argparse.Namespace) -> None:
    """Runs the servers and the client (in namespace a on the testbed)."""
    net = json.loads(a.net)
    work = Path(a.workdir)
    model = harness.make_model(work / f"model-{a.model}", *MODELS[a.model])
    backends = a.backends.split(",")
    lengths = [int(x) for x in a.lengths.split(",")]
    pairs: dict[str, tuple[harness.Server, harness.Server]] = {}
    extra = ["--max-total-tokens", "4096", "--context-length", "2048"]
    with contextlib.ExitStack() as stack:
        for b in backends:
            bport = harness.free_port()
            pname, penv = backend_env(b, net["a"], net["a"][0])
            dname, denv = backend_env(b, net["b"], net["b"][0])
            p = harness.Server(f"{b}-prefill", model, log_dir=work, mode="prefill",
                               backend=pname, bootstrap_port=bport, cpu=0, env=penv,
                               args=["--enable-metrics", *extra], host=net["a"][0])
            d = harness.Server(f"{b}-decode", model, log_dir=work, mode="decode",
                               backend=dname, bootstrap_port=bport, cpu=1, env=denv,
                               args=extra, host=net["b"][0], prefix=net.get("prefix_b"))
            stack.callback(p.close)
            stack.callback(d.close)
            pairs[b] = (p, d)
        harness.start_all([s for pair in pairs.values() for s in pair], timeout_s=900)
        for b, (p, d) in pairs.items():   # connections, handshakes, first-use costs
            for n in (64, lengths[0]):
                r = harness.pd_generate(p, d, harness.prompt_of(n, seed=n), max_new_tokens=1)
                if r["decode_status"] != 200:
                    raise SystemExit(f"{b}: warm-up failed: {r}")
        tokens: dict[tuple[int, int], dict[str, Any]] = {}
        for rnd in range(a.rounds):
            for n in lengths:
                prompt = harness.prompt_of(n, seed=10_000 * rnd + n)
                order = backends if rnd % 2 == 0 else backends[::-1]
                for b in order:
                    p, d = pairs[b]
                    row = measure(p, d, prompt)
                    tokens.setdefault((rnd, n), {})[b] = row.pop("token")
                    emit(a, {"backend": b, "round": rnd, "length": n, **row})
        disagree = [k for k, v in tokens.items() if len(set(map(str, v.values()))) > 1]
        emit(a, {"metric": "tokens_agree", "value": not disagree, "disagree": disagree})


def measure(p: harness.Server, d: harness.Server, prompt: str) -> dict[str, Any]:
    t0 = time.time()
    r = harness.pd_generate(p, d, prompt, max_new_tokens=1, timeout_s=300)
    t_decode = t0 + r["decode_s"]
    if r["decode_status"] != 200 or r["prefill_status"] != 200:
        raise SystemExit(f"request failed: {json.dumps(r)[:2000]}")
    meta = r["prefill"].get("meta_info", {})
    prefill_done = meta.get("prefill_finished_time")
    return {
        "ttft_ms": round(r["decode_s"] * 1e3, 2),
        "prefill_reply_ms": round(r["prefill_s"] * 1e3, 2),
        "decode_side_ms": (round((t_decode - float(prefill_done)) * 1e3, 2)
                           if prefill_done else None),
        "token": harness.output_ids(r["decode"]),
    }


def emit(a: argparse.Namespace, row: dict[str, Any]) -> None:
    row = {"bench": "sglang_ttft", "run": a.run, "model": a.model, "network": a.network, **row}
    print(json.dumps(row), flush=True)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(r["backend"], r["length"]) for r in rows if "backend" in r},
                  key=lambda k: (k[1], k[0]))
    for b, n in keys:
        mine = [r for r in rows if r.get("backend") == b and r.get("length") == n]
        out.append({
            "metric": "summary", "backend": b, "length": n, "rounds": len(mine),
            "ttft_ms_p50": round(statistics.median(r["ttft_ms"] for r in mine), 2),
            "decode_side_ms_p50": round(statistics.median(
                r["decode_side_ms"] for r in mine if r["decode_side_ms"] is not None), 2)
            if any(r["decode_side_ms"] is not None for r in mine) else None,
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="big")
    ap.add_argument("--backends", default="kvlink,kvlink_tcp,mooncake_tcp")
    ap.add_argument("--lengths", default="256,1024,1900")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--testbed", choices=["4x2gbit"], default=None)
    ap.add_argument("--testbed-tag", default="sg")
    ap.add_argument("--json", default=None, help="append rows to this file")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--net", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--network", default="loopback", help=argparse.SUPPRESS)
    a = ap.parse_args()
    for b in a.backends.split(","):
        if b not in BACKENDS:
            ap.error(f"--backends: unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    if a.inner:
        inner(a)
        return
    problem = harness.venv_problem()
    if problem:
        sys.exit(problem)
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="kvlink-sglang-bench-")
    run_id = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    base = [sys.executable, __file__, "--inner", "--model", a.model, "--backends", a.backends,
            "--lengths", a.lengths, "--rounds", str(a.rounds), "--workdir", a.workdir,
            "--run", run_id]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if a.testbed:
            from kvlink.testbed import Testbed

            links, rate = a.testbed.split("x")
            tb = stack.enter_context(Testbed(links=int(links), rate=rate, tag=a.testbed_tag))
            net = {"a": tb.addresses("a"), "b": tb.addresses("b"),
                   "prefix_b": tb.exec_prefix("b")}
            cmd = [*tb.exec_prefix("a"), *base, "--network", a.testbed]
        else:
            net = {"a": ["127.0.0.1"], "b": ["127.0.0.1"]}
            cmd = [*base, "--network", "loopback"]
        load0 = os.getloadavg()
        with subprocess.Popen([*cmd, "--net", json.dumps(net)], stdout=subprocess.PIPE,
                              text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                with contextlib.suppress(ValueError):
                    rows.append(json.loads(line))
        if proc.returncode:
            sys.exit(f"the benchmark failed (rc {proc.returncode}); logs in {a.workdir}")
    tail = [*summarize(rows), {"metric": "loadavg", "start": load0, "end": os.getloadavg()}]
    for row in tail:
        row = {"bench": "sglang_ttft", "run": run_id, "model": a.model,
               "network": a.testbed or "loopback", **row}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.json:
        with open(a.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
