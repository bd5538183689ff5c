"""The only module that touches the compiled C core.

One checked wrapper per C call (as pynacl's bindings): each takes and returns
Python values (or an opaque handle), fills the C structs itself and turns
every non-zero return code into the matching :class:`~kvlink.KvlinkError`;
nothing above it sees a raw code or a C struct.  cffi releases the GIL around
every call, so blocking waits do not stall other Python threads.

Blocking waits run in slices of at most ``SLICE_S``: a C wait cannot see
Ctrl-C or a concurrent ``close()``, so each slice returns to Python and the
wait starts again until it has an answer or its own time is up.
"""

from __future__ import annotations

import errno
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import numpy as np

from ._args import timeout_arg
from ._config import Config, Scheduler
from ._errors import ErrorCode, error_for
from ._types import (
    ChunkEvent,
    InboundInfo,
    InboundStats,
    MemoryType,
    Notification,
    Op,
    PathInfo,
    PathState,
    RemoteRegion,
    TransferInfo,
    TransferState,
)

try:
    from ._kvlink_c import ffi, lib
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        f"kvlink's C core does not load ({exc}): in a kvlink checkout run `make build`; an "
        "installed kvlink should be reinstalled (pip install --force-reinstall kvlink), from the "
        "sdist where no wheel fits this system"
    ) from exc

__all__ = ["ErrorCode", "check", "crc32c", "ffi", "lib", "make_plan"]

SLICE_S = 0.2  # blocking waits run in slices so Ctrl-C and close() get through
MAX_WAIT_MS = 2**31
MAX_TAG_BYTES = 4096  # kvl_notification.tag

# "within 199 ms" / "after 199 ms" in the C core's timeout messages
_SLICE_MS = re.compile(r"\b(within|after) \d+ ms\b")

# Handles the caller owns; ``Agent`` holds the agent pointer, these are freed
# by the garbage collector.
Handle = Any


# ---- errors ----------------------------------------------------------------


def last_error() -> str:
    """The C core's message for the last error in this thread."""
    return cstr(lib.kvl_last_error())


def check(
    rc: int,
    *,
    transfer: bool = False,
    peer: str | None = None,
    transfer_id: int | None = None,
    waited_s: float | None = None,
) -> None:
    """Raises the exception for ``rc`` unless it is KVL_OK.

    ``waited_s``: the caller's whole timeout, for a wait run in slices; a
    TIMEOUT message then names it instead of the last slice.

    Raises:
        KvlinkError: the subclass matching ``rc``, with the C core's message.
    """
    if rc != ErrorCode.OK:
        msg = last_error()
        if rc == ErrorCode.TIMEOUT and waited_s is not None:
            msg = _SLICE_MS.sub(lambda m: f"{m.group(1)} {waited_s:g} s", msg, count=1)
        raise error_for(rc, msg, transfer=transfer, peer=peer, transfer_id=transfer_id)


def cstr(data: Any) -> str:
    """A NUL-terminated char array from the C core as str."""
    return str(ffi.string(data).decode("utf-8", "replace"))


def _ms(timeout_s: float | None) -> int:
    """``timeout_s`` in whole milliseconds for the C core (None: the longest wait)."""
    if timeout_s is None:
        return MAX_WAIT_MS
    return min(int(timeout_s * 1000), MAX_WAIT_MS)


def _sliced(call: Callable[[int], int], timeout_s: float | None) -> int:
    """Calls ``call(slice_ms)`` until it answers something other than
    TIMEOUT or ``timeout_s`` has passed; returns its last return code.

    Raises:
        ArgumentTypeError, InvalidArgumentError: ``timeout_s`` is not a duration.
    """
    timeout_s = timeout_arg(timeout_s)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        step = SLICE_S if left is None else min(left, SLICE_S)
        rc = int(call(_ms(step)))
        if rc != ErrorCode.TIMEOUT or (left is not None and left <= step):
            return rc


# ---- agent -------------------------------------------------------------------


