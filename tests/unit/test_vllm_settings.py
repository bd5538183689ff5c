"""kvlink.integrations.vllm without vLLM: settings validation and the card / params / offer
formats (the connector itself is tested on real vLLM in tests/vllm)."""

from __future__ import annotations

import dataclasses
import sys
import time

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
        ({"bootstrap_port": 0}, "['bootstrap_port']: expected a TCP port in 1..65535"),
        ({"bootstrap_port": "8998"}, "['bootstrap_port']"),
        ({"bootstrap_host": ""}, "['bootstrap_host']"),
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
    assert isinstance(src, proto.PullSource) and src.blocks == [[3, 4]] and src.tag == "t"
    # several KV cache groups: one list per group, null blocks (0) kept for the positions
    two = proto.parse_decode_params({**pull, "remote_block_ids": [[0, 4], [3, 5]]})
    assert isinstance(two, proto.PullSource) and two.blocks == [[0, 4], [3, 5]]
    assert proto.blocks_to_wire(two.blocks) == [[0, 4], [3, 5]]
    assert proto.blocks_to_wire([[3, 4]]) == [3, 4]  # one group: NixlConnector's flat list
    with pytest.raises(proto.ParamsError, match=r"\['remote_block_ids'\]\[1\]"):
        proto.parse_decode_params({**pull, "remote_block_ids": [[1], [-2]]})
    with pytest.raises(proto.ParamsError, match="more than 16 KV cache groups"):
        proto.parse_decode_params({**pull, "remote_block_ids": [[1]] * 17})
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
    offer = proto.Offer("t1", 1, [blocks], 12.5)
    assert proto.parse_offer(proto.make_offer(offer)) == offer
    groups = proto.Offer("t1", 1, [[0, 0, 7, 8], [3, 4, 5, 6]], 12.5, first=2)
    assert proto.parse_offer(proto.make_offer(groups)) == groups
    with pytest.raises(proto.ParamsError, match=r"offer\['groups'\]\[1\]"):
        proto.parse_offer({**proto.make_offer(groups), "groups": [[[1, 1]], "x"]})
    with pytest.raises(proto.ParamsError, match="more than"):  # a peer's runs are bounded
        proto.parse_offer({**proto.make_offer(offer), "blocks": [[0, 1 << 20]] * 5})
    assert proto.parse_offer({"nbytes": 1}) is None
    with pytest.raises(proto.ParamsError, match="blocks"):
        proto.parse_offer({proto.OFFER_KEY: "t", "v": proto.VERSION, "rank": 0,
                           "blocks": [[1, 0]], "expires": 1})
    with pytest.raises(proto.ParamsError, match=r"offer\['rank'\]"):
        proto.parse_offer({**proto.make_offer(offer), "rank": 64})


def test_fallbacks() -> None:
    fb = proto.Fallback("t1", 1, [[7, 8, 9, 3]], "kvl/P/r1", 12.5, 30.0)
    raw = proto.make_fallback(fb)
    assert proto.parse_fallback(raw) == fb
    assert proto.parse_offer(raw) is None  # not an offer: the two never mix
    assert proto.parse_fallback(proto.make_offer(proto.Offer("t1", 0, [[1]], 1.0))) is None
    two = proto.Fallback("t1", 0, [[0, 8], [3, 4]], "kvl/P/r1", 12.5, 30.0)
    assert proto.parse_fallback(proto.make_fallback(two)) == two
    with pytest.raises(proto.ParamsError, match=r"fallback\['tag'\]"):
        proto.parse_fallback({**raw, "tag": ""})
    with pytest.raises(proto.ParamsError, match=r"fallback\['max_pull_s'\]"):
        proto.parse_fallback({**raw, "max_pull_s": "x"})
    with pytest.raises(proto.ParamsError, match="version"):
        proto.parse_fallback({**raw, "v": 1})


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
    offer = proto.make_offer(proto.Offer("t1", 0, [[3, 4]], 1e9))
    offer["expires"] = bad
    with pytest.raises(proto.ParamsError, match="expires"):
        proto.parse_offer(offer)
    fb = proto.make_fallback(proto.Fallback("t1", 0, [[5]], "tag", 1e9, 30.0))
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


