"""The SGLang backend's side-channel messages (ZMQ multipart frames) and notification tags.

SGLang's own control plane carries them: decode registers its KV memory with each prefill rank
once (``REG``), then names each request's destination pages (``ROOM``); prefill answers a
failure with a status message. The KV bytes themselves travel as kvlink pushes; a push's
notification tag (``sgl/<room>/<attempt>/<chunk>[/last]``) tells decode which chunk of which
request is verified in its memory; ``attempt`` is a random number decode draws for each
receiver, so that a late push of an earlier request under the same room never counts for a
later one. Nothing here imports SGLang, so the parsing is tested in
kvlink's own environment.

Every frame comes from a socket anyone on the network may reach: each parser bounds every
length, count and index before use and raises :class:`MessageError` naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
from typing import Any

import numpy as np

REG_TAG = b"KVLINK_REG"
ROOM_TAG = b"KVLINK_ROOM"
STATUS_TAG = b"KVLINK_STATUS"

PROTOCOL_VERSION = 1
# A registration carries the kvlink metadata (addresses and one access key per region: ~60
# bytes a region) and a few integers per KV buffer; 4 MiB holds ~16k buffers.
MAX_REG_BYTES = 4 << 20
# KV buffers (layers x K/V, plus draft layers) and aux buffers one decode rank registers.
MAX_BUFFERS = 8192
# Pages one request names: 2^22 pages hold 4M tokens at a page size of 1 (16 MiB of int32).
MAX_PAGES = 1 << 22
# The largest control frame either side accepts (ZMQ's MAXMSGSIZE on its socket): a ROOM's
# page list at MAX_PAGES, or a registration.
MAX_FRAME_BYTES = 4 * MAX_PAGES + 4096
# Chunks one request's KV is pushed in (one per chunked-prefill step and page-range segment).
MAX_CHUNKS = 1 << 16
_ROOM_MAX = (1 << 64) - 1
_TAG_RE = re.compile(rb"sgl/(\d{1,20})/(\d{1,10})/(\d{1,9})(/last)?")
_ATTEMPT_MAX = (1 << 32) - 1


class MessageError(ValueError):
    """A side-channel frame or notification tag that does not parse or is out of bounds."""


class AuthError(MessageError):
    """A control message not signed under this side's cluster secret."""


def control_key(secret: bytes | None) -> bytes | None:
    """The key decode signs its control messages with: derived from the cluster secret (never
    the secret itself); None without a secret (agents then listen on loopback only)."""
    if secret is None:
        return None
    return hashlib.sha256(b"kvlink-sglang-control-v1\0" + secret).digest()


def _mac(key: bytes, frames: list[bytes]) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for f in frames:
        h.update(len(f).to_bytes(8, "little"))
        h.update(f)
    return h.digest()


def sign(frames: list[bytes], key: bytes | None) -> list[bytes]:
    """``frames`` and a last frame: their HMAC-SHA256 under ``key`` (empty without a key)."""
    return [*frames, b"" if key is None else _mac(key, frames)]


def verify(frames: list[bytes], key: bytes | None) -> list[bytes]:
    """The frames of a signed message without its MAC; AuthError when the MAC is not this
    side's (another cluster secret, or a secret on one side only)."""
    if len(frames) < 2:
        raise MessageError("control message: no MAC frame")
    body, mac = frames[:-1], frames[-1]
    if key is None:
        if mac:
            raise AuthError("signed under a cluster secret, and this side has none: give "
                            "every server the same KVLINK_SECRET")
        return body
    if not mac:
        raise AuthError("not signed, and this side has a cluster secret: give every server "
                        "the same KVLINK_SECRET")
    if not hmac.compare_digest(mac, _mac(key, body)):
        raise AuthError("signed under another cluster secret: give every server the same "
                        "KVLINK_SECRET")
    return body


