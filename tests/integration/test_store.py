"""kvlink.store over real memory, real files (O_DIRECT, io_uring and the thread pool) and
a real etcd with two agents (docs/store.md): byte-exact round trips through every tier,
eviction and pins, re-indexing after a restart with torn and foreign files, corrupted
copies never served, prefetch policies, remote hits pulled straight into the pages."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvlink
from kvlink import kv
from kvlink.store import (
    PrefetchPolicy,
    Store,
    StoreConfig,
    StoreFullError,
    Tier,
    block_keys,
)
from kvlink.store._format import PAGE, SLOT_MAGIC, slot_bytes
from tests.conftest import REQUIRE_ALL
from tests.waits import wait_for

LAYERS, PLANES, BLOCK = 3, 2, 8192  # a block: 3 layers x K,V x 8 KiB = 48 KiB
NBLOCKS = 64
BLOCK_BYTES = LAYERS * PLANES * BLOCK
SLOT = slot_bytes(BLOCK_BYTES)
SECRET = "cluster-secret-for-the-tests-0123456789"
FAST = {"discovery_ttl_s": 2.0, "discovery_refresh_s": 0.1, "discovery_timeout_s": 1.0}


class Engine:
    """A paged KV cache as an engine keeps one: a tensor per layer, [K/V, blocks, bytes],
    registered with an agent."""

    def __init__(self, agent: Any, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.layers = [
            rng.integers(0, 256, (PLANES, NBLOCKS, BLOCK), dtype=np.uint8) for _ in range(LAYERS)
        ]
        for i, t in enumerate(self.layers):
            agent.register(t, name=f"kv{seed}-{i}")
        self.layout = kv.PagedLayout.from_tensors(agent, self.layers, planes=PLANES)

    def block(self, b: int) -> bytes:
        return b"".join(t[p, b].tobytes() for t in self.layers for p in range(PLANES))

    def zero(self) -> None:
        for t in self.layers:
            t[:] = 0


def keys_for(n: int, ns: str = "model-a") -> list[bytes]:
    return block_keys(ns, list(range(n * 16)), 16)


@pytest.fixture
def agent(make_agent: Callable[..., Any]) -> Any:
    return make_agent("store-a")


@pytest.fixture
def stores() -> Iterator[Callable[..., Store]]:
    made: list[Store] = []

    def make(agent: Any, **cfg: Any) -> Store:
        opts: dict[str, Any] = {"block_bytes": BLOCK_BYTES, "host_bytes": 16 * SLOT}
        opts.update(cfg)
        s = Store(agent, StoreConfig(**opts))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_host_round_trip_is_byte_exact_and_per_layer(agent, stores):
    src, dst = Engine(agent, 1), Engine(agent, 2)
    st = stores(agent)
    keys = keys_for(8)
    assert st.put(keys, src.layout, [5, 9, 10, 11, 0, 63, 2, 3]) == 8
    assert st.put(keys, src.layout, [5, 9, 10, 11, 0, 63, 2, 3]) == 0  # held already
    look = st.lookup(keys + keys_for(9)[8:])
    assert look.hits == 8 and look.tiers[:8] == (Tier.HOST,) * 8 and look.tiers[8] is None
    dst.zero()
    load = st.get(keys, dst.layout, [40, 41, 42, 43, 44, 45, 46, 47])
    load.wait_layer(0, timeout_s=10)
    load.wait(timeout_s=10)
    assert load.ok and load.failed == []
    for i, b in enumerate([5, 9, 10, 11, 0, 63, 2, 3]):
        assert dst.block(40 + i) == src.block(b), f"block {i}"
    assert dst.block(0) == bytes(BLOCK_BYTES)  # nothing else written
    s = st.stats()
    assert s.hits["host"] == 8 and s.blocks["host"] == 8 and s.failed == 0


def test_keys_chain_over_the_prefix_and_the_namespace():
    a = block_keys("m", list(range(64)), 16)
    assert len(a) == 4 and len(set(a)) == 4 and all(len(k) == 32 for k in a)
    assert block_keys("m", list(range(64)) + [7] * 5, 16) == a  # a partial block has no key
    b = block_keys("m", [99, *range(1, 64)], 16)
    assert all(x != y for x, y in zip(a, b, strict=True))  # a change in block 0 changes them all
    assert block_keys("other-model", list(range(64)), 16)[0] != a[0]
    assert block_keys("m", list(range(16, 64)), 16, parent=a[0]) == a[1:]


@pytest.mark.parametrize("threads", [False, True], ids=["io_uring", "threads"])
def test_disk_tier_takes_evicted_blocks_and_serves_them_back(agent, stores, tmp_path, threads):
    src, dst = Engine(agent, 3), Engine(agent, 4)
    st = stores(
        agent,
        host_bytes=4 * SLOT,
        disk_path=str(tmp_path / "d"),
        disk_bytes=64 * SLOT,
        force_thread_io=threads,
    )
    backend = st.stats().io_backend
    if threads:
        assert backend.startswith("threads (4; forced")
    elif not backend.startswith("io_uring"):
        msg = f"disk I/O is not on io_uring here: {backend}"
        if REQUIRE_ALL:
            pytest.fail(msg)
        pytest.skip(msg)
    keys = keys_for(32)
    assert st.put(keys, src.layout, list(range(32))) == 32
    s = st.stats()
    assert s.blocks["host"] <= 4 and s.blocks["disk"] >= 28 and s.dropped == 0
    assert s.evictions["host"] >= 28 and s.bytes_written["disk"] >= 28 * SLOT
    look = st.lookup(keys)
    assert look.local_hits == 32 and Tier.DISK in look.tiers
    dst.zero()
    load = st.get(keys, dst.layout, list(range(32, 64))).wait(timeout_s=30)
    assert load.ok, load.reasons
    assert Tier.DISK in load.tiers
    for i in range(32):
        assert dst.block(32 + i) == src.block(i), f"block {i}"
    assert st.stats().hits["disk"] >= 28


def test_write_through_puts_every_block_on_disk(agent, stores, tmp_path):
    src = Engine(agent, 5)
    st = stores(
        agent, disk_path=str(tmp_path / "d"), disk_bytes=32 * SLOT, write_policy="write-through"
    )
    st.put(keys_for(6), src.layout, range(6))
    st.flush(timeout_s=10)
    s = st.stats()
    assert s.blocks["host"] == 6 and s.blocks["disk"] == 6 and s.evictions["host"] == 0


def _slots_on_disk(path: Path) -> list[int]:
    """Offsets of slot headers in a slab file."""
    data = path.read_bytes()
    return [o for o in range(PAGE, len(data), SLOT) if data[o : o + 8] == SLOT_MAGIC]


def test_restart_reindexes_and_discards_torn_and_foreign_files(agent, stores, tmp_path, caplog):
    src, dst = Engine(agent, 6), Engine(agent, 7)
    d = tmp_path / "d"
    cfg = {"host_bytes": 4 * SLOT, "disk_path": str(d), "disk_bytes": 16 * SLOT}
    st = stores(agent, **cfg)
    keys = keys_for(10)
    st.put(keys, src.layout, range(10))
    st.close()  # what only the host tier held goes down too
    slab = d / "slab-0000.kvl"
    offs = _slots_on_disk(slab)
    assert len(offs) == 10
    with open(slab, "r+b") as f:  # a payload torn mid-write, a header cut short
        f.seek(offs[2] + PAGE + 100)
        f.write(b"\xff" * 512)
        f.seek(offs[5] + 40)
        f.write(b"\0" * 8)
    (d / "notes.txt").write_text("not ours")
    caplog.set_level("WARNING", logger="kvlink.store")
    st2 = stores(agent, **cfg)
    s = st2.stats()
    assert s.discarded == 2 and s.blocks["disk"] == 8
    assert "2 torn blocks" in caplog.text and "notes.txt is not a kvlink slab" in caplog.text
    look = st2.lookup(keys)
    held = [k for k, t in zip(keys, look.tiers, strict=True) if t is not None]
    assert len(held) == 8
    dst.zero()
    load = st2.get(keys, dst.layout, range(10)).wait(timeout_s=30)
    assert len(load.failed) == 2
    for i in range(10):
        if i not in load.failed:  # (a failed block's pages are the engine's to recompute)
            assert dst.block(i) == src.block(i)
    st2.close()
    # a slab of another geometry (block size changed) starts empty, said in the log
    caplog.clear()
    other = stores(
        agent,
        block_bytes=BLOCK_BYTES // 2,
        host_bytes=4 * SLOT,
        disk_path=str(d),
        disk_bytes=16 * SLOT,
        name="s3",
    )
    assert len(other) == 0 and "another geometry" in caplog.text


def test_a_corrupted_host_copy_is_never_served(agent, stores):
    src, dst = Engine(agent, 8), Engine(agent, 9)
    st = stores(agent)
    keys = keys_for(4)
    st.put(keys, src.layout, range(4))
    slot = st._index[keys[1]].host
    st.host.mem[slot * SLOT + PAGE + 7] ^= 0x40  # memory went bad under the store
    dst.zero()
    load = st.get(keys, dst.layout, range(4)).wait(timeout_s=10)
    assert load.failed == [1] and "crc32c" in load.reasons[1]
    # (its pages got the bad bytes as they were checked: reported failed, recomputed)
    assert [dst.block(i) == src.block(i) for i in (0, 2, 3)] == [True] * 3
    assert keys[1] not in st and st.get_bytes(keys[1]) is None


def test_pins_hold_blocks_and_a_full_tier_says_what_to_do(agent, stores):
    src = Engine(agent, 10)
    # (no background eviction: this test decides what is evicted)
    st = stores(agent, host_bytes=4 * SLOT, high_watermark=1.0, low_watermark=0.99)
    keys = keys_for(6)
    st.put(keys[:4], src.layout, range(4))
    assert st.pin(keys[:4]) == 4
    with pytest.raises(StoreFullError, match="every block is pinned or being moved; unpin"):
        st.put(keys[4:5], src.layout, [4])
    assert len(st) == 4  # nothing half-done
    st.unpin(keys[:2])
    st.put(keys[4:6], src.layout, [4, 5])
    assert keys[0] not in st and keys[1] not in st  # the unpinned ones went (LRU)
    assert all(k in st for k in keys[2:6])
    assert st.stats().dropped == 2


def test_bad_arguments_name_what_is_wrong(agent, stores, tmp_path):
    src = Engine(agent, 11)
    st = stores(agent)
    with pytest.raises(kvlink.InvalidArgumentError, match=r"keys\[1\]: expected a 32-byte key"):
        st.put([b"\0" * 32, b"short"], src.layout, [0, 1])
    with pytest.raises(kvlink.InvalidArgumentError, match="blocks: 1 block ids for 2 keys"):
        st.put(keys_for(2), src.layout, [0])
    with pytest.raises(kvlink.InvalidArgumentError, match=r"blocks: ids must be in \[0, 64\)"):
        st.get(keys_for(1), src.layout, [64])
    half = kv.PagedLayout(src.layout.regions, src.layout.offsets, NBLOCKS, BLOCK // 2, PLANES)
    with pytest.raises(kvlink.InvalidArgumentError, match="store's blocks are 49152 bytes"):
        st.put(keys_for(1), half, [0])
    with pytest.raises(kvlink.ConfigError, match="disk_bytes: set, but disk_path is None"):
        StoreConfig(block_bytes=4096, host_bytes=1 << 20, disk_bytes=1 << 20)
    with pytest.raises(kvlink.ConfigError, match="eviction: expected 'lru' or 'arc'"):
        StoreConfig(block_bytes=4096, host_bytes=1 << 20, eviction="fifo")
    with pytest.raises(kvlink.ConfigError, match="host_bytes: 4096 bytes hold no block"):
        StoreConfig(block_bytes=4096, host_bytes=4096)
    with pytest.raises(kvlink.InvalidArgumentError, match="policy: expected one of"):
        st.prefetch(keys_for(1), policy="soon")
    (tmp_path / "file").write_text("x")
    with pytest.raises(kvlink.ConfigError, match="disk_path: cannot create"):
        stores(agent, disk_path=str(tmp_path / "file" / "d"), disk_bytes=4 * SLOT, name="s2")
    with pytest.raises(kvlink.ConfigError, match="already has a region named 'kvstore'"):
        stores(agent)
    st.close()
    with pytest.raises(kvlink.ClosedError, match="the store is closed"):
        st.lookup(keys_for(1))


def test_prefetch_brings_a_prefix_up_and_pins_it_until_released(agent, stores, tmp_path):
    src = Engine(agent, 12)
    st = stores(agent, host_bytes=16 * SLOT, disk_path=str(tmp_path / "d"), disk_bytes=64 * SLOT)
    keys = keys_for(40)
    st.put(keys, src.layout, range(40))
    first = keys[:6]
    wait_for(lambda: st._host_prefix(first) == 0, 10, "the first blocks moved down to disk")
    pf = st.prefetch(first, policy=PrefetchPolicy.WAIT, timeout_s=10)
    assert pf.wait() == 6 and pf.ready() == 6
    assert st.lookup(first).tiers == (Tier.HOST,) * 6
    st.put(keys_for(16, "other"), src.layout, range(16))  # pressure: pinned ones stay
    assert st._host_prefix(first) == 6
    pf.release()
    pf.release()  # idempotent
    st.put(keys_for(16, "third"), src.layout, range(16))
    assert st._host_prefix(first) < 6  # free to go now


def test_best_effort_prefetch_never_waits_for_others_loads(agent, stores, tmp_path):
    src, dst = Engine(agent, 13), Engine(agent, 14)
    st = stores(
        agent, host_bytes=16 * SLOT, disk_path=str(tmp_path / "d"), disk_bytes=64 * SLOT, loaders=2
    )
    keys = keys_for(40)
    st.put(keys, src.layout, range(40))
    t0 = time.monotonic()
    pf = st.prefetch(keys, policy="best-effort")
    n = pf.wait()
    assert time.monotonic() - t0 < 1.0 and n <= 40  # returned with what was up, at once
    load = st.get(keys[:16], dst.layout, range(16)).wait(timeout_s=30)
    assert load.ok
    pf.release()
    t = st.prefetch(keys[:2], policy="timeout")
    assert t.deadline is not None and t.deadline - time.monotonic() <= 0.05 + 2 * 0.002 + 0.01
    t.wait()
    t.release()


def test_arc_store_end_to_end(agent, stores, tmp_path):
    src, dst = Engine(agent, 15), Engine(agent, 16)
    st = stores(
        agent,
        host_bytes=8 * SLOT,
        disk_path=str(tmp_path / "d"),
        disk_bytes=64 * SLOT,
        eviction="arc",
    )
    hot = keys_for(4, "hot")
    st.put(hot, src.layout, range(4))
    for _ in range(2):  # used twice: frequent
        assert st.get(hot, dst.layout, range(4)).wait(timeout_s=10).ok
    for r in range(4):  # a scan of blocks used once
        st.put(keys_for(8, f"scan{r}"), src.layout, range(8, 16))
    assert st.lookup(hot).tiers == (Tier.HOST,) * 4  # the scan did not flush them


def test_remote_hits_are_pulled_into_the_pages_and_checked(etcd, make_agent, stores):
    opts = {"discovery": etcd.url("t"), "secret": SECRET, **FAST}
    a = make_agent("store-owner", **opts)
    b = make_agent("store-reader", **opts)
    src, dst = Engine(a, 20), Engine(b, 21)
    sa, sb = stores(a), stores(b)
    keys = keys_for(6)
    sa.put(keys, src.layout, range(6))
    wait_for(lambda: sb.lookup(keys).hits == 6, 10, "the owner's blocks listed in etcd")
    look = sb.lookup(keys)
    assert look.tiers == (Tier.REMOTE,) * 6 and look.holders == ("store-owner",) * 6
    assert look.local_hits == 0
    dst.zero()
    load = sb.get(keys, dst.layout, [10, 11, 12, 13, 14, 15])
    load.wait_layer(0, timeout_s=20)
    assert load.wait(timeout_s=20).ok, load.reasons
    assert load.tiers == [Tier.REMOTE] * 6
    for i in range(6):
        assert dst.block(10 + i) == src.block(i)
    assert sb.stats().hits["remote"] == 6
    # a prefetch copies them into the reader's own host tier
    pf = sb.prefetch(keys[:3], policy="wait", timeout_s=20)
    assert pf.wait() == 3 and sb.lookup(keys[:3]).tiers == (Tier.HOST,) * 3
    pf.release()
    # the owner reuses a slot for another block before its entry is withdrawn: the reader
    # pulls the slot, sees another key in its header and fails the block, never serves it
    slot = sa._index[keys[4]].host
    other = keys_for(1, "other")[0]
    sa.host.mem[slot * SLOT : slot * SLOT + 64] = np.frombuffer(
        hashlib.sha256(other).digest() * 2, dtype=np.uint8
    )
    dst.zero()
    load = sb.get(keys[3:6], dst.layout, [3, 4, 5]).wait(timeout_s=20)
    assert load.failed == [1], load.reasons
    # (its pages hold whatever arrived: reported failed, the engine recomputes them)
    assert dst.block(3) == src.block(3) and dst.block(5) == src.block(5)
    # an owner that goes away takes only its blocks with it: the reader misses them
    sa.close()
    wait_for(lambda: sb.lookup(keys[3:]).hits == 0, 10, "the owner's entries withdrawn")
    load = sb.get(keys[3:], dst.layout, [3, 4, 5]).wait(timeout_s=20)
    assert load.failed == [0, 1, 2]
    assert sb.lookup(keys[:3]).tiers == (Tier.HOST,) * 3  # its own copies stay


OWNER = """
import sys, time, numpy as np, kvlink
from kvlink import kv
from kvlink.store import Store, StoreConfig
from tests.integration.test_store import BLOCK_BYTES, SLOT, Engine, keys_for
a = kvlink.Agent("store-owner2", kvlink.Config(nics=["127.0.0.1"], discovery=sys.argv[1],
                 secret=sys.argv[2], discovery_ttl_s=2.0, discovery_refresh_s=0.1))
