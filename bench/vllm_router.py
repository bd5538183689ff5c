"""TTFT and throughput of 2 prefill + 2 decode vLLM OpenAI servers behind vllm-router, with
KvlinkConnector (pull through the router's nixl flow, push through its mooncake flow) and,
where it is installed, NixlConnector, each against a baseline of the same run: the same four
servers behind vllm-router in its regular mode (each request computed whole by one of them, no
KV moved).

    .venv/bin/python bench/vllm_router.py --json out.jsonl
    .venv/bin/python bench/vllm_router.py --connector kvlink --requests 32 --rate 0.5

Per connector: four servers (`python -m vllm.entrypoints.openai.api_server` from .venv-vllm,
prefill i and decode i computing on core i % 2: VLLM_CPU_OMP_THREADS_BIND), the tiny 8-layer
model of bench/vllm_ttft.py (8 KiB of KV a token), started together; then two routers in front
of them: `vllm-router --vllm-pd-disaggregation --kv-connector nixl` (the pull flow both
connectors serve) and `vllm-router --worker-urls` (the baseline). After a warm-up through both
(connections and NIXL's handshakes are made then), each round sends the same `--requests`
prompts (token ids, lengths uniform in `--lengths`, seeded) at a fixed `--rate` through the
baseline router and then through the P/D one (the order alternates between rounds), streaming,
greedy, `--max-tokens` each.

Per phase: TTFT (request sent to first streamed token, through the router) p50 and p99,
end-to-end p50, requests per second (answers / first send to last answer), errors, each
server's share of the requests (its own `vllm:request_success_total`), and how many texts equal
the baseline's. KvlinkConnector's per-request records (decode's log) add the KV transfer's
median. Ratios P/D / baseline are printed at the end. One JSON row per phase with --json.

vllm-router and NIXL: `make vllm-venv` installs the router (tests/vllm/add_router.sh);
NixlConnector needs `.venv-vllm/bin/pip install --no-deps nixl-cu12 nixl` and runs over UCX's
TCP transport on `lo` (../shared/vllm/README.md's recipe); without it only kvlink runs. On CPU
vLLM's NIXL worker pins its model thread to the last core of each NUMA node
(nixl/base_worker.py: `os.sched_setaffinity(0, [last core])`): on a 2-core host all four
servers then compute on core 1 beside four UCX progress threads that busy-poll, and the run
crawls (seen here: forward passes stuck for minutes). `--nixl-unpin` makes that call a no-op
in the NIXL servers (a sitecustomize.py on their PYTHONPATH), so that they compute on the
cores VLLM_CPU_OMP_THREADS_BIND gives them, as the kvlink servers do.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.vllm import harness, servers

# bench/vllm_ttft.py's "tiny": 8 layers, hidden 256, 2 KV heads of 64 (fp32): 8 KiB a token
MODEL_ARGS = ["--layers", "8", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
              "--head-dim", "64"]


def nixl_problem() -> str | None:
    out = subprocess.run([str(harness.PYTHON), "-c", "import nixl"], capture_output=True,
                         text=True, timeout=120)
    if out.returncode:
        return ("nixl is not installed in .venv-vllm (.venv-vllm/bin/pip install --no-deps "
                "nixl-cu12 nixl)")
    return None


UNPIN = """\
# bench/vllm_router.py --nixl-unpin: vLLM's NIXL worker on CPU pins its model thread to the
# last core (nixl/base_worker.py); keep the cores VLLM_CPU_OMP_THREADS_BIND gives it instead.
import os
os.sched_setaffinity = lambda pid, cpus: None
"""


def start_servers(connector: str, model: Path, log_dir: Path, nics: str, max_model_len: int,
                  unpin: bool = False, bootstrap: list[int] | None = None
                  ) -> tuple[list[servers.Server], list[servers.Server]]:
    """Two prefill and two decode servers with ``connector``, started together; with
    ``bootstrap``, prefill i serves its cards on port bootstrap[i] (kvlink's push behind the
    router)."""
    secret = secrets.token_hex(16)
    site = log_dir / "unpin"
    if connector == "nixl" and unpin:
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(UNPIN)
    made: list[servers.Server] = []
    try:
        for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
            for i in range(2):
                env: dict[str, str] = {}
                if connector.startswith("kvlink"):
                    extra: dict[str, Any] = {"nics": nics}
                    extra.update({"lease_s": 120.0} if role == "kv_producer"
                                 else {"load_timeout_s": 60.0})
                    if bootstrap and role == "kv_producer":
                        extra.update(bootstrap_port=bootstrap[i], bootstrap_host="127.0.0.1")
                    kv: dict[str, Any] = {**servers.KVLINK, "kv_role": role,
                                          "kv_load_failure_policy": "recompute",
                                          "kv_connector_extra_config": extra}
                    env["KVLINK_SECRET"] = secret
                else:  # ../shared/vllm/README.md's NIXL-on-CPU recipe
                    kv = {"kv_connector": "NixlConnector", "kv_role": role,
                          "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute"}
                    env.update({"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo",
                                "UCX_MODULES": "^ib,ib_mlx5,ib_mlx5_ext",
                                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(servers.free_port()),
                                "VLLM_HOST_IP": "127.0.0.1"})
                    if unpin:
                        env["PYTHONPATH"] = os.pathsep.join(
                            p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
                made.append(servers.Server(f"{connector}-{name}{i}", model, log_dir=log_dir,
                                           kv=kv, cpu=i, env=env,
                                           max_model_len=max_model_len))
        servers.wait_ready(made, timeout_s=900)
    except BaseException:
        for s in made:
            s.close()
        raise
    return made[:2], made[2:]


def stream(base: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One streamed completion: status, TTFT and end-to-end seconds, text."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout_s)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return {"status": r.status, "error": r.read()[:300].decode(errors="replace"),
                    "t_end": time.perf_counter()}
        ttft = None
        text = []
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            piece = json.loads(line[5:])["choices"][0]["text"]
            if ttft is None and piece:
                ttft = time.perf_counter() - t0
            text.append(piece)
        end = time.perf_counter()
        return {"status": 200, "ttft_s": ttft, "e2e_s": end - t0, "text": "".join(text),
                "t_end": end}
    except OSError as exc:
        return {"status": 0, "error": str(exc), "t_end": time.perf_counter()}
    finally:
        conn.close()


def run_phase(base: str, model: str, prompts: list[list[int]], rate: float, max_tokens: int,
              timeout_s: float = 900) -> tuple[list[dict[str, Any]], float]:
    """Sends ``prompts`` at ``rate`` a second (one thread each); the answers and the seconds
    from the first send to the last answer. A request with no answer ``timeout_s`` after the
    last send counts as an error."""
    results: list[dict[str, Any]] = [{} for _ in prompts]

    def one(i: int) -> None:
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        results[i] = stream(base, body, timeout_s=timeout_s)

    t0 = time.perf_counter()
    threads = []
    for i in range(len(prompts)):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i,), daemon=True)
        th.start()
        threads.append(th)
    end = time.perf_counter() + timeout_s
    for th in threads:
        th.join(timeout=max(0.0, end - time.perf_counter()))
    for i, r in enumerate(results):
        if not r:  # its thread is still waiting (a daemon: it does not hold the exit)
            results[i] = {"status": 0, "error": f"no answer within {timeout_s} s",
                          "t_end": end}
    return results, max(r.get("t_end", t0) for r in results) - t0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def records(s: servers.Server) -> list[dict[str, Any]]:
    """KvlinkConnector's per-request records in ``s``'s log."""
    out = []
    for line in s.log_path.read_text(errors="replace").splitlines():
        i = line.find("kvlink request {")
        if i >= 0:
            out.append(json.loads(line[i + len("kvlink request "):]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", choices=["kvlink", "kvlink-push", "nixl", "both"],
                    default="both",
                    help="kvlink: pull (the router's nixl flow); kvlink-push: push (its mooncake "
                    "flow); both: kvlink, kvlink-push, then NixlConnector where it is installed")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=1.0, help="requests a second")
    ap.add_argument("--lengths", default="256,1900", help="prompt tokens, uniform in MIN,MAX")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--policy", default="round_robin", help="vllm-router's --policy")
    ap.add_argument("--nics", default="loopback:2", help="KvlinkConnector's nics")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phase-timeout-s", type=float, default=900,
                    help="after the last send, how long a phase waits for its answers")
    ap.add_argument("--nixl-unpin", action="store_true",
                    help="stop vLLM's NIXL worker from pinning its model thread to the last core")
    ap.add_argument("--json", default=None, help="append one JSON row per phase here")
    ap.add_argument("--work", default=None, help="model and logs (default: a temp dir)")
    a = ap.parse_args()
    # Stopped by a signal, the servers and routers (their own process groups) are closed too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    problem = servers.router_problem()
    if problem:
        sys.exit(problem)
    connectors = ["kvlink", "kvlink-push", "nixl"] if a.connector == "both" else [a.connector]
    if "nixl" in connectors and (why := nixl_problem()):
        if a.connector == "nixl":
            sys.exit(why)
        print(f"# NixlConnector skipped: {why}", flush=True)
        connectors.remove("nixl")
    work = Path(a.work or tempfile.mkdtemp(prefix="kvlink-vllm-router-"))
    work.mkdir(parents=True, exist_ok=True)
    model = harness.make_model(work / "model-tiny", *MODEL_ARGS)
    lo, hi = (int(x) for x in a.lengths.split(","))
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(4, 1020) for _ in range(rng.randint(lo, hi))]
               for _ in range(a.requests)]
    max_model_len = hi + a.max_tokens + 32
    print(f"# {a.requests} requests at {a.rate}/s, {lo}-{hi} prompt tokens (mean "
          f"{statistics.mean(map(len, prompts)):.0f}), {a.max_tokens} tokens each; logs in "
          f"{work}", flush=True)
    summary: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for connector in connectors:
        summary[connector] = bench_connector(a, connector, model, work, prompts, max_model_len)
    print("\n# P/D over baseline (the same servers behind vllm-router's regular mode, same run)")
    for connector, rows in summary.items():
        for pd_row, base_row in zip(rows["pd"], rows["baseline"], strict=True):
            ratios = {k: (pd_row[k] / base_row[k] if pd_row[k] and base_row[k] else None)
                      for k in ("ttft_p50_ms", "ttft_p99_ms", "rps")}
            print(f"{connector:7s} round {pd_row['round']}: TTFT p50 "
                  f"{fmt(ratios['ttft_p50_ms'])} x ({pd_row['ttft_p50_ms']:.0f} vs "
                  f"{base_row['ttft_p50_ms']:.0f} ms), p99 {fmt(ratios['ttft_p99_ms'])} x "
                  f"({pd_row['ttft_p99_ms']:.0f} vs {base_row['ttft_p99_ms']:.0f} ms), req/s "
                  f"{fmt(ratios['rps'])} x ({pd_row['rps']:.2f} vs {base_row['rps']:.2f})")


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def bench_connector(a: argparse.Namespace, connector: str, model: Path, work: Path,
                    prompts: list[list[int]], max_model_len: int
                    ) -> dict[str, list[dict[str, Any]]]:
    log_dir = work / f"logs-{connector}"
    log_dir.mkdir(exist_ok=True)
    t_start = time.monotonic()
    push = connector == "kvlink-push"
    boot = [servers.free_port() for _ in range(2)] if push else None
    prefill, decode = start_servers(connector, model, log_dir, a.nics, max_model_len,
                                    a.nixl_unpin, boot)
    children: list[servers.Child] = [*prefill, *decode]
    out: dict[str, list[dict[str, Any]]] = {"baseline": [], "pd": []}
    try:
        print(f"# {connector}: 4 servers up in {time.monotonic() - t_start:.0f} s", flush=True)
        pd = servers.Router([p.url for p in prefill], [d.url for d in decode],
                            log_dir=log_dir, policy=a.policy, name="router-pd",
                            kv_connector="mooncake" if push else "nixl", bootstrap=boot)
        plain = servers.Router([], [], log_dir=log_dir, policy=a.policy, name="router-plain",
                               workers=[s.url for s in prefill + decode])
        children += [pd, plain]
        servers.wait_ready([pd, plain], timeout_s=180)
        name = json.loads(servers.get(f"{pd.url}/v1/models"))["data"][0]["id"]
        warm = prompts[:4]
        for router in (pd, plain):  # connections, handshakes, first-request costs
            res, _ = run_phase(router.url, name, warm, 4.0, 2)
            bad = [r for r in res if r.get("status") != 200]
            if bad:
                raise RuntimeError(f"warm-up through {router.name} failed: {bad[0]}")
        measured: list[tuple[dict[str, Any], list[str | None]]] = []
        for rnd in range(a.rounds):
            order = [("baseline", plain), ("pd", pd)]
            if rnd % 2:
                order.reverse()
            for phase, router in order:
                row = measure(a, connector, phase, rnd, router, name, prompts, prefill, decode)
                measured.append((row, row.pop("texts")))
        # Greedy: every answer is the first baseline round's text for the same prompt.
        base_texts = next(t for row, t in measured if row["phase"] == "baseline")
        for row, texts in measured:
            row["same_text_as_baseline"] = sum(
                t is not None and t == b for t, b in zip(texts, base_texts, strict=True))
            print(json.dumps(row), flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
            out[row["phase"]].append(row)
    finally:
        for c in reversed(children):
            c.close()
    return out


def measure(a: argparse.Namespace, connector: str, phase: str, rnd: int,
            router: servers.Router, model: str, prompts: list[list[int]],
            prefill: list[servers.Server], decode: list[servers.Server]) -> dict[str, Any]:
    insts = prefill + decode
    before = [servers.metrics(s.metrics(), "vllm:request_success_total") for s in insts]
    recs0 = [len(records(s)) for s in insts] if connector.startswith("kvlink") else []
    load0 = os.getloadavg()[0]
    results, wall = run_phase(router.url, model, prompts, a.rate, a.max_tokens,
                              a.phase_timeout_s)
    time.sleep(2)  # the last answers' counters
    served = [servers.metrics(s.metrics(), "vllm:request_success_total") - b
              for s, b in zip(insts, before, strict=True)]
    ok = [r for r in results if r.get("status") == 200 and r.get("ttft_s") is not None]
    ttft = [r["ttft_s"] * 1000 for r in ok]
    row: dict[str, Any] = {
        "bench": "vllm_router", "connector": connector, "phase": phase, "round": rnd,
        "requests": len(prompts), "rate": a.rate, "max_tokens": a.max_tokens,
        "nixl_unpin": a.nixl_unpin if connector == "nixl" else None,
        "ok": len(ok), "errors": [r.get("error", "")[:200] for r in results if r not in ok],
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "e2e_p50_ms": pct([r["e2e_s"] * 1000 for r in ok], 50),
        "rps": len(ok) / wall if wall > 0 else None, "wall_s": round(wall, 2),
        "served": {s.name: round(n) for s, n in zip(insts, served, strict=True)},
        "load_avg": [round(load0, 1), round(os.getloadavg()[0], 1)],
        "t_unix": round(time.time(), 1),
        "texts": [r.get("text") if r in ok else None for r in results],
    }
    total = {"prefill": sum(served[:2]), "decode": sum(served[2:]), "all": sum(served)}
    if phase == "pd":
        row["share"] = {s.name: round(n / total["prefill" if i < 2 else "decode"], 3)
                        if total["prefill" if i < 2 else "decode"] else None
                        for i, (s, n) in enumerate(zip(insts, served, strict=True))}
    else:
        row["share"] = {s.name: round(n / total["all"], 3) if total["all"] else None
                        for s, n in zip(insts, served, strict=True)}
    if connector.startswith("kvlink") and phase == "pd":
        # Where the time went: the connector's per-request phases (docs/vllm.md, "Where a
        # request's time goes"), medians over this phase's requests.
        new = [r for s, n0 in zip(insts, recs0, strict=True) for r in records(s)[n0:]]
        row["kvlink_loads_ok"] = sum(r["ok"] for r in new if r["role"] == "decode")
        for role, key in (("prefill", "prefill_queue"), ("prefill", "prefill_compute"),
                          ("decode", "decode_admission"), ("decode", "kv_transfer"),
                          ("decode", "decode_first_step")):
            vals = [r["phases"][key] * 1000 for r in new
                    if r["role"] == role and key in r["phases"]]
            row[f"kvlink_{key}_p50_ms"] = pct(vals, 50)
    return row


if __name__ == "__main__":
    main()
