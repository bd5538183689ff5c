"""The object API: Agent, Region, Transfer and what they report."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _nics
from ._config import Config
from ._errors import (
    ClosedError,
    DuplicateNameError,
    ErrorCode,
    InvalidArgumentError,
    KvlinkError,
    NotRegisteredError,
    OutOfBoundsError,
    PeerUnreachableError,
    RegistrationError,
    SizeMismatchError,
    UnknownRegionError,
    error_for,
)
from ._logdrain import LogDrain
from ._memory import MemoryType, as_span
from ._native import check, cstr, ffi, lib
from ._segments import SEGMENT_DTYPE, as_segment_array
from ._wait import SLICE_S, ms, sliced

if TYPE_CHECKING:
    from ._inbound import InboundTransfer

log = logging.getLogger("kvlink")

METADATA_VERSION = 1


class Op(IntEnum):
    """Direction of a transfer, from the initiator's point of view; PREPARE
    marks a pre-warm request (see :meth:`Agent.prepare`)."""

    PUSH = 1
    PULL = 2
    PREPARE = 3


class TransferState(IntEnum):
    RUNNING = 0
    DONE = 1
    FAILED = 2


class PathState(IntEnum):
    UP = 0
    DEGRADED = 1
    DOWN = 2
    PROBING = 3
    STALLED = 4


@dataclass(frozen=True)
class Region:
    """Memory registered with an agent.

    ``id`` is what peers use to address it (with ``name``, if given).
    """

    id: int
    address: int
    nbytes: int
    remote_read: bool
    remote_write: bool
    readonly: bool
    mem: MemoryType
    name: str
    _keepalive: Any = None

    def __repr__(self) -> str:
        rights = "r" if self.remote_read else "-"
        rights += "w" if self.remote_write else "-"
        return f"Region(id={self.id}, name={self.name!r}, nbytes={self.nbytes}, rights={rights})"


@dataclass(frozen=True)
class RemoteRegion:
    """A region a peer exposes (from its handshake)."""

    peer: str
    id: int
    nbytes: int
    remote_read: bool
    remote_write: bool
    mem: MemoryType
    name: str


@dataclass(frozen=True)
class ChunkEvent:
    """A verified chunk, in completion order.

    ``layers`` is the range of layers this chunk completed (possibly empty).
    """

    index: int
    path: int
    nbytes: int
    layers: range
    t_ns: int

    @staticmethod
    def from_c(ev: Any) -> ChunkEvent:
        return ChunkEvent(
            index=int(ev.chunk),
            path=int(ev.path),
            nbytes=int(ev.bytes),
            layers=range(int(ev.layer_first), int(ev.layer_first + ev.layer_count)),
            t_ns=int(ev.t_ns),
        )


@dataclass(frozen=True)
class TransferInfo:
    id: int
    state: TransferState
    bytes_total: int
    bytes_done: int
    chunks_total: int
    chunks_done: int
    layers: int
    retries: int
    t_submit_ns: int
    t_first_byte_ns: int
    t_done_ns: int
    error_code: ErrorCode
    message: str


@dataclass(frozen=True)
class Notification:
    """A peer finished a transfer with us and attached ``tag`` (op PUSH or
    PULL), or announced one with :meth:`Agent.prepare` (op PREPARE)."""

    peer: str
    tag: bytes
    transfer_id: int
    op: Op

    def prepare_request(self) -> dict[str, Any]:
        """For op PREPARE: what the peer announced ({"nbytes": ..., "layout": ...}).

        Raises:
            InvalidArgumentError: this is not a PREPARE notification.
        """
        if self.op != Op.PREPARE:
            raise InvalidArgumentError(f"notification: op is {self.op.name}, not PREPARE")
        data = json.loads(self.tag)
        return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class PathInfo:
    """Live statistics of one path (refreshed every monitor interval)."""

    peer: str
    index: int
    state: PathState
    local: str
    remote: str
    bytes_sent: int
    bytes_recv: int
    chunks_done: int
    inflight_bytes: int
    est_gbps: float  # GB/s (1e9 bytes/s): EWMA of the busy-period delivery rate
    rtt_us: float  # TCP_INFO while busy, PING probes while idle
    delivery_gbps: float  # the kernel's latest delivery-rate sample, GB/s
    nic_other_gbps: float  # traffic on the local NIC that is not ours, GB/s
    stall_ms: int  # time without progress while busy
    reconnects: int  # times re-established after going down
    hedges: int  # straggler copies sent on this path
    t_down_ns: int  # CLOCK_MONOTONIC time it last left service, STALLED or DOWN (0: never)
    last_error: str


class Transfer:
    """Handle of a push or pull.  Thread-safe; waits release the GIL."""

    def __init__(self, cdata: Any, op: Op, peer: str, nbytes: int) -> None:
        self._x = ffi.gc(cdata, lib.kvl_xfer_release)
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.id = self.info().id

    def __repr__(self) -> str:
        i = self.info()
        return (
            f"Transfer(id={self.id}, op={self.op.name}, peer={self.peer!r}, "
            f"state={i.state.name}, {i.bytes_done}/{i.bytes_total} bytes)"
        )

    def info(self) -> TransferInfo:
        """A snapshot of progress, timestamps and error."""
        out = ffi.new("kvl_xfer_info *")
        check(lib.kvl_xfer_info_get(self._x, out))
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
            t_done_ns=int(out.t_done_ns),
            error_code=ErrorCode(out.err) if out.state == TransferState.FAILED else ErrorCode.OK,
            message=cstr(out.message),
        )

    @property
    def state(self) -> TransferState:
        return self.info().state

    @property
    def done(self) -> bool:
        """True once the transfer has finished, successfully or not."""
        return self.state != TransferState.RUNNING

    @property
    def ok(self) -> bool:
        """True once every byte has been verified at the destination."""
        return self.state == TransferState.DONE

    @property
    def bytes_done(self) -> int:
        return self.info().bytes_done

    @property
    def error(self) -> KvlinkError | None:
        """The transfer's error once it failed, else None."""
        i = self.info()
        if i.state != TransferState.FAILED:
            return None
        return error_for(
            i.error_code, i.message, transfer=True, peer=self.peer, transfer_id=self.id
        )

    def _wait(self, fn: Any, *args: Any, timeout_s: float | None) -> None:
        rc = sliced(lambda step_ms: int(fn(self._x, *args, step_ms)), timeout_s)
        check(rc, transfer=True, peer=self.peer, transfer_id=self.id, waited_s=timeout_s)

    def wait(self, timeout_s: float | None = None) -> Transfer:
        """Blocks until every byte is verified at the destination.

        Raises:
            TransferTimeoutError: still running after ``timeout_s`` (it goes
                on), or the transfer's own deadline passed (it failed).
            TransferError: the transfer failed; the subclass says why.
        """
        self._wait(lib.kvl_xfer_wait, timeout_s=timeout_s)
        return self

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Blocks until every chunk carrying bytes of ``layer`` is verified.

        Raises:
            InvalidArgumentError: the transfer carries no bytes of ``layer``.
            TransferTimeoutError, TransferError: as :meth:`wait`.
        """
        if not isinstance(layer, int) or layer < 0:
            raise InvalidArgumentError(f"layer: expected a non-negative int, got {layer!r}")
        try:
            self._wait(lib.kvl_xfer_wait_layer, layer, timeout_s=timeout_s)
        except KvlinkError as exc:
            if exc.code == ErrorCode.INVALID_ARG:
                raise InvalidArgumentError(str(exc), transfer_id=self.id) from None
            raise

    def chunks(self, timeout_s: float | None = None) -> Iterator[ChunkEvent]:
        """Yields chunks as they are verified, in completion order, until the
        transfer is done.

        Raises:
            TransferTimeoutError: no chunk finished within ``timeout_s``.
            TransferError: the transfer failed.
        """
        ev = ffi.new("kvl_chunk_event *")
        while True:
            rc = sliced(lambda step_ms: int(lib.kvl_xfer_next_event(self._x, step_ms, ev)),
                        timeout_s)
            if rc == ErrorCode.END:
                return
            check(rc, transfer=True, peer=self.peer, transfer_id=self.id, waited_s=timeout_s)
            yield ChunkEvent.from_c(ev)


_live_names: weakref.WeakValueDictionary[str, Agent] = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


class Agent:
    """One kvlink endpoint: registrations, peers, paths, the engine thread.

    Example::

        with kvlink.Agent("decode-0", kvlink.Config(nics="loopback:4")) as agent:
            region = agent.register(kv, remote_write=True, name="kv")
            send_to_prefill(agent.metadata())

    Raises:
        ConfigError: invalid configuration or NIC selection.
        DuplicateNameError: another live agent in this process has ``name``.
        KvlinkError: listening failed (the message names the address).
    """

    def __init__(self, name: str, config: Config | None = None, **overrides: Any) -> None:
        if not isinstance(name, str) or not 0 < len(name.encode()) < 64:
            raise InvalidArgumentError(f"name: expected 1..63 bytes of text, got {name!r}")
        cfg = config if config is not None else Config.load()
        if overrides:
            cfg = cfg.replace(**overrides)
        self.name = name
        self.config = cfg
        self._lock = threading.Lock()
        self._closed = False
        self._users = 0
        self._idle = threading.Condition(self._lock)
        self._regions: dict[int, Region] = {}
        addrs = _nics.resolve(cfg.nics)
        with _live_lock:
            if name in _live_names:
                raise DuplicateNameError(
                    f"name: an agent named {name!r} is already open in this process; "
                    "close it first or choose another name"
                )
            keep = [ffi.new("char[]", a.encode()) for a in addrs]
            arr = ffi.new("const char *[]", keep)
            c = ffi.new("kvl_config *")
            cname = ffi.new("char[]", name.encode())
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
            c.round_robin = int(cfg.scheduler == "round_robin")
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
            out = ffi.new("kvl_agent **")
            check(lib.kvl_agent_create(c, out))
            self._a = out[0]
            self._drain = LogDrain(self._a, name)
            _live_names[name] = self
        inst = ffi.new("uint64_t *")
        check(lib.kvl_agent_instance(self._a, inst))
        self.instance_id = int(inst[0])
        self.addresses = self._addresses()
        log.info("agent %s listening on %s", name, self.addresses)

    # ---- lifecycle -------------------------------------------------------

    def _enter(self) -> Any:
        with self._lock:
            if self._closed:
                raise ClosedError(f"agent {self.name!r} is closed; create a new Agent")
            self._users += 1
        return self._a

    def _exit(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._idle.notify_all()

    def close(self) -> None:
        """Stops the engine and frees everything.  Running transfers fail with
        TransferAbortedError.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._users:
                self._idle.wait()
        self._drain.close_agent()  # stops the log thread, then closes the native agent
        self._a = ffi.NULL
        self._regions.clear()
        with _live_lock:
            if _live_names.get(self.name) is self:
                del _live_names[self.name]

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise from a finaliser
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.addresses)} NICs"
        return f"Agent({self.name!r}, {state})"

    def _addresses(self) -> list[tuple[str, int]]:
        n = ffi.new("size_t *")
        check(lib.kvl_agent_n_addrs(self._a, n))
        host = ffi.new("char[48]")
        port = ffi.new("uint16_t *")
        out = []
        for i in range(n[0]):
            check(lib.kvl_agent_addr(self._a, i, host, port))
            out.append((cstr(host), int(port[0])))
        return out

    # ---- memory ----------------------------------------------------------

    def register(
        self,
        memory: Any,
        *,
        remote_read: bool = False,
        remote_write: bool = False,
        name: str | None = None,
    ) -> Region:
        """Registers host memory so transfers can read or write it.

        ``memory``: a C-contiguous numpy array, torch CPU tensor, DLPack CPU
        tensor or buffer-protocol object; it is kept alive until deregistered.
        ``remote_read`` lets peers pull from it, ``remote_write`` lets peers
        push into it.  ``name`` lets peers find it by name.

        Raises:
            RegistrationError: non-contiguous, empty, read-only with
                ``remote_write``, GPU memory, or not memory at all.
            InvalidArgumentError: duplicate or over-long ``name``.
            ClosedError: the agent is closed.
        """
        span = as_span(memory, "memory")
        if span.readonly and remote_write:
            raise RegistrationError(
                "memory: the buffer is read-only, so remote_write=True cannot be honoured; "
                "register a writable buffer"
            )
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentError(f"name: expected str, got {type(name).__name__}")
        rights = (lib.KVL_REMOTE_READ if remote_read else 0) | (
            lib.KVL_REMOTE_WRITE if remote_write else 0
        )
        if span.readonly:
            rights |= 0x100  # KVL_LOCAL_READONLY: never pull into it
        a = self._enter()
        try:
            rid = ffi.new("uint64_t *")
            check(
                lib.kvl_region_register(
                    a,
                    ffi.cast("void *", span.address),
                    span.nbytes,
                    rights,
                    int(span.mem),
                    (name or "").encode(),
                    rid,
                )
            )
        finally:
            self._exit()
        region = Region(
            id=int(rid[0]),
            address=span.address,
            nbytes=span.nbytes,
            remote_read=remote_read,
            remote_write=remote_write,
            readonly=span.readonly,
            mem=span.mem,
            name=name or "",
            _keepalive=span.keepalive,
        )
        self._regions[region.id] = region
        return region

    def deregister(self, region: Region | int) -> None:
        """Removes a registration.

        Raises:
            RegionBusyError: a transfer still uses it (nothing changed).
            UnknownRegionError: it is not registered here.
        """
        rid = region.id if isinstance(region, Region) else int(region)
        a = self._enter()
        try:
            check(lib.kvl_region_deregister(a, rid))
        finally:
            self._exit()
        self._regions.pop(rid, None)

    def regions(self) -> list[Region]:
        """This agent's registered regions."""
        return list(self._regions.values())

    def _locate(self, obj: Any, arg: str) -> tuple[int, int, int]:
        """(region id, offset, nbytes) of a local buffer or Region."""
        if isinstance(obj, Region):
            if self._regions.get(obj.id) is not obj:
                raise NotRegisteredError(
                    f"{arg}: region {obj.id} is not registered with agent {self.name!r}"
                )
            return obj.id, 0, obj.nbytes
        span = as_span(obj, arg)
        for r in self._regions.values():
            if r.address <= span.address and span.address + span.nbytes <= r.address + r.nbytes:
                return r.id, span.address - r.address, span.nbytes
        raise NotRegisteredError(
            f"{arg}: this buffer ({span.nbytes} bytes at {span.address:#x}) is not inside any "
            f"region registered with agent {self.name!r}; call agent.register() on it first"
        )

    # ---- peers -----------------------------------------------------------

    def metadata(self) -> bytes:
        """What a peer needs to connect to this agent (pass to its ``add_peer``)."""
        self._enter()
        self._exit()
        return json.dumps(
            {
                "kvlink": METADATA_VERSION,
                "name": self.name,
                "instance": f"{self.instance_id:016x}",
                "addrs": [[h, p] for h, p in self.addresses],
            }
        ).encode()

    def add_peer(self, metadata: bytes | str | dict[str, Any]) -> str:
        """Connects to a peer: a control connection plus one data connection per
        path, each with a versioned handshake.  Returns the peer's name.
        Adding the same peer again is a no-op.

        Raises:
            InvalidArgumentError: the metadata is malformed.
            DuplicateNameError: the peer has this agent's name, or another live
                agent already uses the peer's name.
            PeerUnreachableError: no path could connect.
            HandshakeError: the peer is not the agent the metadata names, or
                speaks another protocol version.
        """
        if self._closed:
            raise ClosedError(f"agent {self.name!r} is closed; create a new Agent")
        md = _parse_metadata(metadata)
        hosts = [ffi.new("char[]", h.encode()) for h, _ in md["addrs"]]
        harr = ffi.new("const char *[]", hosts)
        parr = ffi.new("uint16_t[]", [p for _, p in md["addrs"]])
        out = ffi.new("kvl_peer **")

        def connect(a: Any) -> None:
            rc = lib.kvl_peer_connect(
                a, md["name"].encode(), md["instance"], harr, parr, len(md["addrs"]), out
            )
            check(rc, peer=md["name"])

        a = self._enter()
        try:
            known = lib.kvl_peer_find(a, md["name"].encode(), out) == ErrorCode.OK
            if not known:
                connect(a)
        finally:
            self._exit()
        if known:
            # a restarted agent of that name replaces the old peer, which is
            # then freed: no other call may hold the old one meanwhile
            with self._lock:
                if self._closed:
                    raise ClosedError(f"agent {self.name!r} is closed; create a new Agent")
                while self._users:
                    self._idle.wait()
                connect(self._a)
        return str(md["name"])

    def remove_peer(self, peer: str) -> None:
        """Forgets ``peer``: its running transfers fail with
        ConnectionLostError ("removed"), frames already queued are sent (up
        to ``close_linger_s``), its connections close and its memory is freed.
        Add it again (new metadata) to talk to it later.  Waits for calls in
        progress on this agent to finish first, so none uses the peer as it
        goes.

        Raises:
            UnknownPeerError: no peer of that name.
            InvalidArgumentError: ``peer`` is not a name.
            ClosedError: the agent is closed.
        """
        if not isinstance(peer, str):
            raise InvalidArgumentError(f"peer: expected the peer's name, got {peer!r}")
        with self._lock:
            if self._closed:
                raise ClosedError(f"agent {self.name!r} is closed; create a new Agent")
            while self._users:  # nobody may hold the peer's native pointer meanwhile
                self._idle.wait()
            check(lib.kvl_peer_remove(self._a, peer.encode()), peer=peer)

    def _peer(self, a: Any, peer: str) -> Any:
        if not isinstance(peer, str):
            raise InvalidArgumentError(f"peer: expected the peer's name, got {peer!r}")
        return _find(a, peer)

    def remote_regions(self, peer: str, *, refresh: bool = False) -> list[RemoteRegion]:
        """Regions ``peer`` exposes, as of the handshake (``refresh`` asks again).

        Raises:
            UnknownPeerError: ``peer`` was not added.
        """
        a = self._enter()
        try:
            p = self._peer(a, peer)
            if refresh:
                check(lib.kvl_peer_refresh(p, max(1, int(self.config.connect_timeout_s * 1000))))
            return _remote_regions(p, peer)
        finally:
            self._exit()

    def prepare(
        self,
        peer: str,
        *,
        nbytes: int | None = None,
        layout: Any = None,
        timeout_s: float = 5.0,
    ) -> list[PathInfo]:
        """Pre-warm: readies ``peer`` for a transfer while its data is still being
        computed (call it when prefill starts).  Waits until every path to the
        peer is up (down paths are re-probed), refreshes the peer's region
        table, probes every path, and delivers a PREPARE notification with
        ``nbytes`` and ``layout`` (a :class:`kvlink.kv.PagedLayout` or a dict)
        so the peer can allocate and register the destination now.  Returns
        the peer's paths.

        Raises:
            UnknownPeerError: ``peer`` was not added.
            PeerUnreachableError: no path came up within ``timeout_s``.
        """
        if nbytes is not None and (not isinstance(nbytes, int) or nbytes < 0):
            raise InvalidArgumentError(f"nbytes: expected a non-negative int, got {nbytes!r}")
        lay = layout.to_dict() if hasattr(layout, "to_dict") else layout
        tag = json.dumps({"nbytes": nbytes, "layout": lay}).encode()
        deadline = time.monotonic() + timeout_s
        while True:
            mine = [p for p in self.paths() if p.peer == peer]
            if not mine:
                a = self._enter()
                try:
                    _find(a, peer)  # raises UnknownPeerError
                finally:
                    self._exit()
            if mine and all(p.state in (PathState.UP, PathState.DEGRADED) for p in mine):
                break
            if time.monotonic() >= deadline:
                if any(p.state in (PathState.UP, PathState.DEGRADED) for p in mine):
                    break  # go with the paths that are up
                raise PeerUnreachableError(
                    f"prepare: no path to peer {peer!r} came up within {timeout_s} s: "
                    + "; ".join(
                        f"path {p.index} {p.local}->{p.remote}: {p.last_error}" for p in mine
                    ),
                    peer=peer,
                )
            time.sleep(0.02)
        a = self._enter()
        try:
            p = _find(a, peer)
            check(lib.kvl_peer_refresh(p, max(1, int(self.config.connect_timeout_s * 1000))))
            check(lib.kvl_peer_send_prepare(p, tag, len(tag)), peer=peer)
        finally:
            self._exit()
        return [p for p in self.paths() if p.peer == peer]

    # ---- transfers -------------------------------------------------------

    def push(
        self,
        peer: str,
        src: Any = None,
        dst: Any = None,
        *,
        nbytes: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        segments: Any = None,
        notify: bytes | None = None,
        timeout_s: float | None = None,
    ) -> Transfer:
        """Writes local memory into a peer's region.

        Either ``src`` (a registered buffer or Region) and ``dst`` (the
        peer's region: RemoteRegion, id or name) with optional offsets and
        ``nbytes``, or ``segments`` (see :mod:`kvlink.kv`).  ``notify`` is
        delivered to the peer once every byte is verified there.

        Raises:
            NotRegisteredError: ``src`` is not registered memory.
            SizeMismatchError: ``src`` and ``dst`` differ in size and no
                ``nbytes`` says how much to move.
            UnknownRegionError, OutOfBoundsError, RemoteAccessError: a segment
                does not fit or lacks ``remote_write`` (nothing is sent).
            UnknownPeerError: ``peer`` was not added.
            PeerUnreachableError: every path to ``peer`` is down.
        """
        return self._submit(
            Op.PUSH, peer, src, dst, nbytes, src_offset, dst_offset, segments, notify, timeout_s
        )

    def pull(
        self,
        peer: str,
        src: Any = None,
        dst: Any = None,
        *,
        nbytes: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        segments: Any = None,
        notify: bytes | None = None,
        timeout_s: float | None = None,
    ) -> Transfer:
        """Reads a peer's region (``src``) into local memory (``dst``).

        The mirror of :meth:`push`: the peer's region needs ``remote_read``.

        Raises:
            As :meth:`push`, with the roles of ``src`` and ``dst`` swapped.
        """
        return self._submit(
            Op.PULL, peer, src, dst, nbytes, src_offset, dst_offset, segments, notify, timeout_s
        )

    def _submit(
        self,
        op: Op,
        peer: str,
        src: Any,
        dst: Any,
        nbytes: int | None,
        src_offset: int,
        dst_offset: int,
        segments: Any,
        notify: bytes | None,
        timeout_s: float | None,
    ) -> Transfer:
        if notify is not None and not isinstance(notify, (bytes, bytearray)):
            raise InvalidArgumentError(f"notify: expected bytes, got {type(notify).__name__}")
        tag = bytes(notify or b"")
        timeout = self.config.transfer_timeout_s if timeout_s is None else timeout_s
        a = self._enter()
        try:
            p = self._peer(a, peer)
            if segments is not None:
                if src is not None or dst is not None or nbytes is not None:
                    raise InvalidArgumentError(
                        "segments: pass either segments or src/dst/nbytes, not both"
                    )
                segs = as_segment_array(segments)
            else:
                segs = self._simple_segment(op, p, peer, src, dst, nbytes, src_offset, dst_offset)
            out = ffi.new("kvl_xfer **")
            check(
                lib.kvl_xfer_submit(
                    a,
                    p,
                    int(op),
                    ffi.cast("const kvl_segment *", segs.ctypes.data),
                    len(segs),
                    tag,
                    len(tag),
                    max(1, math.ceil(timeout * 1000)) if timeout else 0,
                    out,
                ),
                peer=peer,
            )
            return Transfer(out[0], op, peer, int(segs["len"].sum()))
        finally:
            self._exit()

    def _simple_segment(
        self,
        op: Op,
        p: Any,
        peer: str,
        src: Any,
        dst: Any,
        nbytes: int | None,
        src_offset: int,
        dst_offset: int,
    ) -> np.ndarray[Any, Any]:
        if src is None or dst is None:
            raise InvalidArgumentError("src and dst are required unless segments= is given")
        for arg, v in (("src_offset", src_offset), ("dst_offset", dst_offset)):
            if not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(f"{arg}: expected a non-negative int, got {v!r}")
        if nbytes is not None and (not isinstance(nbytes, int) or nbytes <= 0):
            raise InvalidArgumentError(f"nbytes: expected a positive int, got {nbytes!r}")
        local_arg, remote_arg = ("src", "dst") if op == Op.PUSH else ("dst", "src")
        local_obj, remote_obj = (src, dst) if op == Op.PUSH else (dst, src)
        local_off, remote_off = (
            (src_offset, dst_offset) if op == Op.PUSH else (dst_offset, src_offset)
        )
        lid, lbase, lsize = self._locate(local_obj, local_arg)
        remote = self._resolve_remote(p, peer, remote_obj, remote_arg)
        local_avail = lsize - local_off
        remote_avail = remote.nbytes - remote_off
        if local_avail <= 0:
            raise OutOfBoundsError(
                f"{local_arg}_offset: {local_off} is past the end ({lsize} bytes)"
            )
        if remote_avail <= 0:
            raise OutOfBoundsError(
                f"{remote_arg}_offset: {remote_off} is past the end of peer {peer!r} region "
                f"{remote.id} ({remote.nbytes} bytes)"
            )
        # The local buffer says how much to move unless nbytes does.
        want = local_avail if nbytes is None else nbytes
        if want > local_avail:
            raise SizeMismatchError(
                f"nbytes: {want} exceeds the {local_avail} bytes {local_arg} has"
            )
        if want > remote_avail:
            raise SizeMismatchError(
                f"size mismatch: moving {want} bytes but {remote_arg} (peer {peer!r} region "
                f"{remote.id}, {remote.nbytes} bytes) has only {remote_avail} from offset "
                f"{remote_off}; pass nbytes= to move a prefix"
            )
        nbytes = want
        seg = np.zeros(1, dtype=SEGMENT_DTYPE)
        if op == Op.PUSH:
            seg[0] = (lid, lbase + local_off, remote.id, remote_off, nbytes, 0, 0)
        else:
            seg[0] = (remote.id, remote_off, lid, lbase + local_off, nbytes, 0, 0)
        return seg

    def _resolve_remote(self, p: Any, peer: str, ref: Any, arg: str) -> RemoteRegion:
        if isinstance(ref, RemoteRegion):
            if ref.peer != peer:
                raise InvalidArgumentError(
                    f"{arg}: region belongs to peer {ref.peer!r}, not {peer!r}"
                )
            key: int | str = ref.id
        elif isinstance(ref, (int, str)) and not isinstance(ref, bool):
            key = ref
        else:
            raise InvalidArgumentError(
                f"{arg}: expected the peer's RemoteRegion, region id or region name, got "
                f"{type(ref).__name__} (local buffers go on the other side)"
            )
        for refresh in (False, True):
            if refresh:
                check(lib.kvl_peer_refresh(p, max(1, int(self.config.connect_timeout_s * 1000))))
            for r in _remote_regions(p, peer):
                if r.id == key or (r.name and r.name == key):
                    return r
        raise UnknownRegionError(f"{arg}: peer {peer!r} has no region {key!r}", peer=peer)

    # ---- observation -----------------------------------------------------

    def inbound(self, tag: bytes | None = None, timeout_s: float | None = None) -> InboundTransfer:
        """The receiver's handle of a push arriving at this agent: the one
        whose notify tag is ``tag``, or the next one when ``tag`` is None (in
        the order they were announced).

        A push announces itself before its first chunk, so the handle is
        available from its first frame on: ``wait_layer(0)`` returns as soon
        as layer 0 is verified here while the rest is still in flight.  Each
        push is handed out once.  Handles nobody takes are kept (up to 1024,
        a finished one for 60 s).  The push's notification still arrives
        through :meth:`notifications`, once.

        Raises:
            InvalidArgumentError: ``tag`` is not bytes of at most 4096 bytes,
                or ``timeout_s`` is negative.
            TransferTimeoutError: no such push was announced within ``timeout_s``.
            ClosedError: the agent is (or was, meanwhile) closed.
        """
        from ._inbound import InboundTransfer  # _inbound builds on this module

        if tag is not None and not isinstance(tag, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"tag: expected bytes or None, got {type(tag).__name__}")
        raw = bytes(tag) if tag is not None else b""
        if len(raw) > 4096:
            raise InvalidArgumentError(f"tag: {len(raw)} bytes; notify tags are at most 4096")
        out = ffi.new("kvl_inxfer **")

        def take(step_ms: int) -> int:
            a = self._enter()
            try:
                return int(lib.kvl_inbound_next(a, raw, len(raw), tag is None, step_ms, out))
            finally:
                self._exit()

        check(sliced(take, timeout_s), transfer=True, waited_s=timeout_s)
        return InboundTransfer(out[0])

    def notifications(self, timeout_s: float = 0.0) -> list[Notification]:
        """Inbound notifications; waits up to ``timeout_s`` for the first one,
        then returns it with every other one already queued."""
        out: list[Notification] = []
        n = ffi.new("kvl_notification *")
        deadline = time.monotonic() + timeout_s
        while True:
            a = self._enter()
            try:
                left = max(0.0, deadline - time.monotonic()) if not out else 0.0
                rc = lib.kvl_next_notification(a, ms(min(left, SLICE_S)), n)
            finally:
                self._exit()
            if rc == ErrorCode.OK:
                out.append(
                    Notification(
                        peer=cstr(n.peer),
                        tag=bytes(ffi.buffer(n.tag, n.tag_len)),
                        transfer_id=int(n.xfer_id),
                        op=Op(n.op),
                    )
                )
                continue
            if rc != ErrorCode.TIMEOUT:
                check(rc)
            if out or time.monotonic() >= deadline:
                return out

    def paths(self) -> list[PathInfo]:
        """Every path to every peer, with its live statistics."""
        a = self._enter()
        try:
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
                    last_error=cstr(p.last_error),
                )
                for p in arr[0 : min(n[0], cap)]
            ]
        finally:
            self._exit()


