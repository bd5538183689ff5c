"""The P/D flows the vLLM connector tests drive on real engines (tests/vllm/harness.py
instances): prefill then decode (pull), both at once (push), and waiting until an instance
holds nothing."""

from __future__ import annotations

import random
import time
from typing import Any

from tests.vllm.harness import Instance

MAX_TOKENS = 8


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1024) for _ in range(n)] for n in lengths]


def negative_pair() -> list[list[int]]:
    """Two prompts of one length and one last token that differ everywhere else."""
    a, b = prompts_of([96, 96], 3)
    b[-1] = a[-1]
    return [a, b]


def settle(inst: Instance) -> None:
    """Steps ``inst`` until it holds nothing (as a server's loop does); fails if it still holds
    a request or a block."""
    end = time.monotonic() + 30
    while True:
        inst.call({"op": "pump", "seconds": 1}, timeout_s=60)
        st = inst.call({"op": "stats"})
        if st["sched_requests"] == 0 and st["free_blocks"] == st["total_blocks"] - 1:
            return  # block 0 is vLLM's null block
        assert time.monotonic() < end, f"{inst.name} still holds: {st}"


def push_run(p: Instance, d: Instance, prompts: list[list[int]], tag: str) -> list[list[int]]:
    """The push flow as a proxy runs it: both requests at once, decode first; prefill steps on
    afterwards as a server does (an offer that comes after its forward pass is pushed then)."""
    pcard = p.call({"op": "card"})["card"]
    dcard = d.call({"op": "card"})["card"]
    tids = [f"{tag}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    d.send({"op": "generate", "prompts": prompts, "max_tokens": MAX_TOKENS, "params": [
        {"do_remote_prefill": True, "kvlink_push": {"transfer_id": t, "prefill": pcard}}
        for t in tids]})
    p.send({"op": "generate", "prompts": prompts, "max_tokens": 1, "params": [
        {"do_remote_decode": True, "kvlink_push": {"transfer_id": t, "decode": dcard}}
        for t in tids]})
    p.send({"op": "pump", "seconds": 30})
    p.recv(120)
    dec = d.recv(120)["outputs"]
    p.recv(60)
    assert [o["finish"] for o in dec] == ["length"] * len(prompts), dec
    return [o["tokens"] for o in dec]


def prefill(p: Instance, prompts: list[list[int]]) -> list[dict[str, Any]]:
    outs = p.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    for o in outs:
        assert o["params"] and o["params"]["do_remote_prefill"] is True, o
    return [o["params"] for o in outs]
