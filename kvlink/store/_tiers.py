"""The store's tiers as arrays of slots: host memory and files on a local disk.

A tier only knows slots: where slot ``i`` is, which are free, and how to move whole
slots.  Which block is in which slot, eviction and pins are the store's
(``_store.py``).  Slots have the layout of ``_format.py`` on every tier.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import _native
from .._errors import ConfigError, KvlinkError
from ._format import (
    PAGE,
    SLOT_MAGIC,
    SlabHeader,
    SlotHeader,
    pack_slab_header,
    parse_slab_header,
    parse_slot_header,
)

log = logging.getLogger("kvlink.store")

SLAB_NAME = re.compile(r"^slab-(\d{4})\.kvl$")
MAX_FILE_BYTES = 4 << 30  # one slab file: few files, none a file system finds awkward
SCAN_BATCH_BYTES = 64 << 20  # re-indexing reads this much per batch


def aligned(nbytes: int, populate: bool = False) -> tuple[np.ndarray[Any, Any], mmap.mmap]:
    """Page-aligned, zeroed memory (anonymous mmap) as a uint8 array, and the map that
    owns it; ``populate`` faults every page in now (MAP_POPULATE), not on the data path."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    m = mmap.mmap(-1, max(nbytes, PAGE), flags=flags)
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= 2 << 20:
        # huge pages where the kernel has them: a load's pieces cross far fewer TLB entries
        m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=np.uint8, count=nbytes), m


def address(arr: np.ndarray[Any, Any]) -> int:
    return int(arr.__array_interface__["data"][0])


