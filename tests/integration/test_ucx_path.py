"""kvlink's engine over UCX paths (docs/ucx.md, engine integration steps 1-5):
two agents with transport="ucx" and a cluster secret push over UCX's TCP on
loopback (payload by UCX put, header / crc32c trailer / ACK on the path's TCP
connection), byte-exact; a peer with transport="tcp" refuses the offer and
that path runs TCP; what a UCX path does not carry (pull, regions registered
after its set-up) goes in-stream on the same connection.  Without UCX these
skip saying why; in CI (KVLINK_REQUIRE_ALL=1) they fail instead."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import kvlink
from kvlink import _transport
from tests.conftest import unavailable
from tests.wire_client import RewritingProxy, ucx_setup_decode, ucx_setup_encode

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


def pair(make_agent, rx_transport="ucx", tx_transport="ucx", paths=2, secret=SECRET, **tx_extra):
    rx = make_agent("rx", nics=f"loopback:{paths}", transport=rx_transport, secret=secret)
    tx = make_agent("tx", nics=f"loopback:{paths}", transport=tx_transport, secret=secret,
                    **tx_extra)
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
    # the payload went over UCX puts: every byte is counted as sent on the paths and
    # as placed by put (none in-stream, nothing hedged), and both paths carried chunks
    paths = tx.paths()
    assert sum(p.bytes_sent for p in paths) == n, [p.bytes_sent for p in paths]
    assert sum(p.bytes_put for p in paths) == n, [p.bytes_put for p in paths]
    assert all(p.bytes_put > 0 for p in paths), [p.bytes_put for p in paths]
    assert all(p.chunks_done > 0 for p in paths), [(p.index, p.chunks_done) for p in paths]
    # a second push into the same region (new contents) lands too
    src2 = pattern(n, 2)
    tx.register(src2)
    tx.push("rx", src=src2, dst="kv").wait(timeout_s=120)
    assert np.array_equal(src2, dst)
    assert sum(p.bytes_put for p in tx.paths()) == 2 * n


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
    paths = tx.paths()
    assert sum(p.bytes_sent for p in paths) >= n
    assert [p.bytes_put for p in paths] == [0, 0]


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


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_region_registered_after_setup_gets_keys(make_agent):
    """A region registered after the paths' UCX set-up is mapped in each
    path's context and its key sent in MOVER_KEYS (docs/ucx.md step 3): the
    initiator's notes count the new key, and a push into it goes by put."""
    rx, tx = pair(make_agent)
    early = np.zeros(MiB, dtype=np.uint8)
    rx.register(early, remote_write=True, name="early")
    tx.add_peer(rx.metadata())
    notes = [p.transport_note for p in tx.paths()]
    assert all(n.startswith("UCX 1.") and " 1 remote keys" in n for n in notes), notes
    late = np.zeros(4 * MiB, dtype=np.uint8)
    rx.register(late, remote_write=True, name="late")
    # the paths' snapshots refresh on the monitor's tick
    assert wait_for(lambda: all(" 2 remote keys" in p.transport_note for p in tx.paths())), [
        p.transport_note for p in tx.paths()
    ]
    src = pattern(late.size, 5)
    tx.register(src)
    tx.add_peer(rx.metadata())  # the new region's access key; the paths stay as set up
    tx.push("rx", src=src, dst="late").wait(timeout_s=60)
    assert np.array_equal(src, late)
    paths = tx.paths()
    assert all(p.transport == "ucx" for p in paths)
    put = [(p.bytes_sent, p.bytes_put) for p in paths]
    assert sum(p.bytes_put for p in paths) == late.size, put


def test_deregister_unmaps_from_every_ucx_path(make_agent, caplog):
    """deregister() still succeeds once a transfer is done ("done means
    deregister succeeds"), and the engine unmaps the region from every UCX
    path's context: a region registered after it gets its key (the
    re-sync ran), and transfers into the remaining regions still go by put."""
    caplog.set_level(logging.INFO, logger="kvlink")
    rx, tx = pair(make_agent)
    a = np.zeros(2 * MiB, dtype=np.uint8)
    b = np.zeros(2 * MiB, dtype=np.uint8)
    r_a = rx.register(a, remote_write=True, name="a")
    rx.register(b, remote_write=True, name="b")
    tx.add_peer(rx.metadata())
    src = pattern(2 * MiB, 31)
    tx.register(src)
    tx.push("rx", src=src, dst="a").wait(timeout_s=60)
    assert np.array_equal(src, a)
    rx.deregister(r_a)  # done means deregister succeeds
    c = np.zeros(2 * MiB, dtype=np.uint8)
    rx.register(c, remote_write=True, name="c")
    tx.add_peer(rx.metadata())
    # each of the listener's 2 UCX path ends unmapped 'a' (it logs so), and mapped 'c'
    want = f"UCX: region {r_a.id} deregistered: unmapped from a path's context"
    assert wait_for(lambda: caplog.text.count(want) == 2), caplog.text
    assert wait_for(lambda: all(" 3 remote keys" in p.transport_note for p in tx.paths()))
    for name, arr in (("b", b), ("c", c)):
        tx.push("rx", src=src, dst=name).wait(timeout_s=60)
        assert np.array_equal(src, arr)
    assert sum(p.bytes_put for p in tx.paths()) == 3 * src.size


