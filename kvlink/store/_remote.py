"""Finding blocks other agents hold: an index in the etcd the cluster already runs.

Each store publishes the blocks in its host tier as etcd keys
``<prefix>store/<key hex>/<agent>`` whose value says where the slot is (region id,
offset, slot bytes), under the agent's discovery lease: when an agent dies its lease
expires and etcd drops every key it published, so a dead member loses only its blocks.
Publishing is batched (one transaction of up to 128 puts and deletes per flush, every
``flush_s``); a lookup is one transaction of up to 128 range reads per 128 keys.  No
entry is trusted: the reader pulls the slot's header with its payload and serves the
block only if the header names the key and the payload matches the header's crc32c, so
a stale entry (the slot was reused since) or a forged one costs a failed block, never a
wrong one.  docs/store.md, "Across hosts", gives the costs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import DiscoveryError, KvlinkError
from .._etcd import MAX_TXN_OPS

log = logging.getLogger("kvlink.store")

MAX_HOLDERS = 4  # holders read per key: enough to skip a dead one
MAX_QUEUED = 1 << 20  # keys waiting to be published or withdrawn
RECENT_S = 2.0  # lookup answers reused this long
MAX_RECENT = 1 << 16


@dataclass(frozen=True)
class Location:
    """Where another agent holds a block: a slot of its host tier's region."""

    agent: str
    region: int
    offset: int
    slot_bytes: int


