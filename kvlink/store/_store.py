"""The block store: an index of blocks over the tiers, eviction, loads and prefetch.

Every block has one entry here; an entry has a host slot, a disk slot, or both.
Blocks move down when the host tier passes its high watermark (write-back) or are
written down as they arrive (write-through); they move up on a read or a prefetch.
Bytes move outside the lock: an entry being moved is marked busy, and a busy or pinned
entry is never chosen for eviction.  docs/store.md is the user's guide.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _native
from .._errors import (
    ArgumentTypeError,
    ClosedError,
    ConfigError,
    DiscoveryError,
    InvalidArgumentError,
    KvlinkError,
)
from .._types import MemoryType
from ..kv import PagedLayout
from ._evict import Policy, make_policy
from ._format import (
    KEY_BYTES,
    PAGE,
    SlotHeader,
    pack_slot_header,
    parse_slot_header,
    slot_bytes,
)
from ._remote import Location, RemoteIndex
from ._tiers import DiskTier, HostTier, address, aligned

log = logging.getLogger("kvlink.store")

_KEY_SALT = b"kvlink-store-v1\0"
SCRATCH_PAGES = 1024  # slot headers of remote hits in flight (4 MiB)
MAX_PREFETCHES = 4096  # prefetches holding pins; beyond, the oldest are released
PARALLEL_COPY_MIN = 16 << 20  # a load part moving less goes on one thread


class StoreError(KvlinkError):
    """A store operation failed; the message says which block and what to do."""


class StoreFullError(StoreError, MemoryError):
    """No slot could be freed: every block of the tier is pinned or being moved."""


class Tier(enum.Enum):
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


class PrefetchPolicy(enum.Enum):
    BEST_EFFORT = "best-effort"  # start the moves, never wait for them
    WAIT = "wait"  # wait until every block is up (bounded by the call's timeout)
    TIMEOUT = "timeout"  # wait up to a deadline that grows with the prefix, capped


def block_keys(
    namespace: str, tokens: Sequence[int], block_tokens: int, parent: bytes | None = None
) -> list[bytes]:
    """The content keys of every full block of ``tokens``: block ``i``'s key hashes its
    tokens and block ``i-1``'s key (a prefix chain, so equal keys mean equal prefixes),
    starting from ``parent`` or from ``namespace`` (the model, its weights' revision and
    the KV layout: blocks of two models never share a key)."""
    if not isinstance(namespace, str):
        raise ArgumentTypeError(f"namespace: expected str, got {type(namespace).__name__}")
    if block_tokens <= 0:
        raise InvalidArgumentError(f"block_tokens: expected a positive int, got {block_tokens}")
    prev = parent if parent is not None else hashlib.sha256(_KEY_SALT + namespace.encode()).digest()
    arr = np.asarray(tokens, dtype="<i8")
    keys = []
    for i in range(len(arr) // block_tokens):
        prev = hashlib.sha256(
            prev + arr[i * block_tokens : (i + 1) * block_tokens].tobytes()
        ).digest()
        keys.append(prev)
    return keys


@dataclass(frozen=True)
class StoreConfig:
    """What a store holds and how it behaves.  Sizes in bytes.

    Raises:
        ConfigError: a field out of range; the message names it.
    """

    block_bytes: int  # one block, every layer: layers x planes x the layout's block bytes
    host_bytes: int  # host tier capacity (registered memory peers pull from)
    disk_path: str | None = None  # a directory on the NVMe to use; None: no disk tier
    disk_bytes: int = 0  # disk tier capacity
    eviction: str = "lru"  # "lru" or "arc", within each tier
    write_policy: str = "write-back"  # or "write-through": every put also goes to disk
    high_watermark: float = 0.95  # host tier fuller than this: demote in the background...
    low_watermark: float = 0.85  # ... until it is this full, so puts rarely wait
    io_depth: int = 64  # io_uring entries: enough to keep an NVMe busy with 1 MiB I/Os
    io_threads: int = 4  # the thread pool's size where io_uring is unavailable
    force_thread_io: bool = False  # use the thread pool even where io_uring works
    verify_on_open: bool = True  # re-read every payload at open to discard torn blocks
    remote: bool = True  # publish and find blocks through the agent's discovery (etcd)
    loaders: int = 2  # threads running loads and prefetches
    copy_threads: int = 2  # threads one large load copies with (memory bandwidth per thread)
    prefetch_base_s: float = 0.05  # timeout policy: base + per block x blocks, capped
    prefetch_per_block_s: float = 0.002
    prefetch_cap_s: float = 1.0
    prefetch_pin_s: float = 60.0  # a prefetch's pins end after this unless released
    name: str = "kvstore"  # the host tier's region name

    def __post_init__(self) -> None:
        for f in ("block_bytes", "host_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{f}: expected a positive int of bytes, got {v!r}")
        if self.host_bytes < slot_bytes(self.block_bytes):
            raise ConfigError(
                f"host_bytes: {self.host_bytes} bytes hold no block of {self.block_bytes} bytes "
                f"(a slot takes {slot_bytes(self.block_bytes)}); give at least that"
            )
        if self.disk_path is not None:
            if not isinstance(self.disk_path, str) or not self.disk_path:
                raise ConfigError(f"disk_path: expected a directory path, got {self.disk_path!r}")
            if self.disk_bytes < slot_bytes(self.block_bytes):
                raise ConfigError(
                    f"disk_bytes: {self.disk_bytes} bytes hold no block of {self.block_bytes} "
                    "bytes; give the disk tier's capacity (disk_path is set)"
                )
        elif self.disk_bytes:
            raise ConfigError("disk_bytes: set, but disk_path is None; give both or neither")
        if self.eviction not in ("lru", "arc"):
            raise ConfigError(f"eviction: expected 'lru' or 'arc', got {self.eviction!r}")
        if self.write_policy not in ("write-back", "write-through"):
            raise ConfigError(
                f"write_policy: expected 'write-back' or 'write-through', got {self.write_policy!r}"
            )
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ConfigError(
                f"low_watermark / high_watermark: need 0 < low < high <= 1, got "
                f"{self.low_watermark} / {self.high_watermark}"
            )
        if not 1 <= self.io_depth <= 4096:
            raise ConfigError(f"io_depth: expected 1..4096, got {self.io_depth}")
        if not 1 <= self.io_threads <= 64:
            raise ConfigError(f"io_threads: expected 1..64, got {self.io_threads}")
        if not 1 <= self.loaders <= 64:
            raise ConfigError(f"loaders: expected 1..64, got {self.loaders}")
        if not 1 <= self.copy_threads <= 64:
            raise ConfigError(f"copy_threads: expected 1..64, got {self.copy_threads}")
        for f in ("prefetch_base_s", "prefetch_per_block_s", "prefetch_cap_s", "prefetch_pin_s"):
            if not getattr(self, f) >= 0:
                raise ConfigError(f"{f}: expected seconds >= 0, got {getattr(self, f)!r}")


@dataclass(frozen=True)
class Lookup:
    """Where each key of a prefix is: ``tiers[i]`` is the highest tier holding key
    ``i`` (None: nowhere), ``holders[i]`` the agent for a remote one."""

    tiers: tuple[Tier | None, ...]
    holders: tuple[str | None, ...]

    @property
    def hits(self) -> int:
        """Leading keys held somewhere: the prefix a load can fill."""
        n = 0
        for t in self.tiers:
            if t is None:
                break
            n += 1
        return n

    @property
    def local_hits(self) -> int:
        """Leading keys held by this agent."""
        n = 0
        for t in self.tiers:
            if t not in (Tier.HOST, Tier.DISK):
                break
            n += 1
        return n


@dataclass
class StoreStats:
    """Counters since the store opened (hits and misses count blocks)."""

    hits: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "remote": 0})
    misses: int = 0
    failed: int = 0  # blocks a load could not serve (missing, failed checks, lost peer)
    bytes_read: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "remote": 0})
    bytes_written: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    evictions: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    dropped: int = 0  # blocks evicted from the last tier: gone
    discarded: int = 0  # blocks that failed their checks (torn on disk, stale remotely)
    prefetch_missed: int = 0  # prefetches whose deadline passed before every block was up
    blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    io_backend: str = ""


class _Entry:
    __slots__ = ("busy", "crc", "disk", "host", "key", "loading", "pins")

    def __init__(self, key: bytes, crc: int) -> None:
        self.key = key
        self.host: int | None = None
        self.disk: int | None = None
        self.crc = crc
        self.pins = 0
        self.busy = 0  # moves in flight that read one of its slots
        self.loading = False  # a promotion to host is running


class Load:
    """A load of blocks into an engine's layout (``Store.get``): per-layer completion
    like a transfer's, and the blocks that could not be served."""

    def __init__(self, n_blocks: int, n_layers: int) -> None:
        self._cv = threading.Condition()
        self._layers = [False] * n_layers
        self._failed: set[int] = set()
        self._done = False
        self.n_blocks = n_blocks
        self.tiers: list[Tier | None] = [None] * n_blocks
        self.reasons: dict[int, str] = {}

    def _fail(self, i: int, why: str) -> None:
        with self._cv:
            self._failed.add(i)
            self.reasons.setdefault(i, why)

    def _layer(self, layer: int) -> None:
        with self._cv:
            self._layers[layer] = True
            self._cv.notify_all()

    def _finish(self) -> None:
        with self._cv:
            self._layers = [True] * len(self._layers)
            self._done = True
            self._cv.notify_all()

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Blocks until ``layer`` of every block is in place or known failed.

        Raises:
            StoreTimeoutError: not within ``timeout_s`` (the load goes on).
        """
        if not 0 <= layer < len(self._layers):
            raise InvalidArgumentError(f"layer: {layer} is outside [0, {len(self._layers)})")
        with self._cv:
            if not self._cv.wait_for(lambda: self._layers[layer], timeout_s):
                raise StoreTimeoutError(
                    f"layer {layer} of the load not in place within {timeout_s} s"
                )

    def wait(self, timeout_s: float | None = None) -> Load:
        """Blocks until the load ended; then :attr:`failed` is final.

        Raises:
            StoreTimeoutError: not ended within ``timeout_s`` (it goes on)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._done, timeout_s):
                raise StoreTimeoutError(f"the load did not end within {timeout_s} s")
        return self

    @property
    def done(self) -> bool:
        with self._cv:
            return self._done

    @property
    def failed(self) -> list[int]:
        """Indices (into the keys given) of blocks not served: the engine recomputes
        them.  Final once :attr:`done`."""
        with self._cv:
            return sorted(self._failed)

    @property
    def ok(self) -> bool:
        with self._cv:
            return self._done and not self._failed