st = Store(a, StoreConfig(block_bytes=BLOCK_BYTES, host_bytes=16 * SLOT))
st.put(keys_for(3), Engine(a, 22).layout, range(3))
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_owners_blocks_go_with_its_lease(etcd, make_agent, stores):
    """The owner dies (SIGKILL): its lease expires, etcd drops what it published, and a
    load of those blocks fails them (the engine recomputes) instead of hanging."""
    b = make_agent("store-reader2", discovery=etcd.url("t"), secret=SECRET, **FAST)
    sb = stores(b)
    dst = Engine(b, 23)
    keys = keys_for(3)
    root = Path(__file__).resolve().parents[2]
    with subprocess.Popen(
        [sys.executable, "-c", OWNER, etcd.url("t"), SECRET],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    ) as owner:
        try:
            assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
            wait_for(lambda: sb.lookup(keys).hits == 3, 10, "published")
            assert sb.get(keys, dst.layout, range(3)).wait(timeout_s=20).ok
            owner.send_signal(signal.SIGKILL)
            owner.wait(timeout=10)
        finally:
            if owner.poll() is None:
                owner.kill()
    wait_for(lambda: sb.lookup(keys).hits == 0, 15, "the dead owner's lease expired")
    load = sb.get(keys, dst.layout, range(3)).wait(timeout_s=20)
    assert load.failed == [0, 1, 2]