def test_pull_over_ucx_is_byte_exact(make_agent):
    """Pull over UCX: the initiator's MOVER_OFFER carries a key per host region,
    its READ_REQs say where each piece goes (header flag DST), the side that
    has the bytes puts them there, flushes and sends READ_RESP with REMOTE
    and the crc32c trailer; the initiator checks the crc over its own
    destination.  Every byte is counted as pulled by put, on both paths."""
    rx, tx = pair(make_agent)
    n = 16 * MiB + 3
    remote = pattern(n, 7)
    rx.register(remote, remote_read=True, name="kv")
    local = np.zeros(n, dtype=np.uint8)
    tx.register(local)  # before add_peer: mapped in each path's UCX set-up
    tx.add_peer(rx.metadata())
    assert all("1 regions mapped" in p.transport_note for p in tx.paths()), tx.paths()
    tx.pull("rx", src="kv", dst=local).wait(timeout_s=60)
    assert np.array_equal(local, remote)
    paths = tx.paths()
    assert sum(p.bytes_recv for p in paths) == n
    assert sum(p.bytes_put for p in paths) == n, [(p.bytes_recv, p.bytes_put) for p in paths]
    assert all(p.bytes_put > 0 for p in paths)
    assert [p.last_error for p in paths] == ["", ""]
    # again, new contents at the source: no stale byte survives
    remote[:] = pattern(n, 8)
    tx.pull("rx", src="kv", dst=local).wait(timeout_s=60)
    assert np.array_equal(local, remote)
    assert sum(p.bytes_put for p in tx.paths()) == 2 * n


def test_pull_into_a_region_registered_after_setup_goes_by_put(make_agent):
    """A pull destination registered after the paths' set-up is mapped in each
    path's context and its key sent in MOVER_KEYS ahead of any READ_REQ on the
    same connections (the engine runs register's re-sync before the pull's
    submission), so the peer puts into it; one pull into it and an earlier
    region lands both, every byte by put."""
    rx, tx = pair(make_agent)
    n = 8 * MiB
    remote = pattern(2 * n, 13)
    r_remote = rx.register(remote, remote_read=True, name="kv")
    early = np.zeros(n, dtype=np.uint8)
    r_early = tx.register(early)
    tx.add_peer(rx.metadata())
    late = np.zeros(n, dtype=np.uint8)
    r_late = tx.register(late)
    tx.pull("rx", src="kv", dst=late).wait(timeout_s=60)
    assert np.array_equal(late, remote[:n])
    assert sum(p.bytes_put for p in tx.paths()) == n
    late[:] = 0
    segs = [
        kvlink.Segment(r_remote.id, 0, r_early.id, 0, n),
        kvlink.Segment(r_remote.id, n, r_late.id, 0, n),
    ]
    tx.pull("rx", segments=segs).wait(timeout_s=60)
    assert np.array_equal(early, remote[:n]) and np.array_equal(late, remote[n:])
    paths = tx.paths()
    assert sum(p.bytes_put for p in paths) == 3 * n, [(p.bytes_recv, p.bytes_put) for p in paths]
    assert sum(p.bytes_recv for p in paths) == 3 * n


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
    assert sum(p.bytes_put for p in paths) == 20 * 16 * MiB


