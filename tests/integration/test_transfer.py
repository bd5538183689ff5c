"""Push and pull between two processes over real loopback sockets."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
import pytest

import kvlink
from kvlink import _native, kv
from kvlink.bench.measure import random_bytes as pattern

# every test twice: I/O on the engine thread, and on two I/O threads (conftest.py)
pytestmark = pytest.mark.usefixtures("io_threads_mode")

MiB = 1 << 20
BIG = 256 * MiB


def digest(buf: np.ndarray[Any, Any]) -> str:
    return hashlib.blake2b(buf.data).hexdigest()


@pytest.mark.parametrize("paths", [1, 4])
def test_push_256mib_byte_exact(make_agent, spawn_peer, paths):
    rx = spawn_peer("rx", nics=f"loopback:{paths}")
    rx.call("alloc", key="kv", nbytes=BIG, remote_write=True, name="kv")
    tx = make_agent("tx", nics=f"loopback:{paths}")
    src = pattern(BIG, seed=paths)
    tx.register(src)
    tx.add_peer(rx.metadata)
    h = tx.push("rx", src=src, dst="kv", notify=b"done")
    h.wait(timeout_s=60)
    assert h.ok and h.bytes_done == BIG
    assert rx.call("digest", key="kv")["digest"] == digest(src)
    used = [p for p in tx.paths() if p.bytes_sent]
    assert len(used) == paths, f"expected every path to carry chunks: {tx.paths()}"
    sent = sum(p.bytes_sent for p in tx.paths())
    extra_copies = sum(p.hedges for p in tx.paths()) + h.info().retries
    # exactly the payload, unless a straggler was hedged or a chunk re-sent
    assert sent == BIG or (sent > BIG and extra_copies > 0), (sent, extra_copies)


@pytest.mark.parametrize("paths", [1, 4])
def test_pull_256mib_byte_exact(make_agent, spawn_peer, paths):
    src = spawn_peer("src", nics=f"loopback:{paths}")
    rid = src.call("alloc", key="kv", nbytes=BIG, seed=7, remote_read=True)["region"]
    me = make_agent("dst", nics=f"loopback:{paths}")
    dst = np.zeros(BIG, np.uint8)
    me.register(dst)
    me.add_peer(src.metadata)
    h = me.pull("src", src=rid, dst=dst, notify=b"pulled")
    h.wait(timeout_s=60)
    assert digest(dst) == src.call("digest", key="kv")["digest"]
    assert np.array_equal(dst[:4096], pattern(BIG, 7)[:4096])
    got = src.call("notifications", wait_s=5)["notifications"]
    assert got == [{"peer": "dst", "tag": b"pulled".hex(), "op": "PULL"}]


def test_scattered_paged_blocks(make_agent, spawn_peer):
    layers, planes, blocks, block_bytes = 8, 2, 64, 64 * 1024
    total = layers * planes * blocks * block_bytes
    rx = spawn_peer("rx", nics="loopback:4")
    rx.call("alloc", key="kv", nbytes=total, remote_write=True)
    dst_layout = kv.PagedLayout.from_dict(
        rx.call("layout", key="kv", layers=layers, planes=planes, num_blocks=blocks)["layout"]
    )
    tx = make_agent("tx", nics="loopback:4")
    cache = pattern(total, seed=3).reshape(layers, planes, blocks, block_bytes)
    tx.register(cache)
    src_layout = kv.PagedLayout.from_tensors(tx, list(cache), planes=planes)
    rng = np.random.default_rng(11)
    # a run of 5 consecutive blocks on both sides (merges into one segment),
    # then 15 scattered ones
    src_rest = rng.choice(np.setdiff1d(np.arange(blocks), np.arange(10, 15)), 15, replace=False)
    dst_rest = rng.choice(np.setdiff1d(np.arange(blocks), np.arange(40, 45)), 15, replace=False)
    src_ids = np.concatenate([np.arange(10, 15), src_rest])
    dst_ids = np.concatenate([np.arange(40, 45), dst_rest])
    segs = kv.block_segments(src_layout, dst_layout, src_ids, dst_ids)
    tx.add_peer(rx.metadata)
    tx.push("rx", segments=segs).wait(30)

    expected = np.zeros_like(cache)
    expected[:, :, dst_ids, :] = cache[:, :, src_ids, :]
    assert rx.call("digest", key="kv")["digest"] == digest(expected.reshape(-1))


def test_layer0_ready_before_transfer_completes(make_agent, spawn_peer):
    layers = 32
    total = 256 * MiB
    rx = spawn_peer("rx", nics="loopback:4")
    rx.call("alloc", key="kv", nbytes=total, remote_write=True)
    dst = kv.PagedLayout.from_dict(
        rx.call("layout", key="kv", layers=layers, planes=2, num_blocks=64)["layout"]
    )
    tx = make_agent("tx", nics="loopback:4")
    cache = np.ones(total, np.uint8).reshape(layers, 2, 64, -1)
    tx.register(cache)
    src = kv.PagedLayout.from_tensors(tx, list(cache), planes=2)
    tx.add_peer(rx.metadata)
    h = tx.push("rx", segments=kv.block_segments(src, dst, range(64), range(64)))
    h.wait_layer(0, timeout_s=30)
    events = list(h.chunks(timeout_s=30))
    info = h.info()
    assert info.state == kvlink.TransferState.DONE
    assert len(events) == info.chunks_total > 4
    closing = [i for i, e in enumerate(events) if 0 in e.layers]
    assert len(closing) == 1, "exactly one chunk completes layer 0"
    assert closing[0] < len(events) - 1
    assert events[closing[0]].t_ns < info.t_done_ns
    closed = sorted(layer for e in events for layer in e.layers)
    assert closed == list(range(layers)), "every layer is reported complete exactly once"


def test_notifications_exactly_once(make_agent, spawn_peer):
    rx = spawn_peer("rx", nics="loopback:2")
    rx.call("alloc", key="kv", nbytes=8 * MiB, remote_write=True, name="kv")
    tx = make_agent("tx", nics="loopback:2")
    src = np.ones(MiB, np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata)
    tags = [f"req-{i}".encode() for i in range(6)]
    for i, tag in enumerate(tags):
        tx.push("rx", src=src, dst="kv", dst_offset=i * MiB, notify=tag).wait(10)
    tx.push("rx", src=src, dst="kv", dst_offset=7 * MiB).wait(10)  # no tag: no notification
    got: list[str] = []
    deadline = time.monotonic() + 10
    while len(got) < len(tags) and time.monotonic() < deadline:
        got += [n["tag"] for n in rx.call("notifications", wait_s=1)["notifications"]]
    got += [n["tag"] for n in rx.call("notifications", wait_s=0.5)["notifications"]]
    assert sorted(got) == sorted(t.hex() for t in tags)


def test_sixteen_concurrent_transfers(make_agent, spawn_peer):
    n, size = 16, 8 * MiB
    peer = spawn_peer("peer", nics="loopback:4")
    peer.call("alloc", key="in", nbytes=n * size, remote_write=True, name="in")
    out_rid = peer.call("alloc", key="out", nbytes=n * size, seed=5, remote_read=True)["region"]
    me = make_agent("me", nics="loopback:4")
    src = pattern(n * size, seed=9)
    sink = np.zeros(n * size, np.uint8)
    me.register(src)
    me.register(sink)
    me.add_peer(peer.metadata)
    handles = []
    for i in range(n):
        sl = slice(i * size, (i + 1) * size)
        handles.append(me.push("peer", src=src[sl], dst="in", dst_offset=i * size))
        handles.append(me.pull("peer", src=out_rid, dst=sink[sl], src_offset=i * size))
    for h in handles:
        h.wait(timeout_s=60)
    assert len({h.id for h in handles}) == 2 * n
    assert peer.call("digest", key="in")["digest"] == digest(src)
    assert digest(sink) == peer.call("digest", key="out")["digest"]


def test_peer_killed_before_push_gives_clear_error(make_agent, spawn_peer):
    # a dead peer looks like every link cut: the push waits for a path until its deadline
    # (test_links_down.py), then names each path and its reason
    rx = spawn_peer("rx", nics="loopback:2")
    rx.call("alloc", key="kv", nbytes=MiB, remote_write=True, name="kv")
    tx = make_agent("tx", nics="loopback:2")
    src = np.ones(MiB, np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata)
    rx.kill()
    with pytest.raises(kvlink.ConnectionLostError, match=r"all 2 path\(s\) are down") as ei:
        tx.push("rx", src=src, dst="kv", timeout_s=1.0).wait(timeout_s=30)
    msg = str(ei.value)
    assert "peer 'rx'" in msg and "path 0 " in msg and "path 1 " in msg, msg


def test_peer_killed_mid_transfer_fails_at_its_deadline(make_agent, scripted_receiver):
    # The receiver withholds every ACK, so the push is still running when it dies, however
    # fast the machine: the kill always lands mid-transfer.
    rx = scripted_receiver("rx", paths=2, region="kv", nbytes=BIG)
    tx = make_agent("tx", nics="loopback:2")
    src = np.ones(BIG, np.uint8)
    region = tx.register(src)
    tx.add_peer(rx.metadata)
    h = tx.push("rx", src=src, dst="kv", timeout_s=5)
    assert rx.data_seen.wait(10), "the push sent no DATA"
    assert not h.done
    rx.kill()
    with pytest.raises(kvlink.ConnectionLostError, match=r"deadline.*all 2 path\(s\) are down"):
        h.wait(timeout_s=30)
    assert not h.ok
    # the agent is still usable and frees the transfer's regions
    assert tx.paths()[0].state in (kvlink.PathState.DOWN, kvlink.PathState.PROBING)
    tx.deregister(region)


def _segment(src_region: int, dst_region: int, n: int) -> np.ndarray[Any, Any]:
    seg = np.zeros(1, kvlink.SEGMENT_DTYPE)
    seg[0] = (src_region, 0, dst_region, 0, n, 0, 0)
    return seg


def test_submit_never_waits_for_the_peers_region_table(make_agent, scripted_receiver):
    # kvl_xfer_submit used to ask the peer for its region table itself when a segment named
    # a region the table lacked, and to wait up to connect_timeout_s for the answer.  This
    # receiver never answers REGIONS_REQ: a submit that asked would wait the 30 s out and
    # fail with PeerUnreachableError.  It fails at once, without asking.
    rx = scripted_receiver("rx", answer_regions=False)  # its table: region 1 only
    tx = make_agent("tx", connect_timeout_s=30.0)
    src = tx.register(np.ones(4096, np.uint8))
    tx.add_peer(rx.metadata)
    with tx._using() as a:
        p = _native.peer_find(a, "rx")
        with pytest.raises(kvlink.UnknownRegionError, match="no region 7 as of its last region"):
            _native.xfer_submit(a, p, "rx", kvlink.Op.PUSH, _segment(src.id, 7, 4096), b"", 10)
    assert not rx.regions_asked.is_set(), "submit asked the peer for its table"


def test_push_asks_for_the_region_table_in_the_callers_thread(make_agent, scripted_receiver):
    # the caller, not submit, refreshes the table when segments name a region it lacks: the
    # question goes out, and a peer that does not answer fails the push after
    # connect_timeout_s, nothing queued
    rx = scripted_receiver("rx", answer_regions=False)
    tx = make_agent("tx", connect_timeout_s=0.5)
    src = tx.register(np.ones(4096, np.uint8))
    tx.add_peer(rx.metadata)
    with pytest.raises(kvlink.PeerUnreachableError, match="did not send its region table"):
        tx.push("rx", segments=_segment(src.id, 7, 4096))
    assert rx.regions_asked.is_set()
    assert not rx.data_seen.is_set()