class RemoteIndex:
    """This agent's published blocks, and lookups of everyone's (module doc)."""

    def __init__(
        self,
        agent: Any,
        region: int,
        slot_bytes: int,
        held: Callable[[], Iterable[tuple[bytes, int]]],
        *,
        flush_s: float = 0.1,
    ) -> None:
        disc = agent.discovery
        if disc is None:
            raise KvlinkError("the store's remote index needs an agent with Config(discovery=...)")
        self._agent = agent
        self._name = agent.name
        self._disc = disc
        self._etcd = disc.etcd
        self._dir = f"{disc.url.prefix}store/"
        self._region = region
        self._slot_bytes = slot_bytes
        self._held = held  # every (key, slot) in the host tier now: for a re-publish
        self._flush_s = flush_s
        self._lock = threading.Lock()
        self._pending: dict[bytes, int | None] = {}  # key -> slot to publish, None: withdraw
        self._recent: OrderedDict[bytes, tuple[float, list[Location]]] = OrderedDict()
        self._lease = 0
        self._stop = False
        self._wake = threading.Event()
        self.published = 0
        self.withdrawn = 0
        self.errors = 0
        self._thread = threading.Thread(
            target=self._run, name=f"kvlink-store-index-{self._name}", daemon=True
        )
        self._thread.start()

    def _key(self, key: bytes, agent: str | None = None) -> bytes:
        return f"{self._dir}{key.hex()}/{agent or self._name}".encode()

    # ---- publishing ------------------------------------------------------

    def publish(self, key: bytes, slot: int) -> None:
        with self._lock:
            if len(self._pending) < MAX_QUEUED:
                self._pending[key] = slot

    def withdraw(self, key: bytes) -> None:
        with self._lock:
            if len(self._pending) < MAX_QUEUED:
                self._pending[key] = None

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self._flush_s)
            self._wake.clear()
            try:
                self.flush()
            except DiscoveryError as exc:
                self.errors += 1
                log.warning("store: publishing blocks in etcd failed (%s); retrying", exc)
            except Exception:  # never let the thread die silently
                log.exception("store: unexpected error publishing blocks (the thread goes on)")

    def flush(self) -> None:
        """Writes what is pending now; after the agent's lease changed (etcd lost it),
        everything the host tier holds."""
        lease = self._disc.lease
        if lease == 0:
            return
        if lease != self._lease:
            with self._lock:
                for key, held_slot in self._held():
                    self._pending.setdefault(key, held_slot)
            self._lease = lease
        with self._lock:
            batch = list(self._pending.items())
            self._pending.clear()
        for i in range(0, len(batch), MAX_TXN_OPS):
            part = batch[i : i + MAX_TXN_OPS]
            ops: list[dict[str, Any]] = []
            for key, slot in part:
                if slot is None:
                    ops.append({"delete": self._key(key)})
                else:
                    value = json.dumps(
                        {"r": self._region, "o": slot * self._slot_bytes, "s": self._slot_bytes}
                    ).encode()
                    ops.append({"put": (self._key(key), value, lease)})
            try:
                self._etcd.txn(ops)
            except DiscoveryError:
                with self._lock:  # later changes win over the failed batch
                    for key, slot in part + batch[i + MAX_TXN_OPS :]:
                        self._pending.setdefault(key, slot)
                raise
            for _key, slot in part:
                if slot is None:
                    self.withdrawn += 1
                else:
                    self.published += 1

    # ---- lookups ---------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[list[Location]]:
        """Other agents' copies of each key (at most MAX_HOLDERS each; this agent's
        own are left out).  Answers younger than RECENT_S are reused: a scheduler's lookup
        and the load right after it cost one etcd round trip, not two (a stale answer costs
        a failed block at worst, as any entry).

        Raises:
            DiscoveryError: etcd did not answer.
        """
        now = time.monotonic()
        found: dict[bytes, list[Location]] = {}
        with self._lock:
            for k in keys:
                hit = self._recent.get(k)
                if hit is not None and now - hit[0] < RECENT_S:
                    found[k] = hit[1]
        ask = [k for k in dict.fromkeys(keys) if k not in found]
        for k, locs in zip(ask, self._ask(ask), strict=True):
            found[k] = locs
        with self._lock:
            for k in ask:
                self._recent[k] = (now, found[k])
                self._recent.move_to_end(k)
            while len(self._recent) > MAX_RECENT:
                self._recent.popitem(last=False)
        return [found[k] for k in keys]

    def forget(self, key: bytes) -> None:
        """Drops a remembered answer (its holder failed us)."""
        with self._lock:
            self._recent.pop(key, None)

    def _ask(self, keys: Sequence[bytes]) -> list[list[Location]]:
        out: list[list[Location]] = []
        for i in range(0, len(keys), MAX_TXN_OPS):
            part = keys[i : i + MAX_TXN_OPS]
            answers = self._etcd.txn(
                [{"range": (f"{self._dir}{k.hex()}/".encode(), MAX_HOLDERS + 1)} for k in part]
            )
            for k, ans in zip(part, answers, strict=False):
                locs = []
                prefix = f"{self._dir}{k.hex()}/"
                for kv in ans["kvs"]:
                    loc = _parse(kv.key, kv.value, prefix)
                    if loc is not None and loc.agent != self._name:
                        locs.append(loc)
                out.append(locs[:MAX_HOLDERS])
        return out

    def close(self) -> None:
        """Stops publishing and withdraws every key this store published (bounded by
        etcd's request timeout; the lease drops them anyway when the agent goes)."""
        self._stop = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        with self._lock:
            self._pending.clear()
            for key, _slot in self._held():
                self._pending[key] = None
        try:
            self.flush()
        except DiscoveryError as exc:
            log.info("store: could not withdraw blocks from etcd at close (%s)", exc)


def _parse(key: bytes, value: bytes, prefix: str) -> Location | None:
    """A holder from one etcd entry; None for anything malformed (entries are
    untrusted: whoever can write to etcd can write them)."""
    try:
        agent = key.decode()[len(prefix) :]
        d = json.loads(value)
        region, offset, slot_bytes = int(d["r"]), int(d["o"]), int(d["s"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None
    if not agent or "/" in agent or len(agent) > 255:
        return None
    if not (0 <= region < 2**63 and 0 <= offset < 2**62 and 0 < slot_bytes < 2**40):
        return None
    return Location(agent, region, offset, slot_bytes)
