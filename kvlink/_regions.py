"""An agent's table of its registered regions, safe to use from many threads.

``register``, ``deregister`` and every transfer (which looks its local
buffers up here) may run at once on different threads: each operation takes
the table's lock, and lookups walk a snapshot, never the dict being changed.
"""

from __future__ import annotations

import threading

from ._types import Region


class RegionTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[int, Region] = {}

    def add(self, region: Region) -> None:
        with self._lock:
            self._by_id[region.id] = region

    def remove(self, rid: int) -> None:
        with self._lock:
            self._by_id.pop(rid, None)

    def get(self, rid: int) -> Region | None:
        with self._lock:
            return self._by_id.get(rid)

    def snapshot(self) -> list[Region]:
        """Every region, in registration order."""
        with self._lock:
            return list(self._by_id.values())

    def containing(self, address: int, nbytes: int) -> Region | None:
        """The region holding all of [address, address + nbytes), if any."""
        for r in self.snapshot():
            if r.address <= address and address + nbytes <= r.address + r.nbytes:
                return r
        return None

    def clear(self) -> None:
        with self._lock:
            self._by_id.clear()