def agent_create(
    name: str, addrs: Sequence[str], cfg: Config, relay_addrs: Sequence[str] = ()
) -> Handle:
    """kvl_agent_create: an agent listening on ``addrs``, configured by ``cfg``;
    ``relay_addrs``: the addresses whose NICs it lends when ``cfg.relay`` (empty: ``addrs``).

    Raises:
        KvlinkError: listening failed (the message names the address).
    """
    keep = [ffi.new("char[]", a.encode()) for a in addrs]
    arr = ffi.new("const char *[]", keep)
    cname = ffi.new("char[]", name.encode())
    c = ffi.new("kvl_config *")
    c.name = cname
    c.addrs = arr
    c.n_addrs = len(addrs)
    c.port = cfg.port
    c.chunk_bytes = cfg.chunk_bytes
    c.min_chunk_bytes = cfg.min_chunk_bytes
    c.connect_timeout_ms = max(1, int(cfg.connect_timeout_s * 1000))
    c.monitor_interval_ms = cfg.monitor_interval_ms
    c.max_attempts = cfg.max_attempts
    c.stall_factor = cfg.stall_factor
    c.probe_backoff_max_ms = cfg.probe_backoff_max_ms
    c.hedge = int(cfg.hedge)
    c.round_robin = int(cfg.scheduler is Scheduler.ROUND_ROBIN)
    c.window_chunks = cfg.window_chunks
    c.window_bytes = cfg.window_bytes
    c.sock_buf_bytes = cfg.sock_buf_bytes
    c.close_linger_ms = int(cfg.close_linger_s * 1000)
    secret = cfg.resolved_secret()
    if secret is not None:
        keep.append(ffi.new("uint8_t[]", secret))
        c.secret = keep[-1]
        c.secret_len = len(secret)
    c.allow_unauthenticated = int(cfg.allow_unauthenticated)
    c.max_connections = cfg.max_connections
    c.idle_conn_timeout_ms = round(cfg.idle_conn_timeout_s * 1000)
    c.io_threads = cfg.resolved_io_threads(len(addrs))
    c.transport = _TRANSPORT_MODES[cfg.transport]
    c.fault_spec = cfg.fault_mover.encode()
    c.stage_host_memory = int(cfg.stage_host_memory)
    c.stage_chunk_bytes = cfg.gpu_chunk_bytes
    c.stage_pool_bytes = cfg.gpu_staging_bytes
    c.sealed_listen = int(cfg.accept_relayed)
    c.relay = int(cfg.relay)
    c.relay_port = cfg.relay_port
    c.relay_yield_mbps = cfg.relay_yield_mbps
    c.relay_max_conns = cfg.relay_max_conns
    relay_keep = [ffi.new("char[]", h.encode()) for h in relay_addrs]
    if relay_keep:
        keep.extend(relay_keep)
        keep.append(ffi.new("const char *[]", relay_keep))
        c.relay_addrs = keep[-1]
        c.n_relay_addrs = len(relay_keep)
    out = ffi.new("kvl_agent **")
    check(lib.kvl_agent_create(c, out))
    return out[0]


# Config.transport -> kvl_transport_mode (kvlink.h)
_TRANSPORT_MODES = {"auto": 0, "tcp": 1, "ucx": 2, "fault": 3}


def agent_close(a: Handle) -> None:
    """kvl_agent_close: stops the engine and frees the agent."""
    check(lib.kvl_agent_close(a))


def agent_addresses(a: Handle) -> list[tuple[str, int]]:
    """kvl_agent_n_addrs + kvl_agent_addr: every (host, port) listened on."""
    n = ffi.new("size_t *")
    check(lib.kvl_agent_n_addrs(a, n))
    host = ffi.new("char[48]")
    port = ffi.new("uint16_t *")
    out = []
    for i in range(n[0]):
        check(lib.kvl_agent_addr(a, i, host, port))
        out.append((cstr(host), int(port[0])))
    return out


def agent_instance(a: Handle) -> int:
    """kvl_agent_instance: this agent's random 64-bit instance id."""
    out = ffi.new("uint64_t *")
    check(lib.kvl_agent_instance(a, out))
    return int(out[0])


# ---- regions -----------------------------------------------------------------


def region_register(
    a: Handle,
    address: int,
    nbytes: int,
    *,
    remote_read: bool,
    remote_write: bool,
    readonly: bool,
    mem: MemoryType,
    name: str,
    device: int = -1,
) -> tuple[int, int]:
    """kvl_region_register_device; returns (the new region id, the CUDA
    device it is on, -1 for host memory).

    Raises:
        InvalidArgumentError: duplicate or over-long name, too many regions,
            CUDA memory that is not device memory of ``device``.
    """
    rights = (lib.KVL_REMOTE_READ if remote_read else 0) | (
        lib.KVL_REMOTE_WRITE if remote_write else 0
    )
    if readonly:
        rights |= lib.KVL_LOCAL_READONLY
    rid = ffi.new("uint64_t *")
    dev = ffi.new("int32_t *", device)
    check(
        lib.kvl_region_register_device(
            a, ffi.cast("void *", address), nbytes, rights, int(mem), dev, name.encode(), rid
        )
    )
    return int(rid[0]), int(dev[0])


def region_deregister(a: Handle, rid: int) -> None:
    """kvl_region_deregister.

    Raises:
        RegionBusyError: a transfer still uses it.
        UnknownRegionError: no such region.
    """
    check(lib.kvl_region_deregister(a, rid))


def region_key(a: Handle, rid: int) -> bytes:
    """kvl_region_key: the access key of an exposed region (16 bytes).

    Raises:
        RemoteAccessError: the region is not exposed to peers.
        UnknownRegionError: no such region.
    """
    key = ffi.new("uint8_t[16]")
    check(lib.kvl_region_key(a, rid, key))
    return bytes(ffi.buffer(key))


def buffer_address(obj: Any) -> tuple[int, Any]:
    """The address of a buffer-protocol object, and the cdata keeping the view alive."""
    cdata = ffi.from_buffer("char[]", obj, require_writable=False)
    return int(ffi.cast("uintptr_t", cdata)), cdata


# ---- peers -------------------------------------------------------------------


def _peer_flags(same_host: bool, defer_retire: bool) -> int:
    return (lib.KVL_PEER_SAME_HOST if same_host else 0) | (
        lib.KVL_PEER_DEFER_RETIRE if defer_retire else 0)


def peer_connect(
    a: Handle, name: str, instance: int, addrs: Sequence[tuple[str, int]], same_host: bool = False,
    defer_retire: bool = False,
) -> Handle:
    """kvl_peer_connect: the peer, connected (blocks up to connect_timeout per connection).
    ``same_host``: another process on this host that takes same-host copies
    (KVL_PEER_SAME_HOST: docs/ucx.md, "Same-host peers"); ``defer_retire``: a peer of that
    name it replaces waits for :func:`peer_retire_replaced` (KVL_PEER_DEFER_RETIRE).

    Raises:
        PeerUnreachableError, HandshakeError, DuplicateNameError: as the C core says.
    """
    hosts = [ffi.new("char[]", h.encode()) for h, _ in addrs]
    harr = ffi.new("const char *[]", hosts)
    parr = ffi.new("uint16_t[]", [p for _, p in addrs])
    out = ffi.new("kvl_peer **")
    flags = _peer_flags(same_host, defer_retire)
    check(
        lib.kvl_peer_connect(a, name.encode(), instance, harr, parr, len(addrs), flags, out),
        peer=name,
    )
    return out[0]


def peer_connect_routes(
    a: Handle,
    name: str,
    instance: int,
    hosts: Sequence[tuple[str, int]],
    routes: Sequence[tuple[int, int, str, int, str]],
    e2e: bytes | None,
    same_host: bool = False,
    defer_retire: bool = False,
) -> Handle:
    """kvl_peer_connect_routes: the peer, connected over the data paths ``routes`` spell
    out, each (local address index, index into ``hosts``, relay address or "", relay port,
    relay name); ``e2e``: the peer's end-to-end key (seals relayed paths).

    Raises:
        PeerUnreachableError, HandshakeError, DuplicateNameError: as the C core says.
    """
    keep = [ffi.new("char[]", h.encode()) for h, _ in hosts]
    harr = ffi.new("const char *[]", keep)
    parr = ffi.new("uint16_t[]", [p for _, p in hosts])
    rarr = ffi.new("kvl_route[]", len(routes))
    for r, (local, remote, via, via_port, via_name) in zip(rarr, routes, strict=True):
        r.local = local
        r.remote = remote
        r.via = via.encode()
        r.via_port = via_port
        r.via_name = via_name.encode()
    out = ffi.new("kvl_peer **")
    flags = _peer_flags(same_host, defer_retire)
    key = ffi.new("uint8_t[]", e2e) if e2e else ffi.NULL
    check(
        lib.kvl_peer_connect_routes(
            a, name.encode(), instance, harr, parr, len(hosts), flags, rarr, len(routes), key,
            len(e2e) if e2e else 0, out,
        ),
        peer=name,
    )
    return out[0]


def peer_retire_replaced(a: Handle) -> None:
    """kvl_peer_retire_replaced: the peers replaced under ``defer_retire`` are retired (no
    other call may hold one: the caller serialises)."""
    check(lib.kvl_peer_retire_replaced(a))


def relay_info(a: Handle) -> dict[str, Any]:
    """kvl_agent_relay_info: the end-to-end key, sealed and relay ports, relay counters."""
    info = ffi.new("kvl_relay_info *")
    check(lib.kvl_agent_relay_info(a, info))
    return {
        "e2e": bytes(ffi.buffer(info.e2e_key, 32)),
        "sealed_ports": [int(info.sealed_ports[i]) for i in range(info.n_sealed)],
        "relay_ports": [int(info.relay_ports[i]) for i in range(info.n_relay)],
        "relayed_conns": int(info.relayed_conns),
        "relayed_total": int(info.relayed_total),
        "relayed_bytes": int(info.relayed_bytes),
        "refused": int(info.relay_refused),
        "yields": int(info.relay_yields),
    }


def peer_set_key(p: Handle, name: str, rid: int, key: bytes) -> None:
    """kvl_peer_set_key: the access key of the peer's region ``rid``."""
    check(lib.kvl_peer_set_key(p, rid, key), peer=name)


def peer_remove(a: Handle, name: str) -> None:
    """kvl_peer_remove.

    Raises:
        UnknownPeerError: no peer of that name.
    """
    check(lib.kvl_peer_remove(a, name.encode()), peer=name)


def peer_find(a: Handle, name: str, *, missing_ok: bool = False) -> Handle | None:
    """kvl_peer_find: the peer named ``name`` (None if unknown and ``missing_ok``).

    Raises:
        UnknownPeerError: no peer of that name (unless ``missing_ok``).
    """
    out = ffi.new("kvl_peer **")
    rc = lib.kvl_peer_find(a, name.encode(), out)
    if rc == ErrorCode.UNKNOWN_PEER and missing_ok:
        return None
    check(rc, peer=name)
    return out[0]


def peer_regions(p: Handle, peer: str) -> list[RemoteRegion]:
    """kvl_peer_regions: the regions ``peer`` exposed at its last handshake or refresh."""
    n = ffi.new("size_t *")
    check(lib.kvl_peer_regions(p, ffi.NULL, 0, n))
    cap = int(n[0])
    arr = ffi.new("kvl_region_info[]", max(cap, 1))
    check(lib.kvl_peer_regions(p, arr, cap, n))
    return [
        RemoteRegion(
            peer=peer,
            id=int(r.id),
            nbytes=int(r.size),
            remote_read=bool(r.rights & lib.KVL_REMOTE_READ),
            remote_write=bool(r.rights & lib.KVL_REMOTE_WRITE),
            mem=MemoryType(r.mem),
            name=cstr(r.name),
        )
        for r in arr[0 : min(cap, int(n[0]))]
    ]


def peer_refresh(p: Handle, timeout_s: float) -> None:
    """kvl_peer_refresh: asks the peer for its region table now (blocks).

    Raises:
        PeerUnreachableError: no answer within ``timeout_s``.
    """
    check(lib.kvl_peer_refresh(p, max(1, int(timeout_s * 1000))))


def peer_send_prepare(p: Handle, peer: str, tag: bytes) -> None:
    """kvl_peer_send_prepare: queues a PREPARE notification carrying ``tag``."""
    check(lib.kvl_peer_send_prepare(p, tag, len(tag)), peer=peer)


# ---- transfers ---------------------------------------------------------------


def xfer_submit(
    a: Handle,
    p: Handle,
    peer: str,
    op: Op,
    segments: Any,
    notify: bytes,
    timeout_s: float,
) -> Handle:
    """kvl_xfer_submit: queues a transfer of a SEGMENT_DTYPE array; ``timeout_s``
    is its deadline (0: none).  The handle is released when collected.

    Raises:
        UnknownRegionError, OutOfBoundsError, RemoteAccessError,
        PeerUnreachableError, InvalidArgumentError: validation failed, nothing
            was sent.
    """
    out = ffi.new("kvl_xfer **")
    check(
        lib.kvl_xfer_submit(
            a,
            p,
            int(op),
            ffi.cast("const kvl_segment *", segments.ctypes.data),
            len(segments),
            notify,
            len(notify),
            max(1, math.ceil(timeout_s * 1000)) if timeout_s else 0,
            out,
        ),
        peer=peer,
    )
    return ffi.gc(out[0], lib.kvl_xfer_release)


def _chunk_event(ev: Any) -> ChunkEvent:
    return ChunkEvent(
        index=int(ev.chunk),
        path=int(ev.path),
        nbytes=int(ev.bytes),
        layers=range(int(ev.layer_first), int(ev.layer_first + ev.layer_count)),
        t_ns=int(ev.t_ns),
    )


def _wait(
    fn: Any, handle: Handle, *args: Any, timeout_s: float | None, peer: str, tid: int | None
) -> None:
    rc = _sliced(lambda step_ms: fn(handle, *args, step_ms), timeout_s)
    if rc == ErrorCode.INVALID_ARG:  # a layer the transfer lacks: the caller's mistake
        check(rc, peer=peer, transfer_id=tid)
    check(rc, transfer=True, peer=peer, transfer_id=tid, waited_s=timeout_s)


def _next_event(
    fn: Any, handle: Handle, timeout_s: float | None, peer: str, tid: int | None
) -> ChunkEvent | None:
    ev = ffi.new("kvl_chunk_event *")
    rc = _sliced(lambda step_ms: fn(handle, step_ms, ev), timeout_s)
    if rc == ErrorCode.END:
        return None
    check(rc, transfer=True, peer=peer, transfer_id=tid, waited_s=timeout_s)
    return _chunk_event(ev)


def xfer_wait(x: Handle, timeout_s: float | None, *, peer: str, transfer_id: int) -> None:
    """kvl_xfer_wait, in slices.

    Raises:
        TransferTimeoutError, TransferError: still running, or failed.
    """
    _wait(lib.kvl_xfer_wait, x, timeout_s=timeout_s, peer=peer, tid=transfer_id)


def xfer_wait_layer(
    x: Handle, layer: int, timeout_s: float | None, *, peer: str, transfer_id: int
) -> None:
    """kvl_xfer_wait_layer, in slices.

    Raises:
        InvalidArgumentError: the transfer carries no bytes of ``layer``.
        TransferTimeoutError, TransferError: as :func:`xfer_wait`.
    """
    _wait(lib.kvl_xfer_wait_layer, x, layer, timeout_s=timeout_s, peer=peer, tid=transfer_id)


def xfer_next_event(
    x: Handle, timeout_s: float | None, *, peer: str, transfer_id: int
) -> ChunkEvent | None:
    """kvl_xfer_next_event, in slices: the next verified chunk, None at the end.

    Raises:
        TransferTimeoutError: no chunk within ``timeout_s``.
        TransferError: the transfer failed.
    """
    return _next_event(lib.kvl_xfer_next_event, x, timeout_s, peer, transfer_id)


def xfer_cancel(x: Handle, why: str) -> None:
    """kvl_xfer_cancel: queued to the engine; a wait then ends once nothing reads or writes
    the transfer's memory."""
    check(lib.kvl_xfer_cancel(x, why.encode()[:150]))


def xfer_info(x: Handle) -> TransferInfo:
    """kvl_xfer_info_get: a snapshot of a transfer."""
    out = ffi.new("kvl_xfer_info *")
    check(lib.kvl_xfer_info_get(x, out))
    return TransferInfo(
        id=int(out.id),
        state=TransferState(out.state),
        bytes_total=int(out.bytes_total),
        bytes_done=int(out.bytes_done),
        chunks_total=int(out.chunks_total),
        chunks_done=int(out.chunks_done),
        layers=int(out.layers),
        retries=int(out.retries),
        t_submit_ns=int(out.t_submit_ns),
        t_first_byte_ns=int(out.t_first_byte_ns),
        t_first_layer_ns=int(out.t_first_layer_ns),
        t_done_ns=int(out.t_done_ns),
        error_code=ErrorCode(out.err) if out.state == TransferState.FAILED else ErrorCode.OK,
        message=cstr(out.message),
    )


# ---- inbound pushes ------------------------------------------------------------


def inbound_next(
    hold: Callable[[], AbstractContextManager[Handle]],
    tag: bytes | None,
    timeout_s: float | None,
) -> Handle:
    """kvl_inbound_next, in slices: the next push announced with ``tag`` (any
    push when None).  ``hold()`` lends the agent for one slice, so close()
    gets through between slices.

    Raises:
        TransferTimeoutError: none within ``timeout_s``.
        ClosedError: the agent was closed.
    """
    raw = tag or b""
    out = ffi.new("kvl_inxfer **")

    def take(step_ms: int) -> int:
        with hold() as a:
            return int(lib.kvl_inbound_next(a, raw, len(raw), tag is None, step_ms, out))

    check(_sliced(take, timeout_s), transfer=True, waited_s=timeout_s)
    return ffi.gc(out[0], lib.kvl_inxfer_release)


def inxfer_wait(
    t: Handle, timeout_s: float | None, *, peer: str, transfer_id: int | None = None
) -> None:
    """kvl_inxfer_wait, in slices.

    Raises:
        TransferTimeoutError, TransferError: still arriving, or failed.
    """
    _wait(lib.kvl_inxfer_wait, t, timeout_s=timeout_s, peer=peer, tid=transfer_id)


def inxfer_wait_layer(
    t: Handle,
    layer: int,
    timeout_s: float | None,
    *,
    peer: str,
    transfer_id: int | None = None,
) -> None:
    """kvl_inxfer_wait_layer, in slices.

    Raises:
        InvalidArgumentError: the push lacks ``layer``.
        TransferTimeoutError, TransferError: as :func:`inxfer_wait`.
    """
    _wait(lib.kvl_inxfer_wait_layer, t, layer, timeout_s=timeout_s, peer=peer, tid=transfer_id)


def inxfer_next_event(
    t: Handle, timeout_s: float | None, *, peer: str, transfer_id: int | None = None
) -> ChunkEvent | None:
    """kvl_inxfer_next_event, in slices: the next chunk verified here, None at the end.

    Raises:
        TransferTimeoutError, TransferError: as :func:`xfer_next_event`.
    """
    return _next_event(lib.kvl_inxfer_next_event, t, timeout_s, peer, transfer_id)


def inxfer_info(t: Handle) -> InboundInfo:
    """kvl_inxfer_info: a full snapshot of a push arriving here."""
    out = ffi.new("kvl_inbound_info *")
    check(lib.kvl_inxfer_info(t, out))
    return InboundInfo(
        transfer_id=int(out.xfer_id),
        peer=cstr(out.peer),
        state=TransferState(out.state),
        bytes_total=int(out.bytes_total),
        bytes_done=int(out.bytes_done),
        chunks_total=int(out.chunks_total),
        chunks_done=int(out.chunks_done),
        layers=int(out.layers),
        layers_ready=int(out.layers_ready),
        t_announce_ns=int(out.t_announce_ns),
        t_first_byte_ns=int(out.t_first_byte_ns),
        t_done_ns=int(out.t_done_ns),
        tag=bytes(ffi.buffer(out.tag, out.tag_len)),
        error_code=ErrorCode(out.err) if out.state == TransferState.FAILED else ErrorCode.OK,
        message=cstr(out.message),
    )


class Progress(NamedTuple):
    state: TransferState
    chunks_done: int
    layers_ready: int
    bytes_done: int


def inxfer_progress(t: Handle) -> Progress:
    """kvl_inxfer_progress: state and counters only (one lock, no copy of the tag)."""
    out = ffi.new("kvl_inbound_progress *")
    check(lib.kvl_inxfer_progress(t, out))
    return Progress(
        TransferState(out.state), int(out.chunks_done), int(out.layers_ready), int(out.bytes_done)
    )


def inxfer_layer_done(t: Handle, layer: int) -> bool:
    """kvl_inxfer_layer_done: whether every byte of ``layer`` is verified here."""
    out = ffi.new("int *")
    check(lib.kvl_inxfer_layer_done(t, layer, out))
    return bool(out[0])


# ---- logging and observation -----------------------------------------------------


class LogRecord(NamedTuple):
    level: int
    path: int  # -1: the control connection or none
    dropped: int  # records lost before this one
    peer: str
    msg: str


def new_log_record() -> Any:
    """A reusable out-parameter for :func:`next_log`."""
    return ffi.new("kvl_log_record *")


def next_log(a: Handle, timeout_ms: int, rec: Any) -> LogRecord | None:
    """kvl_next_log: the next engine log record, None when none came in time.

    Raises:
        ClosedError: :func:`log_wake` was called.
    """
    rc = lib.kvl_next_log(a, timeout_ms, rec)
    if rc == ErrorCode.TIMEOUT:
        return None
    check(rc)
    return LogRecord(int(rec.level), int(rec.path), int(rec.dropped), cstr(rec.peer), cstr(rec.msg))


def log_wake(a: Handle) -> None:
    """kvl_log_wake: makes every kvl_next_log return CLOSED from now on."""
    lib.kvl_log_wake(a)


def next_notification(a: Handle, timeout_s: float) -> Notification | None:
    """kvl_next_notification: the next inbound notification, None when none
    came within ``timeout_s`` (one slice at most: callers loop)."""
    n = ffi.new("kvl_notification *")
    rc = lib.kvl_next_notification(a, _ms(min(timeout_s, SLICE_S)), n)
    if rc == ErrorCode.TIMEOUT:
        return None
    check(rc)
    return Notification(
        peer=cstr(n.peer),
        tag=bytes(ffi.buffer(n.tag, n.tag_len)),
        transfer_id=int(n.xfer_id),
        op=Op(n.op),
    )


def paths_wait(
    hold: Callable[[], AbstractContextManager[Handle]], seen: int, timeout_s: float
) -> int | None:
    """kvl_paths_wait, in slices: the generation of what :func:`paths` reports
    once it differs from ``seen`` (0: the current one, at once), or None if no
    path changed state within ``timeout_s``.  ``hold()`` lends the agent for
    one slice, so close() and Ctrl-C get through between slices.

    Raises:
        ClosedError: the agent was closed.
    """
    gen = ffi.new("uint64_t *")

    def wait(step_ms: int) -> int:
        with hold() as a:
            return int(lib.kvl_paths_wait(a, seen, step_ms, gen))

    rc = _sliced(wait, timeout_s)
    if rc == ErrorCode.TIMEOUT:
        return None
    check(rc)
    return int(gen[0])


def inbound_stats(a: Handle) -> InboundStats:
    """kvl_inbound_stats_get: what peers' pushes and notifications hold here."""
    st = ffi.new("kvl_inbound_stats *")
    check(lib.kvl_inbound_stats_get(a, st))
    return InboundStats(
        senders=int(st.senders),
        pushes=int(st.pushes),
        tombstones=int(st.tombstones),
        chunks=int(st.chunks),
        layers=int(st.layers),
        tag_bytes=int(st.tag_bytes),
        notifications=int(st.notifications),
        notification_bytes=int(st.notification_bytes),
        queued_handles=int(st.queued_handles),
        refused_pushes=int(st.refused_pushes),
        evicted_pushes=int(st.evicted_pushes),
        refused_notifications=int(st.refused_notifications),
    )


def paths(a: Handle) -> list[PathInfo]:
    """kvl_paths: every path to every peer, with its live statistics."""
    n = ffi.new("size_t *")
    check(lib.kvl_paths(a, ffi.NULL, 0, n))
    cap = int(n[0]) + 16  # room for peers added meanwhile
    arr = ffi.new("kvl_path_info[]", cap)
    check(lib.kvl_paths(a, arr, cap, n))
    return [
        PathInfo(
            peer=cstr(p.peer),
            index=int(p.index),
            state=PathState(p.state),
            local=cstr(p.local_addr),
            remote=cstr(p.remote_addr),
            bytes_sent=int(p.bytes_sent),
            bytes_recv=int(p.bytes_recv),
            chunks_done=int(p.chunks_done),
            inflight_bytes=int(p.inflight_bytes),
            est_gbps=float(p.est_gbps),
            rtt_us=float(p.rtt_us),
            delivery_gbps=float(p.delivery_gbps),
            nic_other_gbps=float(p.nic_other_gbps),
            stall_ms=int(p.stall_ms),
            reconnects=int(p.reconnects),
            hedges=int(p.hedges),
            t_down_ns=int(p.t_down_ns),
            transport=cstr(p.transport) or "tcp",
            transport_note=cstr(p.transport_note),
            bytes_put=int(p.bytes_put),
            last_error=cstr(p.last_error),
            reconnect_fails=int(p.reconnect_fails),
            waiting=int(p.waiting),
            relay=cstr(p.relay),
            relay_addr=cstr(p.relay_addr),
        )
        for p in arr[0 : min(n[0], cap)]
    ]


# ---- transports ----------------------------------------------------------------


def cma_allowed(pid: int) -> bool:
    """kvl_cma_allowed: whether this process may copy from process ``pid``'s memory."""
    return bool(0 < pid < 2**31 and lib.kvl_cma_allowed(pid) == 0)


def cma_errno(pid: int) -> int:
    """kvl_cma_allowed: 0 when this process may copy from process ``pid``'s memory, else why
    not (an errno: EPERM for the OS's ptrace rules, ESRCH for no such process)."""
    return int(lib.kvl_cma_allowed(pid)) if 0 < pid < 2**31 else errno.ESRCH


def core_file() -> str:
    """Where the loaded C core lives (``.../kvlink/_kvlink_c.abi3.so``)."""
    from . import _kvlink_c

    return str(_kvlink_c.__file__)


def build_info() -> dict[str, Any]:
    """What this build of the C core compiled (kvlink/_ffi_build.py's record: version,
    compiler, UCX and io_uring in or out and why), {} for a core built without the record."""
    if not hasattr(lib, "kvl_py_build_info"):
        return {}
    return dict(json.loads(cstr(lib.kvl_py_build_info())))


def ucx_load(lib_path: str | None) -> tuple[bool, str]:
    """kvl_ucx_load_lib: (True, version) if UCX loads, else (False, why)."""
    rc = lib.kvl_ucx_load_lib(lib_path.encode() if lib_path else ffi.NULL)
    if rc != ErrorCode.OK:
        return False, last_error()
    return True, cstr(lib.kvl_ucx_loaded_version())


def cuda_load(libs: Sequence[str]) -> tuple[bool, str]:
    """kvl_cuda_load_lib: (True, "") once the CUDA runtime is loaded, else
    (False, why: what was tried and what to install)."""
    keep = [ffi.new("char[]", p.encode()) for p in libs]
    arr = ffi.new("const char *[]", keep) if keep else ffi.NULL
    rc = lib.kvl_cuda_load_lib(arr, len(keep))
    if rc != ErrorCode.OK:
        return False, last_error()
    return True, ""


def cuda_pci_bus_id(device: int) -> str:
    """kvl_cuda_pci_bus_id: the PCI bus id of CUDA device ``device``.

    Raises:
        KvlinkError: the runtime is not loaded, or the device does not exist.
    """
    out = ffi.new("char[64]")
    check(lib.kvl_cuda_pci_bus_id(device, out, 64))
    return cstr(out)


# ---- integrity -----------------------------------------------------------------


def crc32c(data: bytes, crc: int = 0) -> int:
    """kvl_crc32c: crc32c (Castagnoli) of ``data``, continuing from ``crc``."""
    return int(lib.kvl_crc32c(crc, ffi.from_buffer(data), len(data)))


# ---- the store's local moves (csrc/blockio.c) ------------------------------------


def blockio_open(depth: int, threads: int, force_threads: bool) -> tuple[Handle, str]:
    """kvl_blockio_open: (an I/O engine freed by the garbage collector, its backend)."""
    out = ffi.new("kvl_blockio **")
    check(lib.kvl_blockio_open(depth, threads, 1 if force_threads else 0, out))
    io = ffi.gc(out[0], lib.kvl_blockio_close)
    return io, cstr(lib.kvl_blockio_backend(io))


def blockio_close(io: Handle) -> None:
    """Frees ``io`` now (it must be idle); the handle must not be used again."""
    ffi.release(io)  # runs the destructor (kvl_blockio_close) now, once


def blockio_run(io: Handle, ops: Any) -> None:
    """kvl_blockio_run over ``ops``, a ``kvl_io[]`` from :func:`new_ios` (filled
    by the caller; each op's ``result`` is set).  Raises SystemError naming the first op
    that failed."""
    check(lib.kvl_blockio_run(io, ops, len(ops)))


def new_ios(rows: Sequence[tuple[int, bool, int, int, int]]) -> Any:
    """A ``kvl_io[]`` from (fd, write, buffer address, len, offset) rows."""
    ops = ffi.new("kvl_io[]", len(rows))
    for op, (fd, write, addr, n, off) in zip(ops, rows, strict=False):
        op.fd = fd
        op.write = 1 if write else 0
        op.buf = ffi.cast("void *", addr)
        op.len = n
        op.offset = off
    return ops


def copy_plan(dst: Any, src: Any, length: Any) -> Any:
    """A ``kvl_copy[]`` from three equal-length integer arrays (addresses and byte counts),
    for :func:`copy_run`.  The caller guarantees every range is valid."""
    n = len(dst)
    ops = ffi.new("kvl_copy[]", max(1, n))
    view = np.frombuffer(ffi.buffer(ops), dtype=np.uint64).reshape(-1, 3)[:n]
    view[:, 0] = dst
    view[:, 1] = src
    view[:, 2] = length
    return ops


def copy_run(plan: Any, start: int, count: int) -> None:
    """kvl_copy_batch over ``plan[start : start + count]``."""
    if count:
        lib.kvl_copy_batch(plan + start, count)


def block_index(blocks: Any) -> Any:
    """A ``uint32_t[]`` of the block each op of a :func:`copy_plan` belongs to."""
    arr = ffi.new("uint32_t[]", max(1, len(blocks)))
    np.frombuffer(ffi.buffer(arr), dtype=np.uint32)[: len(blocks)] = blocks
    return arr


def new_crcs(n: int) -> Any:
    """``n`` crc32c states, all 0."""
    return ffi.new("uint32_t[]", max(1, n))


def copy_crc_run(plan: Any, index: Any, start: int, count: int, crcs: Any, n_crcs: int) -> None:
    """kvl_copy_crc_batch over ``plan[start : start + count]`` (``index`` from
    :func:`block_index`, ``crcs`` from :func:`new_crcs`)."""
    if count:
        check(lib.kvl_copy_crc_batch(plan + start, index + start, count, crcs, n_crcs))


def copy_batch(dst: Any, src: Any, length: Any) -> None:
    """kvl_copy_batch: copies length[i] bytes from address src[i] to dst[i] (three
    equal-length integer arrays).  The caller guarantees every range is valid."""
    copy_run(copy_plan(dst, src, length), 0, len(dst))


def crc32c_spans(addresses: Sequence[int], lengths: Sequence[int], crc: int = 0) -> int:
    """kvl_crc32c_spans: crc32c over the memory spans in order (addresses are raw
    pointers the caller keeps valid)."""
    n = len(addresses)
    spans = ffi.new("kvl_span[]", n)
    for sp, a, ln in zip(spans, addresses, lengths, strict=False):
        sp.p = ffi.cast("void *", int(a))
        sp.len = int(ln)
    return int(lib.kvl_crc32c_spans(crc, spans, n))


def memory_at(address: int, nbytes: int) -> memoryview:
    """The ``nbytes`` at raw address ``address`` (memory the caller keeps alive)."""
    return memoryview(ffi.buffer(ffi.cast("char *", address), nbytes))


def crc32c_at(address: int, nbytes: int, crc: int = 0) -> int:
    """kvl_crc32c over raw memory the caller keeps valid."""
    return int(lib.kvl_crc32c(crc, ffi.cast("void *", address), nbytes))


# ---- planner -------------------------------------------------------------------


def make_plan(
    segments: Any, n_paths: int, chunk_bytes: int, min_chunk_bytes: int, max_pieces: int
) -> tuple[Any, Any, int, int]:
    """kvl_plan_make + kvl_plan_free: the C chunk planner on a SEGMENT_DTYPE
    array (for tests and tools).

    Returns (chunks, pieces, chunk_target, n_layers): ``chunks`` rows are
    (first_piece, n_pieces, layer_first, layer_last, bytes) and ``pieces`` rows
    are (segment index, offset in segment, length), as numpy int64 arrays.

    Raises:
        InvalidArgumentError: what kvl_plan_make rejects.
    """

    plan = ffi.new("kvl_plan *")
    check(
        lib.kvl_plan_make(
            ffi.cast("const kvl_segment *", segments.ctypes.data),
            len(segments),
            n_paths,
            chunk_bytes,
            min_chunk_bytes,
            max_pieces,
            plan,
        )
    )
    try:
        chunks = np.array(
            [
                (c.first_piece, c.n_pieces, c.layer_first, c.layer_last, c.bytes)
                for c in plan.chunks[0 : plan.n_chunks]
            ],
            dtype=np.int64,
        ).reshape(-1, 5)
        raw = np.frombuffer(ffi.buffer(plan.pieces, plan.n_pieces * 24), dtype="<u8")
        pieces = raw.reshape(-1, 3).astype(np.int64)
        return chunks, pieces, int(plan.chunk_target), int(plan.n_layers)
    finally:
        lib.kvl_plan_free(plan)


# ---- benchmarks ----------------------------------------------------------------


def bench_tcp_move(
    fds: Sequence[int], buf: Any, send: bool, timeout_s: float
) -> tuple[float, float]:
    """kvl_bench_tcp_move: the plain-TCP baseline of ``kvlink-bench tcp-limit`` moves the
    writable buffer ``buf`` over the connected blocking sockets ``fds``, one slice and one
    thread each; returns (wall seconds, CPU seconds of those threads).

    Raises:
        KvlinkError: a socket failed or moved nothing for ``timeout_s`` (the message says
            which), or the peer closed early.
    """
    arr = ffi.new("int[]", list(fds))
    cbuf = ffi.from_buffer(buf, require_writable=not send)
    out = ffi.new("kvl_bench_tcp_result *")
    check(lib.kvl_bench_tcp_move(arr, len(fds), cbuf, len(cbuf), int(send), _ms(timeout_s), out))
    return out.wall_ns / 1e9, out.cpu_ns / 1e9
