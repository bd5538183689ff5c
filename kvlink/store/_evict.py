"""Which block of a tier goes first: LRU, or ARC (adaptive replacement).

A policy only orders a tier's resident keys; the store skips pinned and in-flight
blocks as it walks :meth:`candidates`, so a policy never has to know about either.
A lookup is not a use: only reads (``touch``) and writes (``insert``) move a key, so
a block that is merely looked up ages out normally (Mooncake #2187: leases renewed by
lookups kept blocks forever).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain
from typing import Protocol


class Policy(Protocol):
    def insert(self, key: bytes) -> None:
        """``key`` became resident (a write, or a move into the tier)."""

    def touch(self, key: bytes) -> None:
        """``key`` was read."""

    def remove(self, key: bytes, *, evicted: bool) -> None:
        """``key`` left the tier: ``evicted`` when the policy chose it (ARC remembers
        it), False when it was deleted or moved for another reason."""

    def candidates(self) -> Iterator[bytes]:
        """Resident keys, the first to evict first.  The caller must not change the
        policy while it iterates."""

    def __len__(self) -> int: ...


class LRU:
    """Least recently used first."""

    def __init__(self, capacity: int) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def remove(self, key: bytes, *, evicted: bool) -> None:
        self._keys.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class ARC:
    """Adaptive replacement (Megiddo and Modha, FAST 2003): T1 holds keys used once
    recently, T2 keys used at least twice; B1 and B2 remember keys recently evicted from
    each.  A new write of a key B1 remembers grows T1's target ``p`` (recency pays), one
    B2 remembers shrinks it (frequency pays).  Eviction takes T1's oldest while T1 is
    over its target, else T2's oldest.  A scan of blocks used once therefore only churns
    T1 and never flushes the frequently used ones in T2."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        if key in self.t1 or key in self.t2:
            self.touch(key)
            return
        if key in self.b1:
            self.p = min(self.capacity, self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None

    def touch(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: bytes, *, evicted: bool) -> None:
        if key in self.t1:
            del self.t1[key]
            if evicted:
                self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            if evicted:
                self.b2[key] = None
        # the ghosts remember at most one tier's worth of keys
        while len(self.b1) + len(self.b2) > self.capacity:
            (self.b1 if len(self.b1) > len(self.b2) else self.b2).popitem(last=False)

    def candidates(self) -> Iterator[bytes]:
        if self.t1 and (len(self.t1) > self.p or not self.t2):
            return chain(self.t1, self.t2)
        return chain(self.t2, self.t1)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


def make_policy(name: str, capacity: int) -> Policy:
    return ARC(capacity) if name == "arc" else LRU(capacity)
