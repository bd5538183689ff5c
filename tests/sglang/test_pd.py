"""Real SGLang prefill and decode servers with ``--disaggregation-transfer-backend kvlink``,
against a monolithic server of the same model (greedy output must be equal token for token)."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sglang import harness

# Four servers start at once on two cores (~2 min): the first test waits for them.
pytestmark = pytest.mark.timeout(600)

# prompt lengths in tokens: one page, a few, many chunked-prefill chunks, most of the context
LENGTHS = [3, 40, 130, 600, 1500]
CHUNK = 64   # prefill's --chunked-prefill-size: a 600-token prompt goes in 10 pushes


@pytest.fixture(scope="module")
def servers(sglang_model: Path, other_model: Path, log_dir: Path, cluster_secret: str
            ) -> Iterator[dict[str, harness.Server]]:
    env = {"KVLINK_NICS": "loopback:2", "KVLINK_SECRET": cluster_secret}
    made = {
        "mono": harness.Server("mono", sglang_model, log_dir=log_dir, cpu=0),
        "prefill": harness.Server("prefill", sglang_model, log_dir=log_dir, mode="prefill",
                                  bootstrap_port=harness.free_port(), cpu=0, env=env,
                                  args=["--chunked-prefill-size", str(CHUNK)]),
        # another model of the same shape: its KV is valid bytes, but wrong for decode's model
        "wrong": harness.Server("wrong-prefill", other_model, log_dir=log_dir, mode="prefill",
                                bootstrap_port=harness.free_port(), cpu=0, env=env),
        "decode": harness.Server("decode", sglang_model, log_dir=log_dir, mode="decode",
                                 bootstrap_port=0, cpu=1, env=env),
    }
    try:
        harness.start_all(list(made.values()))
        yield made
    finally:
        harness.close_all(list(made.values()))


def mono_ids(servers: dict[str, harness.Server], prompt: str) -> list[int]:
    status, answer, _ = harness.generate(servers["mono"].url, harness.request_body(prompt))
    assert status == 200, answer
    ids = harness.output_ids(answer)
    assert ids and len(ids) == 8
    return ids


def pd_ids(servers: dict[str, harness.Server], prompt: str, prefill: str = "prefill"
           ) -> list[int] | None:
    r = harness.pd_generate(servers[prefill], servers["decode"], prompt)
    assert r["prefill_status"] == 200, r
    assert r["decode_status"] == 200, r
    return harness.output_ids(r["decode"])


@pytest.mark.parametrize("n", LENGTHS)
def test_decode_output_equals_monolithic(servers: dict[str, harness.Server], n: int) -> None:
    prompt = harness.prompt_of(n, seed=n)
    assert pd_ids(servers, prompt) == mono_ids(servers, prompt)


def test_concurrent_requests(servers: dict[str, harness.Server]) -> None:
    prompts = [harness.prompt_of(n, seed=1000 + n) for n in (50, 200, 333, 700)]
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: pd_ids(servers, p), prompts))
    assert got == [mono_ids(servers, p) for p in prompts]


def test_negative_control_wrong_kv_changes_the_output(servers: dict[str, harness.Server]) -> None:
    """Decode's tokens come from the KV it was sent: KV of other weights changes them (and the
    same decode with the right prefill matches again)."""
    prompts = [harness.prompt_of(n, seed=2000 + n) for n in (40, 130, 600)]
    want = [mono_ids(servers, p) for p in prompts]
    wrong = [pd_ids(servers, p, prefill="wrong") for p in prompts]
    assert all(w != m for w, m in zip(wrong, want, strict=False)), (wrong, want)
    assert [pd_ids(servers, p) for p in prompts] == want


def test_decode_answers_with_prefills_first_token(servers: dict[str, harness.Server]) -> None:
    """The first token comes from prefill through the aux buffers of the last chunk."""
    prompt = harness.prompt_of(90, seed=3)
    r = harness.pd_generate(servers["prefill"], servers["decode"], prompt, max_new_tokens=1)
    assert r["decode_status"] == 200, r
    assert harness.output_ids(r["decode"]) == mono_ids(servers, prompt)[:1]
