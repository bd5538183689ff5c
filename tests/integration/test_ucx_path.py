"""kvlink's engine over UCX paths (docs/ucx.md, engine integration steps 1-5):
two agents with transport="ucx" and a cluster secret push over UCX's TCP on
loopback (payload by UCX put, header / crc32c trailer / ACK on the path's TCP
connection), byte-exact; a peer with transport="tcp" refuses the offer and
that path runs TCP; what a UCX path does not carry (pull, regions registered
after its set-up) goes in-stream on the same connection.  Without UCX these
skip saying why; in CI (KVLINK_REQUIRE_ALL=1) they fail instead."""

from __future__ import annotations

import numpy as np
import pytest

import kvlink
from kvlink import _transport
from tests.conftest import unavailable

SECRET = "kvlink-test-secret-0123456789abcdef"
MiB = 1 << 20

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def ucx_over_tcp(monkeypatch):
    """UCX's TCP transport only ("UCX over TCP on loopback"); kvlink sets each
    worker's NET_DEVICES itself.  libucp reads UCX_TLS at every worker's
    creation, so setting it here is enough."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_MODULES", "^ib,ib_mlx5,ib_mlx5_ext")
    ok, why = _transport.ucx_status()
    if not ok:
        unavailable(f"UCX not usable here: {why}")


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def pair(make_agent, rx_transport="ucx", tx_transport="ucx", paths=2, secret=SECRET):
    rx = make_agent("rx", nics=f"loopback:{paths}", transport=rx_transport, secret=secret)
    tx = make_agent("tx", nics=f"loopback:{paths}", transport=tx_transport, secret=secret)
    return rx, tx


def test_push_64mib_over_ucx_byte_exact(make_agent):
    rx, tx = pair(make_agent)
    n = 64 * MiB + 4093  # not a multiple of anything: the last piece is short
    dst = np.zeros(n, dtype=np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = pattern(n, 1)
    tx.register(src)
    tx.add_peer(rx.metadata())
    paths = tx.paths()
    assert [p.transport for p in paths] == ["ucx", "ucx"], [p.transport_note for p in paths]
    assert all(p.transport_note.startswith("UCX 1.") for p in paths), paths
    t = tx.push("rx", src=src, dst="kv")
    t.wait(timeout_s=120)
    assert np.array_equal(src, dst)
    # the payload went over UCX puts: every byte is counted as sent on the paths,
    # and both paths carried chunks
    paths = tx.paths()
    assert sum(p.bytes_sent for p in paths) >= n
    assert all(p.chunks_done > 0 for p in paths), [(p.index, p.chunks_done) for p in paths]
    # a second push into the same region (new contents) lands too
    src2 = pattern(n, 2)
    tx.register(src2)
    tx.push("rx", src=src2, dst="kv").wait(timeout_s=120)
    assert np.array_equal(src2, dst)


def test_ucx_refused_by_a_tcp_peer_runs_tcp(make_agent):
    rx, tx = pair(make_agent, rx_transport="tcp")
    n = 8 * MiB + 7
    dst = np.zeros(n, dtype=np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = pattern(n, 3)
    tx.register(src)
    tx.add_peer(rx.metadata())
    for p in tx.paths():
        assert p.transport == "tcp"
        assert "refused UCX" in p.transport_note and "transport='tcp'" in p.transport_note, (
            p.transport_note
        )
    tx.push("rx", src=src, dst="kv").wait(timeout_s=60)
    assert np.array_equal(src, dst)


def test_tcp_initiator_never_offers(make_agent):
    rx, tx = pair(make_agent, tx_transport="tcp")
    dst = np.zeros(MiB, dtype=np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = pattern(MiB, 4)
    tx.register(src)
    tx.add_peer(rx.metadata())
    assert [(p.transport, p.transport_note) for p in tx.paths()] == [("tcp", "transport='tcp'")] * 2
    tx.push("rx", src=src, dst="kv").wait(timeout_s=60)
    assert np.array_equal(src, dst)


def test_transport_ucx_needs_a_secret(make_agent):
    with pytest.raises(kvlink.ConfigError, match="secret"):
        make_agent("u", nics="loopback:1", transport="ucx", secret=None)


def test_region_registered_after_setup_goes_in_stream(make_agent):
    """A region the path has no UCX key for (registered after its set-up;
    UCX_KEYS is not built) is pushed in-stream on the same connection."""
    rx, tx = pair(make_agent)
    early = np.zeros(MiB, dtype=np.uint8)
    rx.register(early, remote_write=True, name="early")
    tx.add_peer(rx.metadata())
    late = np.zeros(4 * MiB + 1, dtype=np.uint8)
    rx.register(late, remote_write=True, name="late")
    src = pattern(late.size, 5)
    tx.register(src)
    tx.add_peer(rx.metadata())  # the new region's access key; the paths stay as set up
    tx.push("rx", src=src, dst="late").wait(timeout_s=60)
    assert np.array_equal(src, late)
    src_e = pattern(early.size, 6)
    tx.register(src_e)
    tx.push("rx", src=src_e, dst="early").wait(timeout_s=60)
    assert np.array_equal(src_e, early)
    assert all(p.transport == "ucx" for p in tx.paths())


def test_pull_between_ucx_agents_is_byte_exact(make_agent):
    """Pull over UCX is not built: READ_RESP goes in-stream on the UCX paths."""
    rx, tx = pair(make_agent)
    n = 16 * MiB + 3
    remote = pattern(n, 7)
    rx.register(remote, remote_read=True, name="kv")
    tx.add_peer(rx.metadata())
    local = np.zeros(n, dtype=np.uint8)
    tx.register(local)
    tx.pull("rx", src="kv", dst=local).wait(timeout_s=60)
    assert np.array_equal(local, remote)


def test_out_of_region_push_on_a_ucx_path_is_refused(make_agent):
    """A range outside the peer's region is refused before any put (the
    region table's bounds, as over TCP); kvl_ucx_put checks each put against
    the key's own bounds again (tests/c/test_ucx.c)."""
    rx, tx = pair(make_agent)
    dst = np.zeros(MiB, dtype=np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = pattern(2 * MiB, 8)
    tx.register(src)
    tx.add_peer(rx.metadata())
    with pytest.raises(kvlink.KvlinkError, match="has only 1048576 from offset 0"):
        tx.push("rx", src=src, dst="kv").wait(timeout_s=30)
    assert not dst.any()


def test_no_hedged_copies_onto_or_from_ucx_paths(make_agent):
    """A late UCX put cannot be drained at the receiver and the fence is not
    built (docs/ucx.md, "Cancel and duplicate copies"): the scheduler never
    sends a second copy of a chunk when a UCX path is involved.  Over TCP
    the same back-to-back pushes hedge at most tails (test_hedge.py)."""
    rx, tx = pair(make_agent, paths=4)
    dst = np.zeros(16 * MiB, dtype=np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    srcs = [pattern(16 * MiB, seed) for seed in (11, 12)]
    for s in srcs:
        tx.register(s)
    tx.add_peer(rx.metadata())
    for i in range(20):
        src = srcs[i % 2]  # alternate contents: a stray late copy would show
        tx.push("rx", src=src, dst="kv").wait(timeout_s=60)
        assert np.array_equal(src, dst), f"push {i}"
    paths = tx.paths()
    assert all(p.transport == "ucx" for p in paths), paths
    assert sum(p.hedges for p in paths) == 0, [(p.index, p.hedges) for p in paths]


def test_one_push_mixes_put_and_in_stream_chunks(make_agent):
    """One transfer whose destinations are a region with a UCX key on the
    paths (chunks go by put) and one registered after the set-up (chunks go
    in-stream on the same connections): both land byte-exact."""
    rx, tx = pair(make_agent)
    early = np.zeros(8 * MiB, dtype=np.uint8)
    r_early = rx.register(early, remote_write=True, name="early")
    tx.add_peer(rx.metadata())
    late = np.zeros(8 * MiB + 5, dtype=np.uint8)
    r_late = rx.register(late, remote_write=True, name="late")
    tx.add_peer(rx.metadata())  # the late region's access key
    src = pattern(early.size + late.size, 9)
    r_src = tx.register(src)
    segs = [
        kvlink.Segment(r_src.id, 0, r_early.id, 0, early.size),
        kvlink.Segment(r_src.id, early.size, r_late.id, 0, late.size),
    ]
    tx.push("rx", segments=segs).wait(timeout_s=60)
    assert np.array_equal(src[: early.size], early)
    assert np.array_equal(src[early.size :], late)
    assert all(p.transport == "ucx" for p in tx.paths())