@dataclasses.dataclass(frozen=True)
class Registration:
    """One decode rank's KV memory, as it tells each prefill rank it pairs with."""

    session: str            # the decode rank's kvlink agent name
    endpoint: str           # its SGLang control endpoint (status messages go there)
    port: int
    metadata: str           # its kvlink metadata (addresses, instance, region keys)
    kv_regions: list[int]   # kvlink region id of each KV buffer, in KVArgs order
    kv_item_lens: list[int]  # bytes of one page in each KV buffer
    kv_pages: list[int]     # pages each KV buffer holds
    aux_regions: list[int]
    aux_item_lens: list[int]
    aux_slots: list[int]    # request slots each aux buffer holds
    tp_rank: int
    attn_tp_size: int
    is_mla: bool
    page_size: int


@dataclasses.dataclass(frozen=True)
class RoomInfo:
    """Where one request's KV goes on one decode rank."""

    room: int
    attempt: int            # decode's random number for this receiver (0 .. 2^32-1)
    session: str
    endpoint: str
    port: int
    dst_pages: np.ndarray[Any, np.dtype[np.int32]]
    aux_index: int
    required_dst_info_num: int
    is_dummy: bool

    @property
    def dst_port(self) -> int:
        """SGLang's name for ``port`` (CommonKVManager._room_notify_targets reads it)."""
        return self.port