class HostTier:
    """``n_slots`` slots in one page-aligned block of host memory, registered with the
    agent so peers pull slots straight out of it (``remote_read``)."""

    def __init__(self, agent: Any, n_slots: int, slot_bytes: int, name: str) -> None:
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        # pages faulted in at open: a put or load never waits for the kernel to zero a page
        self.mem, self._map = aligned(n_slots * slot_bytes, populate=True)
        self.base = address(self.mem)
        self.free: list[int] = list(range(n_slots - 1, -1, -1))
        self.region = None
        if agent is not None:
            if any(r.name == name for r in agent.regions()):
                raise ConfigError(
                    f"name: agent {agent.name!r} already has a region named {name!r} (another "
                    "store?); give each store on one agent its own StoreConfig(name=...)"
                )
            self.region = agent.register(self.mem, remote_read=True, name=name)

    def addr(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    def view(self, slot: int, start: int = 0, nbytes: int | None = None) -> np.ndarray[Any, Any]:
        off = slot * self.slot_bytes + start
        return self.mem[off : off + (self.slot_bytes - start if nbytes is None else nbytes)]


@dataclass
class ScanReport:
    """What re-indexing a disk tier found."""

    valid: list[tuple[int, SlotHeader]] = field(default_factory=list)
    torn: int = 0  # a header that names a block whose payload fails its crc
    foreign_files: list[str] = field(default_factory=list)  # replaced with fresh slabs
    reset_files: list[str] = field(default_factory=list)  # another geometry: started empty


class DiskTier:
    """Slots in slab files under one directory, read and written with O_DIRECT through
    the C core's block I/O (io_uring, or threads where it is unavailable)."""

    def __init__(
        self,
        directory: str,
        n_slots: int,
        slot_bytes: int,
        block_bytes: int,
        *,
        io_depth: int,
        io_threads: int,
        force_threads: bool,
    ) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"disk_path: cannot create {directory!r} ({exc}); give a writable directory "
                "on the disk the store should use"
            ) from exc
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.block_bytes = block_bytes
        self.per_file = max(1, MAX_FILE_BYTES // slot_bytes)
        self.n_files = (n_slots + self.per_file - 1) // self.per_file
        self.fds: list[int] = []
        self.reader, self.backend = _native.blockio_open(io_depth, io_threads, force_threads)
        self.writer, _ = _native.blockio_open(io_depth, io_threads, force_threads)
        self.direct = True
        self.free: list[int] = []

    def where(self, slot: int) -> tuple[int, int]:
        """(fd, offset) of a slot."""
        f, i = divmod(slot, self.per_file)
        return self.fds[f], PAGE + i * self.slot_bytes

    def _slots_in(self, f: int) -> int:
        return min(self.per_file, self.n_slots - f * self.per_file)

    def open(self, verify: bool) -> ScanReport:
        """Opens (or creates) the slab files and re-indexes the slots they hold: every
        slot whose header is intact and whose payload matches its crc is reported valid;
        torn ones are counted; files that are not this geometry's slabs start empty."""
        rep = ScanReport()
        for name in sorted(os.listdir(self.dir)):
            m = SLAB_NAME.match(name)
            if m and int(m.group(1)) >= self.n_files:
                log.warning("store: %s is beyond this store's capacity; removed", self.dir / name)
                os.unlink(self.dir / name)
            elif not m and not name.startswith("."):
                log.warning("store: %s is not a kvlink slab file; left alone", self.dir / name)
        buf, _keep = aligned(PAGE)
        for f in range(self.n_files):
            path = self.dir / f"slab-{f:04d}.kvl"
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError:  # a file system without O_DIRECT (tmpfs): buffered I/O
                fd = os.open(path, flags, 0o600)
                if self.direct:
                    log.warning("store: %s does not take O_DIRECT; buffered I/O", self.dir)
                self.direct = False
            self.fds.append(fd)
            want = SlabHeader(self.slot_bytes, self.block_bytes, self._slots_in(f))
            size = os.fstat(fd).st_size
            head = None
            if size >= PAGE:
                _native.blockio_run(
                    self.reader, _native.new_ios([(fd, False, address(buf), PAGE, 0)])
                )
                head = parse_slab_header(bytes(buf[:64]))
            if head == want:
                continue
            if size:
                (rep.reset_files if head else rep.foreign_files).append(str(path))
                log.warning(
                    "store: %s %s; it starts empty",
                    path,
                    f"holds slots of another geometry ({head})" if head else "is not a kvlink slab",
                )
            os.ftruncate(fd, 0)
            buf[:] = np.frombuffer(pack_slab_header(want), dtype=np.uint8)
            _native.blockio_run(self.writer, _native.new_ios([(fd, True, address(buf), PAGE, 0)]))
            total = PAGE + want.n_slots * self.slot_bytes
            try:
                os.posix_fallocate(fd, 0, total)  # no extent allocation during writes
            except OSError:
                os.ftruncate(fd, total)
        self._scan(rep, verify)
        return rep

    def io(
        self, slot: int, write: bool, addr: int, nbytes: int | None = None
    ) -> tuple[int, bool, int, int, int]:
        """A block I/O row moving slot ``slot`` (its first ``nbytes``: all of it by
        default) from or to memory at ``addr``."""
        fd, off = self.where(slot)
        return fd, write, addr, self.slot_bytes if nbytes is None else nbytes, off

    def run(self, rows: list[tuple[int, bool, int, int, int]], *, write: bool) -> bool:
        """Runs a batch of :meth:`io` rows on the writer or the reader; False (logged) when
        any of them failed: the caller must not trust those slots."""
        try:
            _native.blockio_run(self.writer if write else self.reader, _native.new_ios(rows))
            return True
        except KvlinkError as exc:
            what = "writing" if write else "reading"
            log.error("store: %s %d blocks in %s failed: %s", what, len(rows), self.dir, exc)
            return False

    def _scan(self, rep: ScanReport, verify: bool) -> None:
        batch = max(1, min(self.n_slots, SCAN_BATCH_BYTES // self.slot_bytes))
        heads, _k1 = aligned(batch * PAGE)
        slots, _k2 = aligned(batch * self.slot_bytes) if verify else (heads, None)
        used: set[int] = set()
        for first in range(0, self.n_slots, batch):
            ids = range(first, min(first + batch, self.n_slots))
            ops = _native.new_ios(
                [self.io(s, False, address(heads) + i * PAGE, PAGE) for i, s in enumerate(ids)]
            )
            _native.blockio_run(self.reader, ops)
            found = []
            for i, s in enumerate(ids):
                raw = bytes(heads[i * PAGE : i * PAGE + 128])
                h = parse_slot_header(raw)
                if h is None:
                    if raw.startswith(SLOT_MAGIC):  # a header that was cut or changed
                        rep.torn += 1
                    continue
                if h.slot_bytes != self.slot_bytes or h.payload_len != self.block_bytes:
                    rep.torn += 1
                    continue
                found.append((s, h))
            if verify and found:
                ops = _native.new_ios(
                    [
                        self.io(s, False, address(slots) + j * self.slot_bytes)
                        for j, (s, _h) in enumerate(found)
                    ]
                )
                _native.blockio_run(self.reader, ops)
            for j, (s, h) in enumerate(found):
                at = address(slots) + j * self.slot_bytes + PAGE
                if verify and _native.crc32c_at(at, h.payload_len) != h.payload_crc:
                    rep.torn += 1
                    continue
                rep.valid.append((s, h))
                used.add(s)
        self.free = [s for s in range(self.n_slots - 1, -1, -1) if s not in used]

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        _native.blockio_close(self.reader)
        _native.blockio_close(self.writer)
