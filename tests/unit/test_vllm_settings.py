"""kvlink.integrations.vllm without vLLM: settings validation and the card / params / offer
formats (the connector itself is tested on real vLLM in tests/vllm)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import kvlink
from kvlink import kv
from kvlink.integrations.vllm import Mode, parse_settings
from kvlink.integrations.vllm import _protocol as proto


def test_importing_the_integration_does_not_import_vllm() -> None:
    assert "vllm" not in sys.modules
    import kvlink.integrations.vllm  # noqa: F401

    assert "vllm" not in sys.modules


def test_defaults_and_values() -> None:
    s = parse_settings(None)
    assert s.mode is Mode.AUTO and s.lease_s == 30.0
    s = parse_settings({"mode": "push", "nics": ["127.0.0.1"], "chunk_bytes": "4MiB",
                        "secret": "x" * 32, "lease_s": 2, "load_timeout_s": 1.5})
    assert s.mode is Mode.PUSH and s.nics == ("127.0.0.1",) and s.chunk_bytes == 4 << 20
    cfg = s.kvlink_config()
    assert cfg.chunk_bytes == 4 << 20 and cfg.transfer_timeout_s == 1.5
    assert "x" * 32 not in repr(s)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"mdoe": "pull"}, "unknown key 'mdoe' (did you mean 'mode'?)"),
        ({"mode": "stream"}, "'mode']: 'stream' is not a mode"),
        ({"nics": 3}, "['nics']: expected"),
        ({"nics": []}, "['nics']: expected"),
        ({"chunk_bytes": "4 parsecs"}, "['chunk_bytes']"),
        ({"chunk_bytes": True}, "['chunk_bytes']"),
        ({"secret": "short"}, "['secret']: expected a str of 16..256 bytes"),
        ({"lease_s": 0}, "['lease_s']: 0 is outside"),
        ({"load_timeout_s": "5"}, "['load_timeout_s']: expected seconds as a number"),
        ({"offer_timeout_s": float("nan")}, "['offer_timeout_s']"),
        ({"allow_unauthenticated": "yes"}, "['allow_unauthenticated']: expected true/false"),
        ({"agent_name": ""}, "['agent_name']"),
        (["mode"], "expected a dict"),
    ],
)
def test_bad_settings_name_the_key(extra: object, message: str) -> None:
    with pytest.raises(kvlink.ConfigError) as err:
        parse_settings(extra)  # type: ignore[arg-type]
    assert message in str(err.value)
    assert "kv_connector_extra_config" in str(err.value)


def test_kvlink_refusals_name_the_setting() -> None:
    with pytest.raises(kvlink.ConfigError, match="kv_connector_extra_config: nics"):
        parse_settings({"nics": "no-such-nic0"}).kvlink_config()


def card(agent: kvlink.Agent) -> proto.Card:
    cache = np.zeros((2, 8, 256), np.uint8)
    agent.register(cache, remote_read=True, remote_write=True)
    layout = kv.PagedLayout.from_tensors(agent, list(cache))
    return proto.Card(agent.name, agent.metadata().decode(), layout, 32)


def test_params_round_trip_and_refusals(make_agent) -> None:  # type: ignore[no-untyped-def]
    c = card(make_agent("p"))
    d = c.to_dict()
    assert proto.Card.from_dict(d, "x") == c
    pull = {"do_remote_prefill": True, "remote_block_ids": [3, 4],
            "kvlink": {"card": d, "tag": "t", "expires": 1.0, "max_pull_s": 5}}
    src = proto.parse_decode_params(pull)
    assert isinstance(src, proto.PullSource) and src.blocks == [3, 4] and src.tag == "t"
    push = {"do_remote_prefill": True, "kvlink_push": {"transfer_id": "abc-1", "prefill": d}}
    src2 = proto.parse_decode_params(push)
    assert isinstance(src2, proto.PushSource) and src2.transfer_id == "abc-1"

    with pytest.raises(proto.ParamsError, match="neither 'kvlink'"):
        proto.parse_decode_params({"do_remote_prefill": True})
    with pytest.raises(proto.ParamsError, match=r"\['remote_block_ids'\]"):
        proto.parse_decode_params({**pull, "remote_block_ids": [-1]})
    with pytest.raises(proto.ParamsError, match="card version"):
        proto.parse_decode_params({**pull, "kvlink": {**pull["kvlink"], "card": {**d, "v": 9}}})
    with pytest.raises(proto.ParamsError, match=r"\['max_pull_s'\]"):
        proto.parse_decode_params({**pull, "kvlink": {**pull["kvlink"], "max_pull_s": None}})
    with pytest.raises(proto.ParamsError, match="transfer id"):
        proto.parse_decode_params({"kvlink_push": {"transfer_id": "a b", "prefill": d}})
    assert proto.parse_prefill_push({"do_remote_decode": True}) is None


def test_offers() -> None:
    blocks = [5, 6, 7, 9, 10, 2]
    assert proto.runs(blocks) == [[5, 3], [9, 2], [2, 1]]
    tid, back, exp = proto.parse_offer(proto.make_offer("t1", blocks, 12.5)) or ("", [], 0)
    assert (tid, back, exp) == ("t1", blocks, 12.5)
    assert proto.parse_offer({"nbytes": 1}) is None
    with pytest.raises(proto.ParamsError, match="blocks"):
        proto.parse_offer({proto.OFFER_KEY: "t", "v": 1, "blocks": [[1, 0]], "expires": 1})