def _int(value: Any, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise MessageError(f"{field}: expected an integer in [{lo}, {hi}], got {value!r}")
    return value


def _str(value: Any, field: str, max_len: int) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise MessageError(f"{field}: expected a string of 1..{max_len} characters")
    return value


def _ints(value: Any, field: str, lo: int, hi: int) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_BUFFERS:
        raise MessageError(f"{field}: expected a list of at most {MAX_BUFFERS} integers")
    return [_int(v, f"{field}[{i}]", lo, hi) for i, v in enumerate(value)]


def encode_registration(reg: Registration) -> list[bytes]:
    return [REG_TAG, json.dumps({"v": PROTOCOL_VERSION, **dataclasses.asdict(reg)}).encode()]


def decode_registration(frames: list[bytes]) -> Registration:
    """Raises MessageError for anything malformed or out of bounds."""
    if len(frames) != 2 or frames[0] != REG_TAG:
        raise MessageError(f"registration: expected 2 frames tagged {REG_TAG!r}")
    if len(frames[1]) > MAX_REG_BYTES:
        raise MessageError(f"registration: {len(frames[1])} bytes, more than {MAX_REG_BYTES}")
    try:
        d = json.loads(frames[1])
    except ValueError as exc:
        raise MessageError(f"registration: not JSON ({exc})") from None
    if not isinstance(d, dict):
        raise MessageError("registration: expected a JSON object")
    if d.get("v") != PROTOCOL_VERSION:
        raise MessageError(
            f"registration: protocol version {d.get('v')!r}, this kvlink speaks "
            f"{PROTOCOL_VERSION}: run the same kvlink version on prefill and decode"
        )
    reg = Registration(
        session=_str(d.get("session"), "session", 63),
        endpoint=_str(d.get("endpoint"), "endpoint", 255),
        port=_int(d.get("port"), "port", 1, 65535),
        metadata=_str(d.get("metadata"), "metadata", MAX_REG_BYTES),
        kv_regions=_ints(d.get("kv_regions"), "kv_regions", 1, 2**63),
        kv_item_lens=_ints(d.get("kv_item_lens"), "kv_item_lens", 1, 1 << 40),
        kv_pages=_ints(d.get("kv_pages"), "kv_pages", 0, 1 << 40),
        aux_regions=_ints(d.get("aux_regions"), "aux_regions", 1, 2**63),
        aux_item_lens=_ints(d.get("aux_item_lens"), "aux_item_lens", 1, 1 << 30),
        aux_slots=_ints(d.get("aux_slots"), "aux_slots", 0, 1 << 30),
        tp_rank=_int(d.get("tp_rank"), "tp_rank", 0, 1 << 20),
        attn_tp_size=_int(d.get("attn_tp_size"), "attn_tp_size", 1, 1 << 20),
        is_mla=bool(d.get("is_mla")),
        page_size=_int(d.get("page_size"), "page_size", 1, 1 << 20),
    )
    if not len(reg.kv_regions) == len(reg.kv_item_lens) == len(reg.kv_pages):
        raise MessageError("registration: kv_regions, kv_item_lens and kv_pages differ in length")
    if not len(reg.aux_regions) == len(reg.aux_item_lens) == len(reg.aux_slots):
        raise MessageError(
            "registration: aux_regions, aux_item_lens and aux_slots differ in length"
        )
    return reg


def encode_room(info: RoomInfo) -> list[bytes]:
    return [
        ROOM_TAG,
        str(info.room).encode(),
        str(info.attempt).encode(),
        info.session.encode(),
        info.endpoint.encode(),
        str(info.port).encode(),
        b"" if info.is_dummy else np.ascontiguousarray(info.dst_pages, "<i4").tobytes(),
        str(info.aux_index).encode(),
        str(info.required_dst_info_num).encode(),
        b"1" if info.is_dummy else b"0",
    ]


def _frame_int(frame: bytes, field: str, lo: int, hi: int) -> int:
    if not 0 < len(frame) <= 20 or not frame.isdigit():
        raise MessageError(f"{field}: expected decimal digits")
    return _int(int(frame), field, lo, hi)


def _frame_str(frame: bytes, field: str, max_len: int) -> str:
    try:
        return _str(frame.decode("utf-8"), field, max_len)
    except UnicodeDecodeError:
        raise MessageError(f"{field}: not UTF-8") from None


def decode_room(frames: list[bytes]) -> RoomInfo:
    """Raises MessageError for anything malformed or out of bounds."""
    if len(frames) != 10 or frames[0] != ROOM_TAG:
        raise MessageError(f"room: expected 10 frames tagged {ROOM_TAG!r}")
    is_dummy = frames[9] == b"1"
    pages_raw = frames[6]
    if len(pages_raw) % 4 or len(pages_raw) // 4 > MAX_PAGES:
        raise MessageError(f"room: dst_pages of {len(pages_raw)} bytes (int32, at most "
                           f"{MAX_PAGES} pages)")
    pages = np.frombuffer(pages_raw, dtype="<i4").astype(np.int32)
    if pages.size and int(pages.min()) < 0:
        raise MessageError("room: dst_pages holds a negative page")
    return RoomInfo(
        room=_frame_int(frames[1], "room", 0, _ROOM_MAX),
        attempt=_frame_int(frames[2], "attempt", 0, _ATTEMPT_MAX),
        session=_frame_str(frames[3], "session", 63),
        endpoint=_frame_str(frames[4], "endpoint", 255),
        port=_frame_int(frames[5], "port", 1, 65535),
        dst_pages=pages,
        aux_index=-1 if is_dummy else _frame_int(frames[7], "aux_index", 0, 1 << 30),
        required_dst_info_num=_frame_int(frames[8], "required_dst_info_num", 1, 1 << 16),
        is_dummy=is_dummy,
    )


def chunk_tag(room: int, attempt: int, chunk: int, last: bool) -> bytes:
    """The notification tag of one chunk's push."""
    return f"sgl/{room}/{attempt}/{chunk}{'/last' if last else ''}".encode()


def parse_tag(tag: bytes) -> tuple[int, int, int, bool]:
    """(room, attempt, chunk, last) of a chunk's notification tag; MessageError otherwise."""
    m = _TAG_RE.fullmatch(tag)
    if m is None:
        raise MessageError(f"notification tag {tag[:64]!r} is not an SGLang chunk tag")
    room, attempt, chunk = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if room > _ROOM_MAX or attempt > _ATTEMPT_MAX or chunk >= MAX_CHUNKS:
        raise MessageError(f"notification tag {tag[:64]!r}: room, attempt or chunk out of "
                           "range")
    return room, attempt, chunk, m.group(4) is not None


def prefill_agent_name(ip: str, port: int) -> str:
    """The kvlink agent name of the prefill rank whose control endpoint is ``ip:port``: decode
    derives it from SGLang's bootstrap table and accepts a request's chunks only from it."""
    return f"sglang-p-{ip}-{port}"


def decode_agent_name(ip: str, port: int) -> str:
    return f"sglang-d-{ip}-{port}"