class StoreTimeoutError(StoreError, TimeoutError):
    """A wait on a load or prefetch ran out of time; the operation goes on."""


class Prefetch:
    """Moves a prefix up to the host tier (``Store.prefetch``).  Holds a pin on every
    block it brought up or found there until :meth:`release` (or ``prefetch_pin_s``)."""

    def __init__(self, store: Store, keys: list[bytes], deadline: float) -> None:
        self._store = store
        self.keys = keys
        self.deadline = deadline  # time.monotonic() the policy waits until (inf: until done)
        self._cv = threading.Condition()
        self._done = False
        self._pinned: list[bytes] = []
        self._released = False
        self.expires = time.monotonic() + store.config.prefetch_pin_s

    def _finish(self) -> None:
        with self._cv:
            self._done = True
            self._cv.notify_all()

    @property
    def done(self) -> bool:
        with self._cv:
            return self._done

    def ready(self) -> int:
        """Leading keys in the host tier now: what a load serves without disk or network."""
        return self._store._host_prefix(self.keys)

    def wait(self, timeout_s: float | None = None) -> int:
        """Waits for the moves up to this prefetch's deadline (its policy's), or
        ``timeout_s`` if given; returns :meth:`ready`.  Never raises for time: a prefix
        not up by then is recomputed past what is ready."""
        end = self.deadline if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            left = None if math.isinf(end) else max(0.0, end - time.monotonic())
            self._cv.wait_for(lambda: self._done, left)
            missed = not self._done
        if missed:
            self._store._count("prefetch_missed")
        return self.ready()

    def _add_pin(self, key: bytes) -> bool:
        """Records a pin the store is about to take; False once released (no pin)."""
        with self._cv:
            if self._released:
                return False
            self._pinned.append(key)
            return True

    def release(self) -> None:
        """Ends the pins this prefetch holds (idempotent; a prefetch still running
        takes no more)."""
        with self._cv:
            if self._released:
                return
            self._released = True
            pinned, self._pinned = self._pinned, []
        self._store.unpin(pinned)


