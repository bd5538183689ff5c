"""How a block sits in a slot, in memory and on disk: one format for every tier.

A slot is a 4 KiB header page followed by the block's payload, padded to 4 KiB, so a
slot moves between host memory and a file as one aligned O_DIRECT read or write, and a
peer pulls one with one segment.  The header names the block (its 32-byte key), its
length and its payload's crc32c, and carries its own crc32c: a torn or foreign slot
fails one of the two and is never served (docs/store.md, "On disk").

A slab file starts with a 4 KiB file header (magic, version, slot geometry) and holds
``n_slots`` slots after it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from .. import _native

PAGE = 4096
KEY_BYTES = 32

SLOT_MAGIC = b"KVLBLK01"
SLAB_MAGIC = b"KVLSLAB1"
VERSION = 1

# magic, version, header crc, key, payload length, payload crc, flags, sequence, slot bytes
_SLOT = struct.Struct("<8sII32sQIIQQ")
# magic, version, header crc, slot bytes, block bytes, slots in the file
_SLAB = struct.Struct("<8sIIQQQ")


def round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def slot_bytes(block_bytes: int) -> int:
    """Bytes of one slot holding a ``block_bytes`` payload."""
    return PAGE + round_up(block_bytes)


@dataclass(frozen=True)
class SlotHeader:
    key: bytes
    payload_len: int
    payload_crc: int
    seq: int
    slot_bytes: int


def pack_slot_header(h: SlotHeader) -> bytes:
    """The header's bytes (its crc included); shorter than a page."""
    fields = (h.key, h.payload_len, h.payload_crc, 0, h.seq, h.slot_bytes)
    crc = _native.crc32c(_SLOT.pack(SLOT_MAGIC, VERSION, 0, *fields))
    return _SLOT.pack(SLOT_MAGIC, VERSION, crc, *fields)


def parse_slot_header(raw: Any) -> SlotHeader | None:
    """The header in ``raw`` (a slot's first bytes), or None when it is not a valid
    kvlink slot header (never written, torn, foreign, another version)."""
    if len(raw) < _SLOT.size:
        return None
    head = bytes(raw[: _SLOT.size])
    magic, version, crc, key, plen, pcrc, _flags, seq, sbytes = _SLOT.unpack(head)
    if magic != SLOT_MAGIC or version != VERSION:
        return None
    if _native.crc32c(head[:12] + bytes(4) + head[16:]) != crc:
        return None
    return SlotHeader(key, plen, pcrc, seq, sbytes)


@dataclass(frozen=True)
class SlabHeader:
    slot_bytes: int
    block_bytes: int
    n_slots: int


def pack_slab_header(h: SlabHeader) -> bytes:
    """A slab file's first page."""
    fields = (h.slot_bytes, h.block_bytes, h.n_slots)
    crc = _native.crc32c(_SLAB.pack(SLAB_MAGIC, VERSION, 0, *fields))
    return _SLAB.pack(SLAB_MAGIC, VERSION, crc, *fields).ljust(PAGE, b"\0")


def parse_slab_header(raw: Any) -> SlabHeader | None:
    """The slab header in a file's first bytes, or None when it is not one of ours
    (or of another version)."""
    if len(raw) < _SLAB.size:
        return None
    head = bytes(raw[: _SLAB.size])
    magic, version, crc, sbytes, bbytes, n = _SLAB.unpack(head)
    if magic != SLAB_MAGIC or version != VERSION:
        return None
    if _native.crc32c(head[:12] + bytes(4) + head[16:]) != crc:
        return None
    return SlabHeader(sbytes, bbytes, n)