def test_concurrent_puts_gets_and_evictions_stay_exact(agent, stores, tmp_path):
    src = Engine(agent, 30)
    st = stores(agent, host_bytes=6 * SLOT, disk_path=str(tmp_path / "d"), disk_bytes=40 * SLOT)
    errors: list[str] = []
    stop = time.monotonic() + 3.0

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        mine = [np.zeros((PLANES, NBLOCKS, BLOCK), np.uint8) for _ in range(LAYERS)]
        for j, t in enumerate(mine):
            agent.register(t, name=f"w{seed}-{j}")
        lay = kv.PagedLayout.from_tensors(agent, mine, planes=PLANES)
        while time.monotonic() < stop:
            b = int(rng.integers(0, 32))
            key = keys_for(32)[b]
            if rng.random() < 0.5:
                st.put([key], src.layout, [b])
            else:
                ld = st.get([key], lay, [b]).wait(timeout_s=30)
                got = b"".join(t[p, b].tobytes() for t in mine for p in range(PLANES))
                if ld.ok and got != src.block(b):
                    errors.append(f"block {b} served wrong bytes")

    ts = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not errors
    s = st.stats()
    assert s.blocks["host"] <= 6 and s.blocks["disk"] <= 40
    assert len(os.listdir(tmp_path / "d")) == 1