def test_one_push_mixes_put_and_in_stream_chunks(make_agent):
    """One transfer whose destinations are a region with a UCX key on the
    paths (chunks go by put) and one without (its key stripped from the
    MOVER_ACCEPT by a man in the middle: chunks go in-stream on the same
    connections): both land byte-exact, and bytes_put shows the split."""
    rx, tx = pair(make_agent)
    early = np.zeros(8 * MiB, dtype=np.uint8)
    r_early = rx.register(early, remote_write=True, name="early")
    late = np.zeros(8 * MiB + 5, dtype=np.uint8)
    r_late = rx.register(late, remote_write=True, name="late")

    def strip_late(body: bytes) -> bytes:
        addr, keys = ucx_setup_decode(body)
        return ucx_setup_encode(addr, [k for k in keys if k[0] != r_late.id])

    proxy = RewritingProxy(rx.metadata(), strip_late)
    try:
        tx.add_peer(proxy.metadata())
        src = pattern(early.size + late.size, 9)
        r_src = tx.register(src)
        segs = [
            kvlink.Segment(r_src.id, 0, r_early.id, 0, early.size),
            kvlink.Segment(r_src.id, early.size, r_late.id, 0, late.size),
        ]
        tx.push("rx", segments=segs).wait(timeout_s=60)
        assert np.array_equal(src[: early.size], early)
        assert np.array_equal(src[early.size :], late)
        paths = tx.paths()
        assert all(p.transport == "ucx" for p in paths)
        # the mix really happened: exactly the keyed region's bytes went by put, and
        # (at least: the proxy is slow enough for a re-send) the other's in-stream
        put = sum(p.bytes_put for p in paths)
        assert put == early.size, (put, [(p.bytes_sent, p.bytes_put) for p in paths])
        assert sum(p.bytes_sent for p in paths) - put >= late.size
    finally:
        proxy.close()


# ---- a peer that answers the UCX offer with bad keys (docs/ucx.md, "Everything is
# hostile and bounded"): a man in the middle rewrites each MOVER_ACCEPT; frames after
# the handshake carry no MAC, so this is what a broken or hostile listener can send.


def proxied_pair(make_agent, rewrite):
    rx, tx = pair(make_agent)
    dst = np.zeros(4 * MiB + 9, dtype=np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = pattern(dst.size, 21)
    tx.register(src)
    proxy = RewritingProxy(rx.metadata(), rewrite)
    return rx, tx, proxy, src, dst


def rewrite_keys(fn):
    def rewrite(body: bytes) -> bytes:
        addr, keys = ucx_setup_decode(body)
        for k in keys:
            fn(k)
        return ucx_setup_encode(addr, keys)

    return rewrite


def push_runs_tcp(tx, src, dst):
    tx.push("rx", src=src, dst="kv").wait(timeout_s=60)
    assert np.array_equal(src, dst)
    paths = tx.paths()
    # >=: the Python proxy is slow enough for the stall rule to re-send a chunk now and then
    assert sum(p.bytes_sent for p in paths) >= src.size
    assert [p.bytes_put for p in paths] == [0, 0]  # nothing went by put


def test_garbled_key_bytes_keep_the_path_tcp(make_agent):
    """Key bytes libucp cannot unpack: the path's UCX set-up fails naming the
    region, the path runs TCP on the same connection, the push lands."""

    def garble(k):
        k[3] = b"\xa5" * len(k[3])

    rx, tx, proxy, src, dst = proxied_pair(make_agent, rewrite_keys(garble))
    try:
        tx.add_peer(proxy.metadata())
        assert proxy.accepts_rewritten == 2
        rid = rx.regions()[0].id
        for p in tx.paths():
            assert p.transport == "tcp", p
            assert p.transport_note.startswith(
                f"UCX set-up failed, running TCP: UCX: key of region {rid}:"
            ), p.transport_note
        push_runs_tcp(tx, src, dst)
    finally:
        proxy.close()


def test_key_larger_than_the_region_is_refused(make_agent):
    """A key whose bounds disagree with the region the peer's table shows (a
    put through it could land past the region): the path's UCX is dropped
    when the path goes into service (the table is known then), before any
    put, with the region, both sizes and what it means; the path runs TCP."""

    def grow(k):
        k[2] += 1 << 30

    _, tx, proxy, src, dst = proxied_pair(make_agent, rewrite_keys(grow))
    try:
        tx.add_peer(proxy.metadata())
        for p in tx.paths():
            assert p.transport == "tcp", p
            assert "covers 1077936137 bytes, the peer's region table says 4194313" in (
                p.transport_note
            ), p.transport_note
            assert "broken or hostile" in p.transport_note
        push_runs_tcp(tx, src, dst)
    finally:
        proxy.close()


def test_key_for_a_region_not_open_to_writes_is_refused(make_agent):
    """A key for a region the peer's table lists without remote_write: the
    path's UCX is refused naming the region."""
    ro = np.zeros(MiB, dtype=np.uint8)
    holder: dict[str, int] = {}

    def relabel(k):
        k[0] = holder["ro"]  # the only key, moved onto the read-only region's id

    rx, tx, proxy, src, dst = proxied_pair(make_agent, rewrite_keys(relabel))
    holder["ro"] = rx.register(ro, remote_read=True, name="ro").id
    proxy.close()
    proxy = RewritingProxy(rx.metadata(), rewrite_keys(relabel))  # metadata with "ro"
    try:
        tx.add_peer(proxy.metadata())
        for p in tx.paths():
            assert p.transport == "tcp", p
            want = f"UCX key for region {holder['ro']}, which the peer's region table does not open"
            assert want in p.transport_note, p.transport_note
        push_runs_tcp(tx, src, dst)
    finally:
        proxy.close()


def test_malformed_key_list_fails_the_path_setup_with_the_reason(make_agent):
    """A key list the decoder refuses (an empty region): the peer broke the
    protocol, so the connection is dropped with the decoder's reason (not a
    TCP fallback: nothing after it can be trusted), and add_peer says so."""

    def empty(k):
        k[2] = 0

    _, tx, proxy, _, _ = proxied_pair(make_agent, rewrite_keys(empty))
    try:
        with pytest.raises(kvlink.KvlinkError) as ei:
            tx.add_peer(proxy.metadata())
        err = str(ei.value)
        assert "UCX set-up" in err and "key 0: region bounds empty or wrapping" in err, err
    finally:
        proxy.close()


def test_failed_pull_over_ucx_fences_before_it_reports(make_agent, caplog):
    """A pull whose deadline passes while the peer may be putting into our
    memory: a put cannot be called back, so the initiator destroys the
    path's UCX end before the failure is reported (docs/ucx.md, fence).
    Nothing the peer still sends lands after that: memory written right
    after the failure keeps its contents.  The paths come back and the
    next pull lands byte-exact.

    The initiator checks deadlines every engine tick: a 5 ms tick and 512 MiB keep the pull
    running well past its 50 ms deadline on a fast idle machine too (with the default 100 ms
    tick a 256 MiB pull finished before its deadline was ever looked at)."""
    rx, tx = pair(make_agent, monitor_interval_ms=5)
    n = 512 * MiB
    remote = pattern(n, 17)
    rx.register(remote, remote_read=True, name="kv")
    local = np.zeros(n, dtype=np.uint8)
    tx.register(local)
    tx.add_peer(rx.metadata())
    t = tx.pull("rx", src="kv", dst=local, timeout_s=0.05)
    with pytest.raises(kvlink.KvlinkError):
        t.wait(timeout_s=60)
    local[:] = 0x5A  # ours again: no late put may change a byte of it
    time.sleep(1.0)
    assert np.count_nonzero(local != 0x5A) == 0
    deadline = time.monotonic() + 10  # the log drain is asynchronous
    while time.monotonic() < deadline and "UCX fenced" not in caplog.text:
        time.sleep(0.05)
    assert "UCX fenced: a pull the peer may be putting was cancelled" in caplog.text
    # the fenced paths reconnect (a fresh UCX set-up) and carry the next pull
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
        p.state == kvlink.PathState.UP for p in tx.paths()
    ):
        time.sleep(0.05)
    tx.pull("rx", src="kv", dst=local).wait(timeout_s=120)
    assert np.array_equal(local, remote)