def shard_cards(tp: int, kv_heads: int, head_bytes: int = 4096, replicated: bool = False,
                block_bytes: int | None = None) -> list[proto.Card]:
    """One engine's cards, one per rank (layouts alike: the mapping needs only the sizes)."""
    per = 1 if replicated else max(1, kv_heads // tp)
    nbytes = block_bytes or per * (head_bytes or 4096)
    layout = kv.PagedLayout((1, 2), (0, 0), 16, nbytes)
    return [proto.Card(f"a{r}", "{}", layout, 32, None,
                       proto.Shard(r, tp, 0 if replicated else kv_heads,
                                   0 if replicated else head_bytes, replicated))
            for r in range(tp)]


def test_rank_mapping_same_split_is_whole_blocks() -> None:
    for tp in (1, 2, 4):
        got = proto.pieces(shard_cards(tp, 8), shard_cards(tp, 8))
        assert got == [proto.Piece(r, r, 0, 0, 8 // tp * 4096) for r in range(tp)]


def test_rank_mapping_more_prefill_ranks() -> None:
    # P TP=2 -> D TP=1: decode's two heads come from prefill's two ranks, one head each
    assert proto.pieces(shard_cards(2, 2), shard_cards(1, 2)) == [
        proto.Piece(0, 0, 0, 0, 4096), proto.Piece(1, 0, 0, 4096, 4096)]
    # P TP=4 -> D TP=2 with 8 heads: decode rank 1 holds heads 4..7 = prefill ranks 2 and 3
    got = proto.pieces(shard_cards(4, 8), shard_cards(2, 8))
    assert [p for p in got if p.dst_rank == 1] == [
        proto.Piece(2, 1, 0, 0, 8192), proto.Piece(3, 1, 0, 8192, 8192)]


def test_rank_mapping_fewer_prefill_ranks() -> None:
    # P TP=1 -> D TP=2: each decode rank cuts its head out of prefill's blocks
    assert proto.pieces(shard_cards(1, 2), shard_cards(2, 2)) == [
        proto.Piece(0, 0, 0, 0, 4096), proto.Piece(0, 1, 4096, 0, 4096)]
    # 2 heads over 4 decode ranks: ranks 0,1 share head 0, ranks 2,3 head 1
    got = proto.pieces(shard_cards(2, 2), shard_cards(4, 2))
    assert [(p.src_rank, p.dst_rank, p.src_offset, p.length) for p in got] == [
        (0, 0, 0, 4096), (0, 1, 0, 4096), (1, 2, 0, 4096), (1, 3, 0, 4096)]


def test_rank_mapping_replicated_kv_reads_one_copy() -> None:
    # MLA: every rank holds the whole latent KV; each decode rank reads one prefill rank's
    got = proto.pieces(shard_cards(2, 0, replicated=True, block_bytes=9216),
                       shard_cards(1, 0, replicated=True, block_bytes=9216))
    assert got == [proto.Piece(0, 0, 0, 0, 9216)]
    got = proto.pieces(shard_cards(1, 0, replicated=True, block_bytes=9216),
                       shard_cards(2, 0, replicated=True, block_bytes=9216))
    assert [(p.src_rank, p.dst_rank) for p in got] == [(0, 0), (0, 1)]


def test_rank_mapping_refusals() -> None:
    with pytest.raises(proto.ParamsError, match="interleaves heads"):
        proto.pieces(shard_cards(2, 2, head_bytes=0), shard_cards(1, 2, head_bytes=0))
    with pytest.raises(proto.ParamsError, match="not the same model"):
        proto.pieces(shard_cards(2, 4), shard_cards(1, 2))
    with pytest.raises(proto.ParamsError, match="replicated"):
        proto.pieces(shard_cards(1, 0, replicated=True), shard_cards(1, 2))


def test_cards_on_the_wire(make_agent) -> None:  # type: ignore[no-untyped-def]
    c = card(make_agent("p"))
    cards = [dataclasses.replace(c, agent=f"p{r}", shard=proto.Shard(r, 2, 2, 128))
             for r in range(2)]
    wire = proto.cards_to_wire(cards)
    assert isinstance(wire, list) and proto.cards_from_wire(wire, "x") == cards
    assert proto.cards_from_wire(proto.cards_to_wire([c]), "x") == [c]
    with pytest.raises(proto.ParamsError, match="rank order"):
        proto.cards_from_wire(wire[::-1], "x")
    with pytest.raises(proto.ParamsError, match=r"1\.\.64 cards"):
        proto.cards_from_wire([], "x")
    with pytest.raises(proto.ParamsError, match=r"\['tp'\]\['rank'\]"):
        proto.cards_from_wire([{**wire[0], "tp": {**wire[0]["tp"], "rank": -1}}], "x")
    with pytest.raises(proto.ParamsError, match="do not split"):
        proto.Shard.from_dict({"rank": 0, "size": 3, "kv_heads": 4, "head_bytes": 1,
                               "replicated": False}, "x")


def test_pull_notes() -> None:
    assert proto.parse_pull_note(proto.pull_note("kvl/P/r1", 3, 2).decode()) == ("kvl/P/r1", 3, 2)
    assert proto.parse_pull_note("kvl/P/r1") == ("kvl/P/r1", 0, 1)
    for bad in ("t|x|1", "t|1|0", "t|64|1", "t|0|65"):
        with pytest.raises(proto.ParamsError):
            proto.parse_pull_note(bad)
    assert proto.parse_release(proto.make_release("kvl/P/r1")) == "kvl/P/r1"
    assert proto.parse_release(proto.make_offer(proto.Offer("t", 0, [[1]], 1.0))) is None
    with pytest.raises(proto.ParamsError):
        proto.parse_release({proto.RELEASE_KEY: "", "v": proto.VERSION})


def test_piece_segments_cut_heads_out_of_blocks(make_agent) -> None:  # type: ignore[no-untyped-def]
    a = make_agent("seg")
    src = np.arange(2 * 8 * 64, dtype=np.uint8).reshape(2, 8, 64)  # 2 layers, 8 blocks of 64 B
    dst = np.zeros((2, 8, 128), np.uint8)  # blocks twice the size: two sources' heads
    a.register(src, remote_read=True)
    a.register(dst, remote_write=True)
    sl = kv.PagedLayout.from_tensors(a, list(src))
    dl = kv.PagedLayout.from_tensors(a, list(dst))
    segs = kv.block_segments(sl, dl, [1, 2], [5, 6], piece=(0, 64, 64))
    assert len(segs) == 4  # one per block and layer: pieces never merge
    assert list(segs["dst_offset"][:2]) == [5 * 128 + 64, 6 * 128 + 64]
    assert set(segs["len"]) == {64}
    with pytest.raises(kvlink.InvalidArgumentError, match="piece"):
        kv.block_segments(sl, dl, [1], [5], piece=(32, 100, 64))
    with pytest.raises(kvlink.InvalidArgumentError, match="blocks of 128 bytes"):
        kv.block_segments(sl, dl, [1], [5])


def test_cards_carry_kv_cache_groups(make_agent) -> None:  # type: ignore[no-untyped-def]
    c = card(make_agent("g"))
    assert "groups" not in c.to_dict()  # one full-attention group: the card says nothing
    hybrid = dataclasses.replace(c, groups=("sliding64x2", "fullx2"))
    assert proto.Card.from_dict(hybrid.to_dict(), "x") == hybrid
    with pytest.raises(proto.ParamsError, match=r"x\['groups'\]"):
        proto.Card.from_dict({**hybrid.to_dict(), "groups": []}, "x")
    # the two sides must move the same groups: a hybrid allocator on one side only is refused
    with pytest.raises(proto.ParamsError, match="hybrid KV cache manager"):
        proto.pieces([hybrid], [c])
    assert proto.pieces([hybrid], [hybrid]) == [proto.Piece(0, 0, 0, 0, c.layout.block_bytes)]


def test_router_push_params() -> None:
    """vllm-router's push flow (--kv-connector mooncake) names no card: a transfer id on both
    sides, prefill's bootstrap address at decode."""
    assert proto.router_push({"do_remote_decode": True}) is None
    assert proto.router_push({"do_remote_decode": True, "transfer_id": "xfer-1"}) == (
        "xfer-1", None)
    assert proto.parse_prefill_push({"do_remote_decode": True, "transfer_id": "xfer-1"}) == (
        "xfer-1", None)
    dec = {"do_remote_prefill": True, "transfer_id": "xfer-1",
           "remote_bootstrap_addr": "http://10.0.0.5:8998", "remote_engine_id": "e"}
    assert proto.router_push(dec) == ("xfer-1", "http://10.0.0.5:8998")
    with pytest.raises(proto.ParamsError, match="remote_bootstrap_addr"):
        proto.router_push({**dec, "remote_bootstrap_addr": "http://x:1/evil?path"})
    with pytest.raises(proto.ParamsError, match="transfer id"):
        proto.router_push({**dec, "transfer_id": "a b"})
    # kvlink's own params win over the router's fields
    assert proto.router_push({**dec, "kvlink_push": {}}) is None


def test_offers_may_carry_decode_card(make_agent) -> None:  # type: ignore[no-untyped-def]
    c = card(make_agent("d"))
    offer = proto.Offer("t1", 0, [[1, 2]], 12.5, card=c)
    assert proto.parse_offer(proto.make_offer(offer)) == offer
    other = dataclasses.replace(c, shard=proto.Shard(1, 2))
    with pytest.raises(proto.ParamsError, match="rank 1's card"):
        proto.parse_offer(proto.make_offer(dataclasses.replace(offer, card=other)))


def test_bootstrap_server_and_fetcher(make_agent) -> None:  # type: ignore[no-untyped-def]
    """A prefill's cards over a real HTTP socket, fetched in the background at decode."""
    import json
    import time
    import urllib.request

    from kvlink.integrations.vllm._bootstrap import BootstrapServer, CardFetcher

    c = card(make_agent("p"))
    server = BootstrapServer("127.0.0.1", 0, "engine-p", c.to_dict(), [c.agent])
    try:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{base}/query", timeout=5) as r:
            assert json.loads(r.read()) == {"0": {"engine_id": "engine-p",
                                                  "worker_addr": {"0": {"0": c.agent}}}}
        fetcher = CardFetcher(timeout_s=5)
        assert fetcher.cards(base) is None  # fetching: the scheduler asks again later
        end = time.monotonic() + 10
        while (got := fetcher.cards(base)) is None:
            assert time.monotonic() < end
            time.sleep(0.01)
        assert got == [c]
        # a prefill without the server: the error names the address and the setting
        bad = f"http://127.0.0.1:{server.port + 1 if server.port < 65535 else 1}"
        fetcher.cards(bad)
        while True:
            try:
                if fetcher.cards(bad) is None:
                    time.sleep(0.01)
                    continue
            except proto.ParamsError as exc:
                assert "bootstrap_port" in str(exc) and bad in str(exc)
                break
            raise AssertionError("a card from a port nobody serves")
    finally:
        server.close()
    with pytest.raises(kvlink.ConfigError, match="bootstrap_port"):
        taken = BootstrapServer("127.0.0.1", 0, "x", c.to_dict(), [c.agent])
        try:
            BootstrapServer("127.0.0.1", taken.port, "y", c.to_dict(), [c.agent])
        finally:
            taken.close()


def test_bootstrap_server_bounds_its_clients(make_agent) -> None:  # type: ignore[no-untyped-def]
    """Idle connections cannot pile up threads: past MAX_CLIENTS the server closes new ones
    at once, and serves again once the idle ones are gone."""
    import socket
    import urllib.request

    from kvlink.integrations.vllm import _bootstrap
    from kvlink.integrations.vllm._bootstrap import BootstrapServer

    c = card(make_agent("p"))
    server = BootstrapServer("127.0.0.1", 0, "engine-p", c.to_dict(), [c.agent])
    idle = []
    try:
        for _ in range(_bootstrap.MAX_CLIENTS):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        end = time.monotonic() + 10
        while server._httpd._slots._value:  # until the server took them all
            assert time.monotonic() < end
            time.sleep(0.01)
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        extra.sendall(b"GET /query HTTP/1.0\r\n\r\n")
        assert extra.recv(100) == b""  # closed without an answer
        extra.close()
        for s in idle:
            s.close()
        idle = []
        end = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/query",
                                            timeout=5) as r:
                    assert r.status == 200
                break
            except OSError:
                assert time.monotonic() < end
                time.sleep(0.1)
    finally:
        for s in idle:
            s.close()
        server.close()