def _find(a: Any, peer: str) -> Any:
    out = ffi.new("kvl_peer **")
    check(lib.kvl_peer_find(a, peer.encode(), out), peer=peer)
    return out[0]


def _remote_regions(p: Any, peer: str) -> list[RemoteRegion]:
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


def _parse_metadata(metadata: bytes | str | dict[str, Any]) -> dict[str, Any]:
    try:
        md = json.loads(metadata) if isinstance(metadata, (bytes, str)) else dict(metadata)
    except (ValueError, TypeError) as exc:
        raise InvalidArgumentError(
            f"metadata: not kvlink agent metadata ({exc}); pass the bytes of the peer's "
            "agent.metadata()"
        ) from None
    if not isinstance(md, dict) or md.get("kvlink") != METADATA_VERSION:
        raise InvalidArgumentError(
            f"metadata: expected kvlink metadata version {METADATA_VERSION}, got "
            f"{md.get('kvlink') if isinstance(md, dict) else type(md).__name__!r}"
        )
    name = md.get("name")
    addrs = md.get("addrs")
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("metadata: 'name' is missing")
    if (
        not isinstance(addrs, list)
        or not addrs
        or not all(
            isinstance(x, list)
            and len(x) == 2
            and isinstance(x[0], str)
            and isinstance(x[1], int)
            and 0 < x[1] < 65536
            for x in addrs
        )
    ):
        raise InvalidArgumentError(
            f"metadata: 'addrs' must be a list of [host, port], got {addrs!r}"
        )
    try:
        instance = int(md.get("instance", "0"), 16)
    except (TypeError, ValueError):
        raise InvalidArgumentError("metadata: 'instance' is not a hex id") from None
    return {"name": name, "addrs": [(h, p) for h, p in addrs], "instance": instance}