def test_a_disk_copy_failing_its_check_while_pinned_leaves_no_ghost(agent, stores, tmp_path):
    """A prefetch pins a disk-only block, then finds its copy bad: the block is gone at once
    (no lookup says it is held, a get says it failed without waiting, it can be stored again),
    though the prefetch's pin outlives it (issue 32, item 2)."""
    src, dst = Engine(agent, 13), Engine(agent, 14)
    d = tmp_path / "d"
    cfg = {"host_bytes": 8 * SLOT, "disk_path": str(d), "disk_bytes": 16 * SLOT}
    st = stores(agent, **cfg)
    keys = keys_for(3)
    st.put(keys, src.layout, range(3))
    st.close()  # every block on disk alone now
    st2 = stores(agent, name="s2", **cfg)
    assert st2.lookup(keys).tiers == (Tier.DISK,) * 3
    slab = d / "slab-0000.kvl"
    data = slab.read_bytes()
    bad = next(o for o in _slots_on_disk(slab) if keys[1] in data[o : o + PAGE])
    with open(slab, "r+b") as f:  # the disk went bad under the store after it was opened
        f.seek(bad + PAGE + 100)
        f.write(b"\x5a" * 256)
    pf = st2.prefetch(keys, policy=PrefetchPolicy.WAIT, timeout_s=20)
    pf.wait()
    assert pf.done
    assert st2.lookup(keys, remote=False).tiers == (Tier.HOST, None, Tier.HOST)
    assert keys[1] not in st2
    dst.zero()
    t0 = time.monotonic()
    load = st2.get(keys, dst.layout, range(3), timeout_s=20).wait(timeout_s=20)
    assert time.monotonic() - t0 < 10, "the get waited for a block nobody was loading"
    assert load.failed == [1]
    assert dst.block(0) == src.block(0) and dst.block(2) == src.block(2)
    pf.release()
    # stored again, it is served again
    st2.put(keys[1:2], src.layout, [1])
    dst.zero()
    assert st2.get(keys[1:2], dst.layout, [1]).wait(timeout_s=10).ok
    assert dst.block(1) == src.block(1)
    # nothing left pinned, busy or loading
    assert all(e.pins == 0 and e.busy == 0 and not e.loading for e in st2._index.values())
