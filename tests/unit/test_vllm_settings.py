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
        ({"discovery": "consul://x"}, "['discovery']: expected 'static' (the default"),
        ({"discovery": 5}, "['discovery']: expected 'static'"),
        ({"discovery": "etcd://user:pw@h:2379"}, "['discovery']"),
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


def test_fallbacks() -> None:
    fb = proto.Fallback("t1", [7, 8, 9, 3], "kvl/P/r1", 12.5, 30.0)
    raw = proto.make_fallback(fb)
    assert proto.parse_fallback(raw) == fb
    assert proto.parse_offer(raw) is None  # not an offer: the two never mix
    assert proto.parse_fallback(proto.make_offer("t1", [1], 1.0)) is None
    with pytest.raises(proto.ParamsError, match=r"fallback\['tag'\]"):
        proto.parse_fallback({**raw, "tag": ""})
    with pytest.raises(proto.ParamsError, match=r"fallback\['max_pull_s'\]"):
        proto.parse_fallback({**raw, "max_pull_s": "x"})
    with pytest.raises(proto.ParamsError, match="version"):
        proto.parse_fallback({**raw, "v": 2})


def test_discovery_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLINK_SECRET", raising=False)
    monkeypatch.delenv("KVLINK_SECRET_FILE", raising=False)
    assert parse_settings({"discovery": "static"}).discovery is None
    s = parse_settings({"discovery": "etcd://10.0.0.5:2379/prod", "secret": "x" * 32})
    assert s.discovery == "etcd://10.0.0.5:2379/prod"
    assert s.kvlink_config().discovery == "etcd://10.0.0.5:2379/prod"
    # without the cluster secret no region key would be published: refused at start
    with pytest.raises(kvlink.ConfigError, match=r"\['discovery'\]: .* needs the cluster secret"):
        parse_settings({"discovery": "etcd://10.0.0.5:2379"}).kvlink_config()


def test_discovery_cards(make_agent) -> None:  # type: ignore[no-untyped-def]
    c = card(make_agent("p"))
    slim = proto.Card(c.agent, None, c.layout, 32, "00000000000000ab")
    d = slim.to_dict()
    assert "metadata" not in d and proto.Card.from_dict(d, "x") == slim
    with pytest.raises(proto.ParamsError, match="neither 'metadata'"):
        proto.Card.from_dict({**d, "instance": "xyz"}, "x")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1", True, None])
def test_offer_and_fallback_expiry_must_be_finite(bad: object) -> None:
    # An expiry that never passes would keep its entry in decode's or prefill's tables forever.
    offer = proto.make_offer("t1", [3, 4], 1e9)
    offer["expires"] = bad
    with pytest.raises(proto.ParamsError, match="expires"):
        proto.parse_offer(offer)
    fb = proto.make_fallback(proto.Fallback("t1", [5], "tag", 1e9, 30.0))
    fb["max_pull_s"] = bad
    with pytest.raises(proto.ParamsError, match="max_pull_s"):
        proto.parse_fallback(fb)


def test_relays_setting(tmp_path, make_agent) -> None:  # type: ignore[no-untyped-def]
    relay = make_agent("relay-x", nics="127.0.0.3", relay=True, accept_relayed=False)
    path = tmp_path / "relay.json"
    path.write_bytes(relay.metadata())
    s = parse_settings({"relays": [str(path)], "nics": "127.0.0.1"})
    assert s.relays == (str(path),)
    assert s.kvlink_config().relays == (str(path),)
    # the worker's agent routes through it with nothing else set
    agent = make_agent("vllm-worker-0", **dataclasses_fields(s.kvlink_config()))
    assert agent.relays() == ["relay-x"]
    with pytest.raises(kvlink.ConfigError, match=r"\['relays'\].*cannot read relay metadata"):
        parse_settings({"relays": [str(tmp_path / "missing.json")]})
    not_a_relay = tmp_path / "plain.json"
    not_a_relay.write_bytes(make_agent("plain", nics="127.0.0.4").metadata())
    with pytest.raises(kvlink.ConfigError, match=r"\['relays'\].*does not relay"):
        parse_settings({"relays": str(not_a_relay)})
    with pytest.raises(kvlink.ConfigError, match=r"\['relays'\]: expected a list"):
        parse_settings({"relays": [3]})


def dataclasses_fields(cfg: kvlink.Config) -> dict[str, object]:
    """The fields of ``cfg`` that differ from the defaults (for make_agent's overrides)."""
    import dataclasses

    base = kvlink.Config()
    return {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if getattr(cfg, f.name) != getattr(base, f.name) and f.name != "nics"
    }