class Store:
    """A KV block store over host memory, a local disk and other agents' stores.

    ``agent``: the kvlink.Agent whose memory and connections the store uses (its host
    tier is registered there, remote hits are pulled through it).

    Raises:
        ConfigError: a bad config, or a disk_path that cannot be used.
    """

    def __init__(self, agent: Any, config: StoreConfig) -> None:
        if not isinstance(config, StoreConfig):
            raise ArgumentTypeError(f"config: expected a StoreConfig, got {type(config).__name__}")
        if not hasattr(agent, "_regions"):
            raise ArgumentTypeError(f"agent: expected a kvlink.Agent, got {type(agent).__name__}")
        self.agent = agent
        self.config = config
        self.block_bytes = config.block_bytes
        self.slot_bytes = slot_bytes(config.block_bytes)
        self._mu = threading.Lock()
        self._cv = threading.Condition(self._mu)
        self._index: dict[bytes, _Entry] = {}
        self._closed = False
        self._stats = StoreStats()
        self._seq = int(time.time() * 1e6)  # newer copies win at re-index
        n_host = config.host_bytes // self.slot_bytes
        self.host = HostTier(agent, n_host, self.slot_bytes, config.name)
        self._host_lru: Policy = make_policy(config.eviction, n_host)
        self.disk: DiskTier | None = None
        self._disk_lru: Policy | None = None
        self._wt_queue: deque[bytes] = deque()
        self._writing = 0
        self._prefetches: list[Prefetch] = []
        try:
            if config.disk_path is not None:
                self._open_disk()
            self._scratch, self._scratch_map = aligned(SCRATCH_PAGES * PAGE)
            self._scratch_region = agent.register(self._scratch, name=f"{config.name}-scratch")
            self._scratch_free = list(range(SCRATCH_PAGES))
            self._remote: RemoteIndex | None = None
            if config.remote and agent.discovery is not None:
                assert self.host.region is not None
                self._remote = RemoteIndex(agent, self.host.region.id, self.slot_bytes, self._held)
        except BaseException:
            self._release_resources()
            raise
        self._pool = ThreadPoolExecutor(config.loaders, thread_name_prefix="kvlink-store-load")
        self._copiers = ThreadPoolExecutor(
            max(1, config.loaders * (config.copy_threads - 1)),
            thread_name_prefix="kvlink-store-copy",
        )
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._maintain, name="kvlink-store", daemon=True)
        self._thread.start()
        log.info(
            "store: host %d slots of %d bytes%s",
            n_host,
            self.slot_bytes,
            f", disk {self.disk.n_slots} slots in {self.disk.dir} ({self.disk.backend})"
            if self.disk
            else "",
        )

    def _open_disk(self) -> None:
        cfg = self.config
        assert cfg.disk_path is not None
        n = cfg.disk_bytes // self.slot_bytes
        self.disk = DiskTier(
            cfg.disk_path,
            n,
            self.slot_bytes,
            self.block_bytes,
            io_depth=cfg.io_depth,
            io_threads=cfg.io_threads,
            force_threads=cfg.force_thread_io,
        )
        if not self.disk.backend.startswith("io_uring"):
            log.warning("store: disk I/O through %s", self.disk.backend)
        self._stats.io_backend = self.disk.backend
        rep = self.disk.open(cfg.verify_on_open)
        self._disk_lru = make_policy(cfg.eviction, n)
        by_key: dict[bytes, tuple[int, SlotHeader]] = {}
        for s, h in rep.valid:
            old = by_key.get(h.key)
            if old is None or h.seq > old[1].seq:
                if old is not None:
                    self.disk.free.append(old[0])
                by_key[h.key] = (s, h)
            else:
                self.disk.free.append(s)
        for key, (s, h) in sorted(by_key.items(), key=lambda kv: kv[1][1].seq):
            e = _Entry(key, h.payload_crc)
            e.disk = s
            self._index[key] = e
            self._disk_lru.insert(key)
            self._seq = max(self._seq, h.seq + 1)
        self._stats.discarded += rep.torn
        if rep.torn:
            log.warning("store: %d torn blocks in %s discarded", rep.torn, self.disk.dir)
        log.info("store: re-indexed %d blocks from %s", len(by_key), self.disk.dir)

    # ---- small helpers ------------------------------------------------------------

    def _count(self, what: str, n: int = 1) -> None:
        with self._mu:
            setattr(self._stats, what, getattr(self._stats, what) + n)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the store is closed")

    def _held(self) -> list[tuple[bytes, int]]:
        with self._mu:
            return [(k, e.host) for k, e in self._index.items() if e.host is not None]

    def _host_prefix(self, keys: Sequence[bytes]) -> int:
        with self._mu:
            n = 0
            for k in keys:
                e = self._index.get(k)
                if e is None or e.host is None:
                    break
                n += 1
            return n

    def _keys(self, keys: Any, arg: str = "keys") -> list[bytes]:
        if isinstance(keys, (bytes, bytearray)):
            raise ArgumentTypeError(
                f"{arg}: expected a list of {KEY_BYTES}-byte keys, got one bytes"
            )
        out = []
        for i, k in enumerate(keys):
            if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
                raise InvalidArgumentError(
                    f"{arg}[{i}]: expected a {KEY_BYTES}-byte key (kvlink.store.block_keys makes "
                    f"them), got {type(k).__name__} {k!r:.40}"
                )
            out.append(bytes(k))
        return out

    def _layout_addrs(
        self, layout: PagedLayout, blocks: Any, n: int, arg: str = "layout"
    ) -> np.ndarray[Any, Any]:
        """Addresses of every piece of every block: shape (blocks, layers x planes),
        piece j of block i at payload offset j x layout.block_bytes."""
        if not isinstance(layout, PagedLayout):
            raise ArgumentTypeError(
                f"{arg}: expected a kvlink.kv.PagedLayout, got {type(layout).__name__}"
            )
        pieces = layout.num_layers * layout.planes
        if pieces * layout.block_bytes != self.block_bytes:
            raise InvalidArgumentError(
                f"{arg}: {layout.num_layers} layers x {layout.planes} planes x "
                f"{layout.block_bytes} bytes = {pieces * layout.block_bytes} bytes per block, "
                f"but the store's blocks are {self.block_bytes} bytes (StoreConfig.block_bytes)"
            )
        b = np.asarray(blocks, dtype=np.int64).reshape(-1)
        if b.size != n:
            raise InvalidArgumentError(
                f"blocks: {b.size} block ids for {n} keys; they pair one to one"
            )
        if b.size and (b.min() < 0 or b.max() >= layout.num_blocks):
            raise InvalidArgumentError(f"blocks: ids must be in [0, {layout.num_blocks})")
        base = np.empty(layout.num_layers, dtype=np.int64)
        for li, (rid, off) in enumerate(zip(layout.regions, layout.offsets, strict=False)):
            r = self.agent._regions.get(rid)
            if r is None:
                raise InvalidArgumentError(
                    f"{arg}: region {rid} of layer {li} is not registered with this agent"
                )
            if r.mem != MemoryType.HOST:
                raise InvalidArgumentError(
                    f"{arg}: layer {li} is in GPU memory (region {r.name or rid}); the store "
                    "copies host memory only (a GPU tier is not built yet: docs/store.md)"
                )
            end = (
                off
                + (layout.planes - 1) * layout.plane_stride
                + layout.num_blocks * layout.block_bytes
            )
            if end > r.nbytes:
                raise InvalidArgumentError(
                    f"{arg}: layer {li} reaches past the end of region {rid}"
                )
            base[li] = r.address + off
        plane = np.arange(layout.planes, dtype=np.int64) * layout.plane_stride
        per_piece = (base[:, None] + plane[None, :]).reshape(-1)  # (pieces,)
        return per_piece[None, :] + (b * layout.block_bytes)[:, None]

    # ---- host slots and eviction ------------------------------------------------------

    def _host_alloc(self, n: int) -> list[int]:
        """``n`` free host slots (lock held; may release it while demoting).

        Raises:
            StoreFullError: no block could be evicted."""
        while len(self.host.free) < n:
            if not self._evict_host(n - len(self.host.free)):
                raise StoreFullError(
                    f"store: host tier full ({self.host.n_slots} slots): every block is pinned "
                    "or being moved; unpin blocks, release prefetches or give more host_bytes"
                )
        return [self.host.free.pop() for _ in range(n)]

    def _evict_host(self, need: int) -> bool:
        """Frees up to ``need`` host slots (lock held; released while writing blocks
        down).  False when nothing could be evicted."""
        victims: list[_Entry] = []
        for k in self._host_lru.candidates():
            e = self._index[k]
            if e.pins == 0 and e.busy == 0 and not e.loading:
                victims.append(e)
                if len(victims) >= need:
                    break
        if not victims:
            return False
        to_write = [e for e in victims if e.disk is None] if self.disk is not None else []
        down = {id(e) for e in to_write}
        for e in victims:
            if id(e) not in down:
                self._drop_host(e, evicted=True)
        if to_write:
            self._copy_down(to_write)
            for e in to_write:  # written, or no disk slot for it: dropped
                if e.pins == 0 and e.busy == 0 and e.host is not None:
                    self._drop_host(e, evicted=True)
        return True

    def _drop_host(self, e: _Entry, *, evicted: bool) -> None:
        assert e.host is not None
        self.host.free.append(e.host)
        e.host = None
        self._host_lru.remove(e.key, evicted=evicted)
        if evicted:
            self._stats.evictions["host"] += 1
        if self._remote is not None:
            self._remote.withdraw(e.key)
        if e.disk is None:
            del self._index[e.key]
            if evicted:
                self._stats.dropped += 1

    def _disk_alloc(self, n: int) -> list[int]:
        """Up to ``n`` free disk slots (lock held), evicting disk copies; fewer when
        too many are pinned or busy."""
        assert self.disk is not None and self._disk_lru is not None
        if len(self.disk.free) < n:
            victims = []
            for k in self._disk_lru.candidates():
                e = self._index[k]
                if e.pins == 0 and e.busy == 0 and not e.loading:
                    victims.append(e)
                    if len(victims) >= n - len(self.disk.free):
                        break
            for e in victims:
                assert e.disk is not None
                self.disk.free.append(e.disk)
                e.disk = None
                self._disk_lru.remove(e.key, evicted=True)
                self._stats.evictions["disk"] += 1
                if e.host is None:
                    del self._index[e.key]
                    self._stats.dropped += 1
        take = min(n, len(self.disk.free))
        return [self.disk.free.pop() for _ in range(take)]

    def _copy_down(self, entries: list[_Entry]) -> list[_Entry]:
        """Writes the host copies of ``entries`` into new disk slots (lock held; released
        during the I/O).  Entries that find no disk slot are left as they are.  Returns the
        ones now on disk."""
        slots = self._disk_alloc(len(entries))
        part = entries[: len(slots)]
        for e, s in zip(part, slots, strict=True):
            e.disk = s
            e.busy += 1
        if not part:
            return []
        self._write_down(part)
        for e in part:
            e.busy -= 1
            if e.disk is not None and self._disk_lru is not None:
                self._disk_lru.insert(e.key)
        self._cv.notify_all()
        return [e for e in part if e.disk is not None]

    def _write_down(self, entries: list[_Entry]) -> None:
        """Writes the host copies of ``entries`` to their disk slots (lock held on entry
        and on return, released during the I/O; the entries are busy)."""
        assert self.disk is not None
        rows = []
        for e in entries:
            assert e.host is not None and e.disk is not None
            rows.append(self.disk.io(e.disk, True, self.host.addr(e.host)))
        self._writing += 1
        self._mu.release()
        try:
            ok = self.disk.run(rows, write=True)
        finally:
            self._mu.acquire()
            self._writing -= 1
        self._stats.bytes_written["disk"] += len(rows) * self.slot_bytes if ok else 0
        if not ok:  # those disk slots hold nothing trustworthy: give them back
            for e in entries:
                if e.disk is not None:
                    self.disk.free.append(e.disk)
                    e.disk = None

    # ---- put ------------------------------------------------------------------------

    def put(self, keys: Any, layout: PagedLayout, blocks: Any) -> int:
        """Copies blocks ``blocks`` of ``layout`` (registered with the store's agent)
        into the host tier under ``keys``; keys already held are skipped.  Returns how
        many were stored.  Blocks for the copy (run it off the engine's step).

        Raises:
            InvalidArgumentError: keys, layout or blocks that do not fit (named).
            StoreFullError: the host tier cannot take them (all pinned or busy).
        """
        self._check_open()
        ks = self._keys(keys)
        addrs = self._layout_addrs(layout, blocks, len(ks))
        return self._put(ks, addrs, layout.block_bytes)

    def put_bytes(self, key: bytes, data: Any) -> bool:
        """Stores one block given as bytes (any buffer of exactly ``block_bytes``).
        False when the key was held already."""
        self._check_open()
        (k,) = self._keys([key])
        buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        if buf.size != self.block_bytes:
            raise InvalidArgumentError(f"data: {buf.size} bytes, but blocks are {self.block_bytes}")
        return self._put([k], np.array([[address(buf)]], dtype=np.int64), self.block_bytes) == 1

    def _put(self, ks: list[bytes], addrs: np.ndarray[Any, Any], piece: int) -> int:
        # more blocks than a quarter of the host tier go in parts, so earlier parts can
        # move down while later ones arrive
        step = max(1, self.host.n_slots // 4)
        return sum(
            self._put_part(ks[i : i + step], addrs[i : i + step], piece)
            for i in range(0, len(ks), step)
        )

    def _put_part(self, ks: list[bytes], addrs: np.ndarray[Any, Any], piece: int) -> int:
        with self._mu:
            new: list[int] = []
            seen: set[bytes] = set()
            for i, k in enumerate(ks):
                e = self._index.get(k)
                if e is not None:
                    if e.host is not None:
                        self._host_lru.touch(k)  # written again: a use
                elif k not in seen:  # the same key twice in one call: once
                    seen.add(k)
                    new.append(i)
            if not new:
                return 0
            slots = self._host_alloc(len(new))
        try:
            # one pass: each piece is checksummed as it is copied (payload order per block)
            dst = np.array([self.host.addr(s) + PAGE for s in slots], dtype=np.int64)
            npieces = addrs.shape[1]
            d = (dst[:, None] + np.arange(npieces, dtype=np.int64)[None, :] * piece).reshape(-1)
            plan = _native.copy_plan(d, addrs[new].reshape(-1), np.full(d.size, piece))
            index = _native.block_index(np.repeat(np.arange(len(new), dtype=np.uint32), npieces))
            state = _native.new_crcs(len(new))
            _native.copy_crc_run(plan, index, 0, d.size, state, len(new))
            crcs = [int(state[j]) for j in range(len(new))]
        except BaseException:
            with self._mu:
                self.host.free.extend(slots)
            raise
        stored = 0
        with self._mu:
            for i, s, crc in zip(new, slots, crcs, strict=False):
                k = ks[i]
                if k in self._index:  # another put won the race
                    self.host.free.append(s)
                    continue
                self._seq += 1
                hdr = pack_slot_header(
                    SlotHeader(k, self.block_bytes, crc, self._seq, self.slot_bytes)
                )
                self.host.view(s, 0, len(hdr))[:] = np.frombuffer(hdr, dtype=np.uint8)
                e = _Entry(k, crc)
                e.host = s
                self._index[k] = e
                self._host_lru.insert(k)
                stored += 1
                if self._remote is not None:
                    self._remote.publish(k, s)
                if self.disk is not None and self.config.write_policy == "write-through":
                    self._wt_queue.append(k)
            self._stats.bytes_written["host"] += stored * self.block_bytes
            if (
                self._wt_queue
                or len(self.host.free) < (1 - self.config.high_watermark) * self.host.n_slots
            ):
                self._wake.set()
        return stored

    # ---- lookup, pins, eviction by hand -------------------------------------------------

    def lookup(self, keys: Any, *, remote: bool = True) -> Lookup:
        """Where each key is held (this agent's tiers first, then, with ``remote`` and a
        remote index, other agents').  A lookup does not count as a use: it never
        keeps a block from being evicted."""
        self._check_open()
        ks = self._keys(keys)
        tiers: list[Tier | None] = []
        holders: list[str | None] = []
        with self._mu:
            for k in ks:
                e = self._index.get(k)
                if e is None:
                    tiers.append(None)
                else:
                    tiers.append(Tier.HOST if e.host is not None else Tier.DISK)
                holders.append(None)
        missing = [i for i, t in enumerate(tiers) if t is None]
        if remote and missing and self._remote is not None:
            try:
                found = self._remote.lookup([ks[i] for i in missing])
            except DiscoveryError as exc:
                log.warning(
                    "store: remote lookup failed (%s); counting those blocks as misses", exc
                )
                found = [[] for _ in missing]
            for i, locs in zip(missing, found, strict=False):
                if locs:
                    tiers[i] = Tier.REMOTE
                    holders[i] = locs[0].agent
        return Lookup(tuple(tiers), tuple(holders))

    def pin(self, keys: Any) -> int:
        """Keeps the blocks of ``keys`` this agent holds from eviction until
        :meth:`unpin` (pins count: pin twice, unpin twice).  Returns how many were
        pinned."""
        ks = self._keys(keys)
        with self._mu:
            n = 0
            for k in ks:
                e = self._index.get(k)
                if e is not None:
                    e.pins += 1
                    n += 1
            return n

    def unpin(self, keys: Any) -> None:
        """Ends one pin of each key (keys not pinned are ignored)."""
        ks = self._keys(keys)
        with self._mu:
            for k in ks:
                e = self._index.get(k)
                if e is not None and e.pins > 0:
                    e.pins -= 1
            self._cv.notify_all()

    def delete(self, keys: Any) -> int:
        """Removes the blocks of ``keys`` from every local tier (pinned or busy ones
        stay).  Returns how many went."""
        ks = self._keys(keys)
        n = 0
        with self._mu:
            for k in ks:
                e = self._index.get(k)
                if e is None or e.pins or e.busy or e.loading:
                    continue
                if e.disk is not None and self.disk is not None and self._disk_lru is not None:
                    self.disk.free.append(e.disk)
                    self._disk_lru.remove(k, evicted=False)
                    e.disk = None
                if e.host is not None:
                    self._drop_host(e, evicted=False)
                else:
                    del self._index[k]
                n += 1
        return n

    # ---- loads ----------------------------------------------------------------------

    def get(self, keys: Any, layout: PagedLayout, blocks: Any, *, timeout_s: float = 30.0) -> Load:
        """Starts loading ``keys`` into blocks ``blocks`` of ``layout`` (registered with
        the store's agent) and returns its :class:`Load` at once.  Host hits are copied,
        disk hits read up to the host tier first, remote hits pulled straight into the
        layout over every path to their holder.  Every block is checked against its
        crc32c before it counts; one that is missing or fails is listed in
        ``Load.failed`` and its pages are left for the engine to recompute.

        Raises:
            InvalidArgumentError: keys, layout or blocks that do not fit (named).
        """
        self._check_open()
        ks = self._keys(keys)
        addrs = self._layout_addrs(layout, blocks, len(ks))
        load = Load(len(ks), layout.num_layers)
        deadline = time.monotonic() + timeout_s
        self._pool.submit(self._run_get, load, ks, addrs, layout, deadline)
        return load

    def get_bytes(self, key: bytes, *, timeout_s: float = 30.0) -> bytes | None:
        """One block's bytes (from any tier, checked), or None when it is not held or
        fails its checks."""
        (k,) = self._keys([key])
        buf = np.empty(self.block_bytes, dtype=np.uint8)
        addrs = np.array([[address(buf)]], dtype=np.int64)
        load = Load(1, 1)
        self._run_get(load, [k], addrs, None, time.monotonic() + timeout_s)
        return None if load.failed else buf.tobytes()

    def _run_get(
        self,
        load: Load,
        ks: list[bytes],
        addrs: np.ndarray[Any, Any],
        layout: PagedLayout | None,
        deadline: float,
    ) -> None:
        try:
            with self._mu:
                local = [i for i, k in enumerate(ks) if k in self._index]
            here = set(local)
            absent = [i for i in range(len(ks)) if i not in here]
            remote = self._start_remote(ks, absent, addrs, layout, load, deadline)
            # blocks move through the host tier a quarter of it at a time; the last part
            # goes layer by layer, so layer 0 completes before the rest
            step = max(1, self.host.n_slots // 4)
            parts = [local[j : j + step] for j in range(0, len(local), step)] or [[]]
            for n, part in enumerate(parts):
                held: list[tuple[int, int, int]] = []
                keep: list[Any] = []
                bad: set[int] = set()
                try:
                    for i in self._bring_up(ks, part, load, held, deadline, keep):
                        load._fail(i, "evicted while the load ran")
                    last = n == len(parts) - 1
                    got = self._copy_out(held, addrs, load, remote if last else None, deadline)
                    for (i, _at, want), crc in zip(held, got, strict=True):
                        if crc != want:  # its pages hold what failed: the engine recomputes
                            tier = load.tiers[i]
                            where = tier.value if tier is not None else "local"
                            load._fail(i, f"its {where} copy failed its crc32c")
                            bad.add(i)
                finally:
                    self._release_held(ks, held, load, bad)
            self._finish_remote(ks, remote, addrs, load, deadline)
        except Exception as exc:  # a load never raises into the pool: it fails its blocks
            log.exception("store: load failed")
            for i in range(len(ks)):
                load._fail(i, f"load failed: {exc}")
        finally:
            with self._mu:
                self._stats.failed += len(load._failed)
            load._finish()

    def _release_held(
        self, ks: list[bytes], held: list[tuple[int, int, int]], load: Load, bad: set[int]
    ) -> None:
        """Ends the busy marks of a load's part; counts its hits; drops copies that failed
        their checks."""
        with self._mu:
            for i, _at, _crc in held:
                e = self._index.get(ks[i])
                if e is None:
                    continue
                e.busy -= 1
                if i in bad:
                    self._stats.discarded += 1
                    if e.host is not None and e.busy == 0 and e.pins == 0:
                        self._drop_host(e, evicted=False)
                    continue
                self._host_lru.touch(ks[i])
                tier = load.tiers[i]
                self._stats.hits["disk" if tier is Tier.DISK else "host"] += 1
            self._stats.bytes_read["host"] += len(held) * self.block_bytes
            self._cv.notify_all()

    def _copy_out(
        self,
        held: list[tuple[int, int, int]],
        addrs: np.ndarray[Any, Any],
        load: Load,
        remote: list[tuple[Any, list[tuple[int, int]]]] | None,
        deadline: float,
    ) -> list[int]:
        """Copies the slots of blocks ``held`` (busy) into their pages and checksums them
        in the same pass (the source is read once: its crc32c comes from the cache);
        returns each block's crc32c, for the caller to check.  With ``remote`` (the last
        part) it goes layer by layer, each layer signalled once the remote transfers have
        it too."""
        npieces = addrs.shape[1]
        piece = self.block_bytes // npieces
        n_layers = len(load._layers)
        per_layer = npieces // n_layers
        k = len(held)
        base = np.array([at + PAGE for _i, at, _c in held], dtype=np.int64)
        src_all = base[:, None] + np.arange(npieces, dtype=np.int64)[None, :] * piece
        rows = [i for i, _at, _c in held]
        dst_all = addrs[rows] if held else np.empty((0, npieces), np.int64)

        # blocks split over copy_threads threads when there is enough to move (a thread
        # reaches only part of the memory bandwidth); each group one plan, layer-major:
        # one C call per layer and group, every block's pieces still in payload order
        # (its crc continues piece after piece)
        t = self.config.copy_threads if k * self.block_bytes >= PARALLEL_COPY_MIN else 1
        t = max(1, min(t, k))
        groups = []
        for g in range(t):
            lo, hi = g * k // t, (g + 1) * k // t
            m = hi - lo

            def order(a: np.ndarray[Any, Any], m: int = m) -> np.ndarray[Any, Any]:
                return a.reshape(m, n_layers, per_layer).transpose(1, 0, 2).reshape(-1)

            blk = np.repeat(np.arange(m, dtype=np.uint32)[:, None], npieces, axis=1)
            plan = _native.copy_plan(
                order(dst_all[lo:hi]), order(src_all[lo:hi]), np.full(m * npieces, piece)
            )
            groups.append((plan, _native.block_index(order(blk)), _native.new_crcs(m), m))

        def run(layers: range) -> None:
            def one(g: tuple[Any, Any, Any, int]) -> None:
                plan, index, crcs, m = g
                count = m * per_layer
                _native.copy_crc_run(
                    plan, index, layers.start * count, len(layers) * count, crcs, m
                )

            futs = [self._copiers.submit(one, g) for g in groups[1:]]
            one(groups[0])
            for f in futs:
                f.result()

        if remote is None:
            run(range(n_layers))
        else:
            for layer in range(n_layers):
                run(range(layer, layer + 1))
                for tr, _blocks in remote:
                    # the whole transfer's outcome is checked at the end
                    with contextlib.suppress(KvlinkError):
                        tr.wait_layer(layer, timeout_s=max(0.0, deadline - time.monotonic()))
                load._layer(layer)
        return [int(g[2][j]) for g in groups for j in range(g[3])]

    def _bring_up(
        self,
        ks: list[bytes],
        idxs: list[int],
        load: Load,
        held: list[tuple[int, int, int]],
        deadline: float,
        keep: list[Any],
    ) -> list[int]:
        """Marks host hits busy and reads disk hits up into the host tier (into a
        private buffer when the host tier is full of pinned blocks: ``keep`` holds it;
        each read is checked), and appends (index, address of its slot, expected crc32c)
        to ``held`` for each; the entries of ``held`` stay busy.  Returns the indices no
        longer held here."""
        missing: list[int] = []
        promote: list[tuple[int, _Entry]] = []
        with self._mu:
            for i in idxs:
                k = ks[i]
                e = self._index.get(k)
                while e is not None and e.loading and time.monotonic() < deadline:
                    self._cv.wait(max(0.0, min(0.1, deadline - time.monotonic())))
                    e = self._index.get(k)
                if e is None or e.loading or (e.host is None and e.disk is None):
                    missing.append(i)
                elif e.host is not None:
                    e.busy += 1
                    held.append((i, self.host.addr(e.host), e.crc))
                    load.tiers[i] = Tier.HOST
                else:
                    e.loading = True
                    e.busy += 1
                    promote.append((i, e))
        if promote:
            got = self._promote([e for _i, e in promote], keep)
            with self._mu:
                for (i, e), slot_at in zip(promote, got, strict=True):
                    if slot_at is not None:
                        held.append((i, slot_at, e.crc))
                        load.tiers[i] = Tier.DISK
                    else:
                        load._fail(i, "its copy on disk failed its checks")
        return missing

    def _promote(self, entries: list[_Entry], keep: list[Any] | None = None) -> list[int | None]:
        """Reads disk copies into host slots.  The entries are loading and busy; loading
        ends here, busy stays for the ones that passed their checks (the caller ends
        it).  When the host tier has no room and ``keep`` is given, they are read into a
        private buffer appended to ``keep`` instead.  Each result is the address of the
        checked slot, or None."""
        assert self.disk is not None
        bounce = None
        with self._mu:
            try:
                slots = self._host_alloc(len(entries))
            except StoreFullError:
                if keep is None:
                    for e in entries:
                        e.loading = False
                        e.busy -= 1
                    self._cv.notify_all()
                    return [None] * len(entries)
                slots = []
        if not slots:
            bounce, bmap = aligned(len(entries) * self.slot_bytes)
            keep.append(bmap)  # type: ignore[union-attr]
            addrs = [address(bounce) + j * self.slot_bytes for j in range(len(entries))]
        else:
            addrs = [self.host.addr(s) for s in slots]
        try:
            rows = [self.disk.io(e.disk, False, at)  # type: ignore[arg-type]
                    for e, at in zip(entries, addrs, strict=True)]
            io_ok = self.disk.run(rows, write=False)
        except BaseException:
            # nothing read: the entries are as before the move, the slots back in the tier
            with self._mu:
                for e in entries:
                    e.loading = False
                    e.busy -= 1
                self.host.free.extend(slots)
                self._cv.notify_all()
            raise
        out: list[int | None] = []
        with self._mu:
            for j, (e, at) in enumerate(zip(entries, addrs, strict=True)):
                raw = bytes(_native.memory_at(at, 128)) if io_ok else b""
                h = parse_slot_header(raw) if io_ok else None
                good = (
                    h is not None
                    and h.key == e.key
                    and h.payload_len == self.block_bytes
                    and h.payload_crc == e.crc
                    and _native.crc32c_at(at + PAGE, self.block_bytes) == e.crc
                )
                e.loading = False
                self._stats.bytes_read["disk"] += self.slot_bytes if io_ok else 0
                if good:
                    out.append(at)
                    if self._disk_lru is not None:
                        self._disk_lru.touch(e.key)
                    if slots:
                        e.host = slots[j]
                        self._host_lru.insert(e.key)
                        if self._remote is not None:
                            self._remote.publish(e.key, slots[j])
                    continue
                out.append(None)
                e.busy -= 1
                if slots:
                    self.host.free.append(slots[j])
                self._stats.discarded += 1
                log.warning(
                    "store: block %s on disk failed its checks; discarded", e.key.hex()[:16]
                )
                if e.disk is not None and self._disk_lru is not None and self.disk is not None:
                    self.disk.free.append(e.disk)
                    self._disk_lru.remove(e.key, evicted=False)
                    e.disk = None
                self._forget_if_empty(e)
            self._cv.notify_all()
        return out

    def _forget_if_empty(self, e: _Entry) -> None:
        """Drops ``e`` from the index once it holds no copy (under ``_mu``), pinned or not:
        an entry with neither a host nor a disk copy is a miss, never a block on disk.  Its
        pins go with it (unpinning a key no longer held is a no-op); moves still busy on it
        read their own slots, not the entry's."""
        if e.host is None and e.disk is None and self._index.get(e.key) is e:
            del self._index[e.key]

    # ---- remote hits ------------------------------------------------------------------

    def _scratch_take(self, n: int) -> list[int]:
        with self._mu:
            if len(self._scratch_free) < n:
                return []
            return [self._scratch_free.pop() for _ in range(n)]

    def _scratch_give(self, pages: Iterable[int]) -> None:
        with self._mu:
            self._scratch_free.extend(pages)

    def _start_remote(
        self,
        ks: list[bytes],
        missing: list[int],
        addrs: np.ndarray[Any, Any],
        layout: PagedLayout | None,
        load: Load,
        deadline: float,
    ) -> list[tuple[Any, list[tuple[int, int]]]]:
        """Pulls the missing blocks other agents hold straight into the layout: one
        transfer per holder; each block's slot header goes to a scratch page.  Returns
        (transfer, [(block index, scratch page)]) per holder; blocks nobody holds fail."""
        if not missing:
            return []
        locs: list[list[Location]] = [[] for _ in missing]
        if self._remote is not None and layout is not None:
            try:
                locs = self._remote.lookup([ks[i] for i in missing])
            except DiscoveryError as exc:
                log.warning("store: remote lookup failed (%s)", exc)
        by_agent: dict[str, list[tuple[int, Location]]] = {}
        for i, ls in zip(missing, locs, strict=False):
            ls = [loc for loc in ls if loc.slot_bytes == self.slot_bytes]
            if not ls:
                load._fail(i, "not held by this store or any other")
                with self._mu:
                    self._stats.misses += 1
                continue
            by_agent.setdefault(ls[0].agent, []).append((i, ls[0]))
        out = []
        assert layout is None or isinstance(layout, PagedLayout)
        # at most a quarter of the scratch pages per transfer: several loads share them
        step = SCRATCH_PAGES // 4
        parts = [
            (agent, items[j : j + step])
            for agent, items in by_agent.items()
            for j in range(0, len(items), step)
        ]
        for agent, items in parts:
            pages = self._scratch_take(len(items))
            if not pages:
                for i, _l in items:
                    load._fail(i, "too many remote loads in flight (scratch pages)")
                continue
            try:
                segs = self._remote_segments(items, pages, addrs, layout)
                t = self.agent.pull(
                    agent, segments=segs, timeout_s=max(0.001, deadline - time.monotonic())
                )
            except KvlinkError as exc:
                self._scratch_give(pages)
                for i, _l in items:
                    load._fail(i, f"pull from {agent} failed: {exc}")
                continue
            for i, _l in items:
                load.tiers[i] = Tier.REMOTE
            out.append((t, [(i, p) for (i, _l), p in zip(items, pages, strict=False)]))
        return out

    def _remote_segments(
        self,
        items: list[tuple[int, Location]],
        pages: list[int],
        addrs: np.ndarray[Any, Any],
        layout: PagedLayout | None,
    ) -> np.ndarray[Any, Any]:
        """The segments pulling ``items`` from their holder: per block its slot header into
        a scratch page, then each piece of its payload into the layout (numpy, no loop per
        piece)."""
        from .._segments import SEGMENT_DTYPE

        assert layout is not None
        k, npieces = len(items), addrs.shape[1]
        piece = layout.block_bytes
        bases = []
        for rid in layout.regions:
            r = self.agent._regions.get(rid)
            if r is None:
                raise InvalidArgumentError(f"layout: region {rid} is no longer registered")
            bases.append(r.address)
        rid_of = np.repeat(np.asarray(layout.regions, np.uint64), layout.planes)
        base_of = np.repeat(np.asarray(bases, np.int64), layout.planes)
        rows = np.zeros((k, npieces + 1), dtype=SEGMENT_DTYPE)
        src_reg = np.array([loc.region for _i, loc in items], dtype=np.uint64)[:, None]
        src_off = np.array([loc.offset for _i, loc in items], dtype=np.int64)[:, None]
        rows["src_region"] = src_reg
        rows["src_offset"][:, 0] = src_off[:, 0]
        rows["dst_region"][:, 0] = self._scratch_region.id
        rows["dst_offset"][:, 0] = np.asarray(pages, dtype=np.int64) * PAGE
        rows["len"][:, 0] = PAGE
        idx = np.array([i for i, _loc in items], dtype=np.int64)
        rows["src_offset"][:, 1:] = src_off + PAGE + np.arange(npieces, dtype=np.int64) * piece
        rows["dst_region"][:, 1:] = rid_of[None, :]
        rows["dst_offset"][:, 1:] = addrs[idx] - base_of[None, :]
        rows["len"][:, 1:] = piece
        rows["layer"][:, 1:] = np.arange(npieces, dtype=np.uint32) // layout.planes
        return rows.reshape(-1)

    def _finish_remote(
        self,
        ks: list[bytes],
        remote: list[tuple[Any, list[tuple[int, int]]]],
        addrs: np.ndarray[Any, Any],
        load: Load,
        deadline: float,
    ) -> None:
        piece = self.block_bytes // addrs.shape[1] if addrs.size else 0
        for t, items in remote:
            try:
                t.wait(timeout_s=max(0.0, deadline - time.monotonic()) + 5.0)
                ok = True
                why = ""
            except KvlinkError as exc:
                ok, why = False, str(exc)
            for i, p in items:
                if not ok:
                    load._fail(i, f"pull failed: {why}")
                    if self._remote is not None:
                        self._remote.forget(ks[i])
                    continue
                h = parse_slot_header(self._scratch[p * PAGE : p * PAGE + 128])
                crc = _native.crc32c_spans(addrs[i].tolist(), [piece] * addrs.shape[1])
                if (
                    h is None
                    or h.key != ks[i]
                    or h.payload_len != self.block_bytes
                    or h.payload_crc != crc
                ):
                    load._fail(i, "the remote copy changed or failed its crc32c")
                    if self._remote is not None:
                        self._remote.forget(ks[i])
                    with self._mu:
                        self._stats.discarded += 1
                    continue
                with self._mu:
                    self._stats.hits["remote"] += 1
                    self._stats.bytes_read["remote"] += self.block_bytes
            self._scratch_give(p for _i, p in items)

    # ---- prefetch ---------------------------------------------------------------------

    def prefetch(
        self,
        keys: Any,
        *,
        policy: PrefetchPolicy | str = PrefetchPolicy.TIMEOUT,
        timeout_s: float | None = None,
    ) -> Prefetch:
        """Starts moving the longest held prefix of ``keys`` up to the host tier (from
        disk, or from another agent's host tier) and pins what is up there.  With
        ``TIMEOUT`` the returned handle's ``wait()`` waits base + per-block x blocks
        (capped: StoreConfig.prefetch_*), with ``WAIT`` up to ``timeout_s`` (None: until
        done), with ``BEST_EFFORT`` not at all.  A prefetch never waits for another
        request's moves: a block someone else is bringing up counts as not ready.
        Release it (``Prefetch.release``) once loaded.
        """
        self._check_open()
        ks = self._keys(keys)
        try:
            pol = PrefetchPolicy(policy)
        except ValueError:
            raise InvalidArgumentError(
                f"policy: expected one of {[p.value for p in PrefetchPolicy]}, got {policy!r}"
            ) from None
        now = time.monotonic()
        c = self.config
        if pol is PrefetchPolicy.BEST_EFFORT:
            deadline = now
        elif pol is PrefetchPolicy.WAIT:
            deadline = math.inf if timeout_s is None else now + timeout_s
        else:
            wait = min(c.prefetch_cap_s, c.prefetch_base_s + c.prefetch_per_block_s * len(ks))
            deadline = now + (wait if timeout_s is None else min(wait, timeout_s))
        pf = Prefetch(self, ks, deadline)
        with self._mu:
            self._prefetches.append(pf)
        self._pool.submit(self._run_prefetch, pf)
        return pf

    def _run_prefetch(self, pf: Prefetch) -> None:
        try:
            promote: list[_Entry] = []
            fetch: list[int] = []
            # at most half the host tier: a prefetch must leave room for loads and puts
            keys = pf.keys[: max(1, self.host.n_slots // 2)]
            with self._mu:
                for i, k in enumerate(keys):
                    e = self._index.get(k)
                    if e is None:
                        fetch = list(range(i, len(keys)))
                        break
                    if pf._add_pin(k):
                        e.pins += 1
                    if e.host is None and e.disk is not None and not e.loading:
                        e.loading = True
                        e.busy += 1
                        promote.append(e)
            if promote:
                got = self._promote(promote)
                with self._mu:
                    for e, at in zip(promote, got, strict=True):
                        if at is not None:
                            e.busy -= 1
                    self._cv.notify_all()
            if fetch and self._remote is not None:
                self._fetch_remote(pf, [keys[i] for i in fetch])
        except Exception:
            log.exception("store: prefetch failed")
        finally:
            pf._finish()

    def _fetch_remote(self, pf: Prefetch, keys: list[bytes]) -> None:
        """Pulls other agents' copies of the leading ``keys`` into local host slots."""
        from .._segments import Segment

        assert self._remote is not None
        try:
            locs = self._remote.lookup(keys)
        except DiscoveryError as exc:
            log.warning("store: remote lookup failed (%s)", exc)
            return
        n = 0
        for ls in locs:
            if not any(loc.slot_bytes == self.slot_bytes for loc in ls):
                break
            n += 1
        if n == 0:
            return
        keys = keys[:n]
        with self._mu:
            try:
                slots = self._host_alloc(n)
            except StoreFullError:
                return
        assert self.host.region is not None
        by_agent: dict[str, list[int]] = {}
        for j, ls in enumerate(locs[:n]):
            loc = next(loc for loc in ls if loc.slot_bytes == self.slot_bytes)
            by_agent.setdefault(loc.agent, []).append(j)
        transfers = []
        for agent, js in by_agent.items():
            segs = []
            for j in js:
                loc = next(loc for loc in locs[j] if loc.slot_bytes == self.slot_bytes)
                segs.append(
                    Segment(
                        loc.region,
                        loc.offset,
                        self.host.region.id,
                        slots[j] * self.slot_bytes,
                        self.slot_bytes,
                    )
                )
            try:
                transfers.append((self.agent.pull(agent, segments=segs, timeout_s=30.0), js))
            except KvlinkError as exc:
                log.info("store: prefetch from %s failed: %s", agent, exc)
        good: set[int] = set()
        for t, js in transfers:
            try:
                t.wait()
            except KvlinkError as exc:
                log.info("store: prefetch pull failed: %s", exc)
                continue
            for j in js:
                h = parse_slot_header(self.host.view(slots[j], 0, 128))
                if (
                    h is not None
                    and h.key == keys[j]
                    and h.payload_len == self.block_bytes
                    and _native.crc32c_at(self.host.addr(slots[j]) + PAGE, self.block_bytes)
                    == h.payload_crc
                ):
                    good.add(j)
        with self._mu:
            for j, (k, s) in enumerate(zip(keys, slots, strict=False)):
                if j not in good or k in self._index:
                    self.host.free.append(s)
                    if j not in good:
                        self._stats.discarded += 1
                    continue
                h = parse_slot_header(self.host.view(s, 0, 128))
                assert h is not None
                e = _Entry(k, h.payload_crc)
                e.host = s
                e.pins = 1 if pf._add_pin(k) else 0
                self._index[k] = e
                self._host_lru.insert(k)
                self._stats.hits["remote"] += 1
                self._stats.bytes_read["remote"] += self.slot_bytes
                if self._remote is not None:
                    self._remote.publish(k, s)
            self._cv.notify_all()

    # ---- the background thread: watermarks, write-through, expired pins -----------------

    def _maintain(self) -> None:
        while not self._closed:
            self._wake.wait(0.05)
            self._wake.clear()
            if self._closed:
                break
            try:
                self._maintain_once()
            except Exception:
                log.exception("store: maintenance failed (the thread goes on)")

    def _maintain_once(self) -> None:
        c = self.config
        with self._mu:
            used = self.host.n_slots - len(self.host.free)
            if used > c.high_watermark * self.host.n_slots:
                self._evict_host(used - int(c.low_watermark * self.host.n_slots))
            if self._wt_queue and self.disk is not None:
                batch: list[_Entry] = []
                while self._wt_queue and len(batch) < 256:
                    e = self._index.get(self._wt_queue.popleft())
                    if e is not None and e.host is not None and e.disk is None and not e.loading:
                        batch.append(e)
                self._copy_down(batch)
            now = time.monotonic()
            expired = [p for p in self._prefetches if p.done and (p._released or p.expires < now)]
            over = len(self._prefetches) - len(expired) - MAX_PREFETCHES
            if over > 0:  # a caller that never releases: the oldest go early
                expired += [p for p in self._prefetches if p.done and p not in expired][:over]
            for p in expired:
                self._prefetches.remove(p)
        for p in expired:
            if not p._released:
                log.warning(
                    "store: a prefetch of %d blocks was never released; its pins end after %g s",
                    len(p.keys),
                    c.prefetch_pin_s,
                )
                p.release()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Waits until every write-through queued so far is on disk.

        Raises:
            StoreTimeoutError: not within ``timeout_s``."""
        end = time.monotonic() + timeout_s
        with self._mu:
            while self._wt_queue or self._writing:
                self._wake.set()
                if (
                    not self._cv.wait(max(0.0, min(0.05, end - time.monotonic())))
                    and time.monotonic() >= end
                ):
                    raise StoreTimeoutError(f"write-through not on disk within {timeout_s} s")

    def _write_back_all(self) -> None:
        """At close: blocks only the host tier holds go down to disk, so a restarted
        store still has them (nothing to do without a disk tier)."""
        if self.disk is None:
            return
        with self._mu:
            todo = [e for e in self._index.values() if e.host is not None and e.disk is None]
            while todo:
                part, todo = todo[:256], todo[256:]
                part = [e for e in part if e.busy == 0 and not e.loading and e.host is not None]
                if part and not self._copy_down(part):
                    break  # no disk slot left

    # ---- stats and close ------------------------------------------------------------------

    def stats(self) -> StoreStats:
        """A copy of the counters, with the blocks each tier holds now."""
        with self._mu:
            s = StoreStats(
                hits=dict(self._stats.hits),
                misses=self._stats.misses,
                failed=self._stats.failed,
                bytes_read=dict(self._stats.bytes_read),
                bytes_written=dict(self._stats.bytes_written),
                evictions=dict(self._stats.evictions),
                dropped=self._stats.dropped,
                discarded=self._stats.discarded,
                prefetch_missed=self._stats.prefetch_missed,
                io_backend=self._stats.io_backend,
            )
            s.blocks = {
                "host": self.host.n_slots - len(self.host.free),
                "disk": (self.disk.n_slots - len(self.disk.free)) if self.disk else 0,
            }
            return s

    def __len__(self) -> int:
        with self._mu:
            return len(self._index)

    def __contains__(self, key: object) -> bool:
        with self._mu:
            return key in self._index

    def close(self) -> None:
        """Writes pending write-through blocks (bounded), stops the threads, withdraws
        the published blocks and frees the tiers.  Idempotent."""
        if self._closed:
            return
        try:
            self.flush(timeout_s=10.0)
        except StoreError as exc:
            log.warning("store: closing without every write-through on disk: %s", exc)
        self._write_back_all()
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=True)
        self._copiers.shutdown(wait=True)
        self._release_resources()

    def _release_resources(self) -> None:
        remote = getattr(self, "_remote", None)
        if remote is not None:
            remote.close()
            self._remote = None
        for attr in ("_scratch_region",):
            r = getattr(self, attr, None)
            if r is not None and not self.agent.closed:
                try:
                    self.agent.deregister(r)
                except KvlinkError as exc:
                    log.warning("store: could not deregister its scratch pages: %s", exc)
                setattr(self, attr, None)
        if self.host.region is not None and not self.agent.closed:
            try:
                self.agent.deregister(self.host.region)
            except KvlinkError as exc:
                log.warning("store: could not deregister the host tier: %s", exc)
            self.host.region = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass
