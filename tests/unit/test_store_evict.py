"""The store's eviction orders (kvlink/store/_evict.py) and its slot format (_format.py)."""

from __future__ import annotations

import pytest

from kvlink.store._evict import ARC, LRU
from kvlink.store._format import (
    SlabHeader,
    SlotHeader,
    pack_slab_header,
    pack_slot_header,
    parse_slab_header,
    parse_slot_header,
)


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_lru_evicts_the_least_recently_used_and_lookups_do_not_count():
    p = LRU(4)
    for i in range(4):
        p.insert(k(i))
    p.touch(k(0))
    assert list(p.candidates())[:2] == [k(1), k(2)]
    p.remove(k(1), evicted=True)
    assert list(p.candidates()) == [k(2), k(3), k(0)] and len(p) == 3


def test_arc_protects_frequent_keys_from_a_scan():
    p = ARC(4)
    for i in range(4):
        p.insert(k(i))
    p.touch(k(0))
    p.touch(k(1))  # 0 and 1 are frequent (T2)
    for i in range(100, 120):  # a scan of keys used once
        victim = next(iter(p.candidates()))
        p.remove(victim, evicted=True)
        p.insert(k(i))
        assert k(0) in p.t2 and k(1) in p.t2
    assert len(p) == 4 and len(p.b1) + len(p.b2) <= 4


def test_arc_adapts_towards_recency_when_its_ghosts_are_hit():
    p = ARC(4)
    for i in range(4):
        p.insert(k(i))
    p.touch(k(2))
    p.touch(k(3))
    first = next(iter(p.candidates()))
    assert first == k(0)  # T1 over its target 0
    p.remove(first, evicted=True)
    assert k(0) in p.b1
    p.insert(k(0))  # a B1 ghost comes back: recency pays, T1's target grows
    assert p.p >= 1 and k(0) in p.t2


def test_slot_headers_round_trip_and_refuse_any_change():
    h = SlotHeader(k(7), 4096 * 3, 0xDEADBEEF, 42, 4096 * 4)
    raw = pack_slot_header(h)
    assert parse_slot_header(raw) == h
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 1
        assert parse_slot_header(bytes(bad)) is None, f"byte {i}"
    assert parse_slot_header(b"\0" * 200) is None and parse_slot_header(b"KVL") is None


@pytest.mark.parametrize("n", [1, 1000])
def test_slab_headers_round_trip(n):
    h = SlabHeader(8192, 4096, n)
    raw = pack_slab_header(h)
    assert len(raw) == 4096 and parse_slab_header(raw) == h
    assert parse_slab_header(raw[:4] + b"X" + raw[5:]) is None