def test_a_ucx_path_that_dies_falls_back_to_tcp_on_the_same_nic(make_agent):
    """The issue: "a UCX path that fails to connect or dies falls back to TCP
    on the same NIC".  Every connection of a UCX pair is reset mid-life (the
    proxy drops them); the paths reconnect on the same addresses without
    offering UCX, paths() says why, and the next push runs in-stream on them,
    byte-exact.  UCX is offered again on a reconnect after 60 s."""
    rx, tx = pair(make_agent)
    dst = np.zeros(8 * MiB, dtype=np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = pattern(dst.size, 41)
    tx.register(src)
    proxy = RewritingProxy(rx.metadata(), lambda body: body)
    try:
        tx.add_peer(proxy.metadata())
        before = tx.paths()
        assert [p.transport for p in before] == ["ucx", "ucx"], before
        tx.push("rx", src=src, dst="kv").wait(timeout_s=60)
        assert np.array_equal(src, dst)
        put = [p.bytes_put for p in tx.paths()]
        assert sum(put) == dst.size
        proxy.cut()

        def back_on_tcp():
            ps = tx.paths()
            return all(
                p.state == kvlink.PathState.UP and p.transport == "tcp" and p.reconnects >= 1
                for p in ps
            )

        assert wait_for(back_on_tcp, 30), tx.paths()
        for p, b in zip(tx.paths(), before, strict=True):
            assert p.local == b.local and p.remote == b.remote  # the same NIC pair
            assert p.transport_note.startswith("UCX path died ("), p.transport_note
            assert "TCP on the same NIC; UCX again in " in p.transport_note
        src2 = pattern(dst.size, 42)
        tx.register(src2)
        tx.push("rx", src=src2, dst="kv").wait(timeout_s=60)
        assert np.array_equal(src2, dst)
        after = tx.paths()
        assert [p.bytes_put for p in after] == put  # nothing more by put: in-stream
        assert sum(p.bytes_sent for p in after) >= 2 * dst.size
    finally:
        proxy.close()
