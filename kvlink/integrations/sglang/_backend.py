"""kvlink as SGLang's prefill/decode KV transfer backend (``--disaggregation-transfer-backend
kvlink``): the classes SGLang's ``get_kv_class`` returns for it.

SGLang's common layer (``sglang.srt.disaggregation.common.conn``) keeps doing what it does for
every backend: the HTTP bootstrap table, the rank mapping between prefill and decode, ZMQ for
control messages, heartbeats, timeouts and the room states. kvlink replaces the data path and
the proof of arrival:

- each rank runs one kvlink ``Agent`` (``KVLINK_*`` settings: NICs, cluster secret,
  discovery) and registers SGLang's KV and aux buffers with it;
- decode tells each prefill rank its kvlink metadata once (``REG``) and each request's pages
  (``ROOM``); prefill adds decode as a kvlink peer;
- every chunk SGLang hands to ``KVSender.send`` is one kvlink push straight into decode's pages
  (striped over every path, crc32c on every chunk); the last one also carries the aux slot;
- decode marks a request done only when kvlink's notifications say that every chunk of it is
  verified in its memory, from the prefill agent the bootstrap table names; a ZMQ status message
  can fail a request (prefill's reason travels with it) but never complete one.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import dataclasses
import logging
import queue
import secrets
import threading
import time
from typing import Any, NoReturn

import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_ACK_TAG,
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_device, get_disagg, get_parallel
from sglang.srt.utils.network import NetworkAddress

import kvlink
from kvlink.integrations.sglang import _messages as msgs
from kvlink.integrations.sglang._pages import aux_segments, kv_segments

logger = logging.getLogger("kvlink.sglang")

# Rooms whose destination pages prefill holds before SGLang's sender for them exists: decode may
# name rooms that never reach this prefill (a router that gave up); the oldest without a sender
# go first.
MAX_PENDING_ROOMS = 65536
# Decode ranks one prefill rank keeps registrations of (each one a kvlink peer), least recently
# used first out; registrations waiting to be connected are bounded by the same number.
MAX_DECODE_SESSIONS = 4096
# How often the prefill side looks at its pushes in flight (only while there are some).
DRAIN_POLL_S = 0.002
# The reason prefill gives for a request from a decode rank it holds no registration of (the
# prefill restarted, or the registration was dropped): decode then registers again.
NOT_REGISTERED = "kvlink: this prefill rank holds no registration of decode rank"
# Failure answers to rooms prefill cannot take, waiting to be sent: ZMQ blocks a send to an
# endpoint nobody listens on, so they leave from their own thread, and beyond this many the
# newest are dropped.
MAX_QUEUED_REPLIES = 1024


class _CudaSpan:
    """A GPU buffer SGLang allocated, as kvlink's registration takes it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
        }


def _span(ptr: int, nbytes: int, on_gpu: bool) -> Any:
    """Memory SGLang owns for the process's life, as an object kvlink can register."""
    if on_gpu:
        return _CudaSpan(ptr, nbytes)
    return (ctypes.c_ubyte * nbytes).from_address(ptr)


def _refuse_unsupported(args: KVArgs, server_args: Any) -> None:
    """What this backend does not move yet stops the engine at start, saying so."""
    def refuse(what: str) -> NoReturn:
        raise NotImplementedError(f"kvlink transfer backend: {what}")

    states = list(getattr(args, "state_types", None) or [])
    if states:
        refuse("this model keeps state beside its KV pages "
               f"({', '.join(str(getattr(s, 'value', s)) for s in states)}: hybrid, SWA or DSA "
               "pools), which kvlink does not move yet; use a full-attention model or "
               "--disaggregation-transfer-backend mooncake")
    parallel = get_parallel()
    if parallel.pp_size != 1:
        refuse("pipeline parallelism (--pp-size > 1) is not supported; use --pp-size 1")
    if parallel.attn_cp_size != 1:
        refuse("context parallelism (attention CP > 1) is not supported")
    disagg = get_disagg()
    if disagg.disaggregation_decode_allocation_policy == "prefill_complete":
        refuse("--disaggregation-decode-allocation-policy prefill_complete is not supported; "
               "use the default policy")
    if getattr(disagg, "disaggregation_decode_enable_radix_cache", False):
        refuse("--disaggregation-decode-enable-radix-cache is not supported (decode would "
               "hold a prefix kvlink does not skip)")
    if getattr(server_args, "enable_memory_saver", False):
        refuse("--enable-memory-saver is not supported (kvlink keeps SGLang's KV memory "
               "registered for the process's life)")
    if get_device().device not in ("cpu", "cuda", None):
        refuse(f"device {get_device().device!r}: kvlink registers CPU and CUDA memory only")
    if len(args.kv_item_lens) != len(args.kv_data_ptrs) or not args.kv_data_ptrs:
        refuse("this KV pool does not expose one contiguous buffer per KV entry "
               "(kv_item_lens / kv_data_ptrs), which kvlink needs")


@dataclasses.dataclass
class _DecodePeer:
    """A decode rank that registered with this prefill rank."""

    reg: msgs.Registration
    error: str | None = None   # why its requests fail here (layout, connection), or None


@dataclasses.dataclass
class _Send:
    """One request's pushes on the prefill side (counters under the manager's lock)."""

    chunks: int = 0           # chunks pushed so far (the next chunk's number)
    submitted: int = 0        # pushes submitted
    finished: int = 0         # of those, done (verified at decode, or failed)
    last_sent: bool = False
    error: str | None = None  # the first failure; the room fails once every push is done
    concluded: bool = False


class _Arrivals:
    """Which chunks of one request each of its prefill ranks has delivered, on decode."""

    def __init__(self, attempt: int, senders: set[str]) -> None:
        self.attempt = attempt
        self.senders = sorted(senders)
        self.chunks: dict[str, set[int]] = collections.defaultdict(set)
        self.last: dict[str, int] = {}

    def add(self, peer: str, chunk: int, last: bool) -> bool:
        """Records one verified chunk; True once ``peer`` has delivered every chunk of it."""
        got = self.chunks[peer]
        got.add(chunk)
        if last:
            self.last[peer] = chunk
        n = self.last.get(peer)
        return n is not None and len(got) == n + 1 and max(got) == n


class KvlinkKVManager(CommonKVManager):
    """One SGLang rank's kvlink agent and its transfers (prefill or decode)."""

    kv_status_msg_tag = msgs.STATUS_TAG
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True
    # decode holds a failed request's pages until prefill says none of its pushes can still
    # land there (SGLang's deferred release; prefill acks once the room's pushes are done)
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        _refuse_unsupported(args, server_args)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.server_socket.setsockopt(zmq.MAXMSGSIZE, msgs.MAX_FRAME_BYTES)
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._status_lock = threading.RLock()
        self.is_prefill = disaggregation_mode == DisaggregationMode.PREFILL
        naming = msgs.prefill_agent_name if self.is_prefill else msgs.decode_agent_name
        try:
            config = kvlink.Config.load()
            self.agent = kvlink.Agent(naming(self.local_ip, self.rank_port), config)
        except kvlink.KvlinkError as exc:
            raise RuntimeError(
                f"kvlink transfer backend: cannot start the kvlink agent: {exc} (settings come "
                "from KVLINK_* variables: KVLINK_NICS, KVLINK_SECRET, ...; docs/sglang.md)"
            ) from exc
        atexit.register(self.agent.close)
        self._register_buffers(writable=not self.is_prefill)
        self.push_timeout_s = config.transfer_timeout_s or None
        self._control_key = msgs.control_key(config.resolved_secret())
        self._auth_replies = 0.0   # rate limit of answers to messages that fail their MAC
        self._threads: list[threading.Thread] = []
        if self.is_prefill:
            self._decode_peers: collections.OrderedDict[str, _DecodePeer] = (
                collections.OrderedDict())
            self._pending_regs: collections.OrderedDict[str, msgs.Registration] = (
                collections.OrderedDict())
            self._connecting: set[str] = set()
            self._regs_ready = threading.Condition(self._lock)
            self._waiting_rooms: dict[str, set[int]] = {}
            self._sends: dict[int, _Send] = {}
            self._inflight: dict[int, list[kvlink.Transfer]] = {}
            self._inflight_ready = threading.Event()
            self._replies: queue.Queue[tuple[str, int, int, str]] = queue.Queue(
                MAX_QUEUED_REPLIES)
            self._spawn("kvlink-sglang-reply", self._prefill_reply_loop)
            self._spawn("kvlink-sglang-control", self._prefill_control_loop)
            self._spawn("kvlink-sglang-connect", self._prefill_connect_loop)
            self._spawn("kvlink-sglang-drain", self._prefill_drain_loop)
        else:
            self._arrivals: dict[int, _Arrivals] = {}
            self._spawn("kvlink-sglang-status", self._decode_status_loop)
            self._spawn("kvlink-sglang-notify", self._decode_notify_loop)
            self._threads.append(self._start_heartbeat_checker_thread())
        logger.info(
            "kvlink %s rank %s: agent %s on %d path(s), %d KV + %d aux buffers registered",
            "prefill" if self.is_prefill else "decode", self.kv_args.engine_rank,
            self.agent.name, len(self.agent.addresses), len(self.kv_regions),
            len(self.aux_regions),
        )

    # -- set-up ---------------------------------------------------------------------------------

    def _register_buffers(self, writable: bool) -> None:
        on_gpu = get_device().device == "cuda"
        a = self.kv_args
        self.kv_regions = [
            self.agent.register(_span(p, n, on_gpu), remote_write=writable, name=f"kv{i}").id
            for i, (p, n) in enumerate(zip(a.kv_data_ptrs, a.kv_data_lens, strict=True))
        ]
        self.kv_pages = [n // item for n, item in zip(a.kv_data_lens, a.kv_item_lens, strict=True)]
        self.aux_regions = [
            self.agent.register(_span(p, n, False), remote_write=writable, name=f"aux{i}").id
            for i, (p, n) in enumerate(zip(a.aux_data_ptrs, a.aux_data_lens, strict=True))
        ]
        self.aux_slots = [n // item
                          for n, item in zip(a.aux_data_lens, a.aux_item_lens, strict=True)]
        ids = list(getattr(a, "kv_layer_ids", None) or [])
        self.kv_layer_ids = ids if len(ids) == len(self.kv_regions) else list(
            range(len(self.kv_regions)))

    def _spawn(self, name: str, target: Any) -> None:
        def guarded() -> None:
            while not self._stopped.is_set():
                try:
                    target()
                    return
                except Exception:   # a loop must outlive any one message: log and go on
                    logger.exception("kvlink %s: unexpected error (the loop goes on)", name)

        t = threading.Thread(target=guarded, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _recv(self) -> list[bytes] | None:
        """The next control message, or None every 0.5 s so the loops can see a stop."""
        if self.server_socket.poll(500):
            return list(self.server_socket.recv_multipart())
        return None

    def update_status(self, bootstrap_room: int, status: KVPoll) -> None:
        # SGLang's read-modify-write, called here from several threads (scheduler, control,
        # connect, notifications, heartbeat): one at a time, so Failed is never overwritten.
        with self._status_lock:
            super().update_status(bootstrap_room, status)

    # -- decode -> prefill messages (built on decode) -------------------------------------------

    def build_receiver_registration_message(self) -> list[bytes]:
        a = self.kv_args
        return msgs.sign(msgs.encode_registration(msgs.Registration(
            session=self.agent.name, endpoint=self.local_ip, port=self.rank_port,
            metadata=self.agent.metadata().decode(), kv_regions=self.kv_regions,
            kv_item_lens=list(a.kv_item_lens), kv_pages=self.kv_pages,
            aux_regions=self.aux_regions, aux_item_lens=list(a.aux_item_lens),
            aux_slots=self.aux_slots, tp_rank=a.engine_rank, attn_tp_size=self.attn_tp_size,
            is_mla=bool(self.is_mla_backend), page_size=a.page_size,
        )), self._control_key)

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: Any,
        aux_index: int | None,
        state_indices: Any,
        decode_prefix_len: int | None,
        is_dummy: bool,
        device_kv_indices: Any = None,
    ) -> list[bytes]:
        if aux_index is None and not is_dummy:
            raise ValueError(f"kvlink transfer backend: room {bootstrap_room} has no aux slot")
        with self._lock:
            arrivals = self._arrivals.get(bootstrap_room)
        return msgs.sign(msgs.encode_room(msgs.RoomInfo(
            room=bootstrap_room, attempt=arrivals.attempt if arrivals else 0,
            session=self.agent.name, endpoint=self.local_ip, port=self.rank_port,
            dst_pages=np.asarray(kv_indices, np.int32), aux_index=int(aux_index or 0),
            required_dst_info_num=required_dst_info_num, is_dummy=is_dummy,
        )), self._control_key)

    # -- prefill: control messages --------------------------------------------------------------

    def _prefill_control_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                frames = self._recv()
                if frames is None:
                    continue
                if frames[0] == msgs.REG_TAG:
                    self._queue_registration(msgs.decode_registration(
                        self._verified(frames, None)))
                elif frames[0] == msgs.ROOM_TAG:
                    self._on_room(msgs.decode_room(
                        self._verified(frames, msgs.decode_room)))
                elif frames[0] == ABORT_TAG:
                    self._on_abort(frames)
                else:
                    logger.warning("kvlink prefill: dropped a control message of unknown kind "
                                   "(%d frames)", len(frames))
            except msgs.MessageError as exc:
                logger.warning("kvlink prefill: dropped a malformed control message: %s", exc)

    def _verified(self, frames: list[bytes], parse_room: Any) -> list[bytes]:
        """The message without its MAC. One that fails it (another cluster secret, or forged)
        is dropped; for a room, the request fails here if it is ours and its decode rank is
        told why (at most 10 answers a second)."""
        try:
            return msgs.verify(frames, self._control_key)
        except msgs.AuthError as exc:
            if parse_room is None:
                raise
            try:
                info = parse_room(frames[:-1])
            except msgs.MessageError:
                raise exc from None
            reason = (f"prefill rank {self.agent.name!r} refused the request: its control "
                      f"message was {exc}")
            if info.room in self.request_status:
                self.record_failure(info.room, reason)
                self.update_status(info.room, KVPoll.Failed)
            now = time.monotonic()
            if now - self._auth_replies >= 0.1:
                self._auth_replies = now
                self._reply(info, reason)
            raise

    def _reply(self, info: msgs.RoomInfo, reason: str) -> None:
        """Tells a room's decode rank that prefill fails it, without waiting on its socket."""
        try:
            self._replies.put_nowait((info.endpoint, info.port, info.room, reason))
        except queue.Full:
            logger.debug("kvlink prefill: answer to room %s dropped (%d queued)", info.room,
                         MAX_QUEUED_REPLIES)

    def _prefill_reply_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                endpoint, port, room, reason = self._replies.get(timeout=0.5)
            except queue.Empty:
                continue
            self.send_kv_status_message(targets=[(endpoint, port)], bootstrap_room=room,
                                        status=KVPoll.Failed, failure_reason=reason)

    def _queue_registration(self, reg: msgs.Registration) -> None:
        """Connecting may take connect_timeout_s a path: it runs on its own thread, so a flood
        of registrations cannot hold up the rooms behind it. The latest registration of a
        decode rank replaces one still queued."""
        with self._lock:
            self._pending_regs.pop(reg.session, None)
            self._pending_regs[reg.session] = reg
            while len(self._pending_regs) > MAX_DECODE_SESSIONS:
                dropped, _ = self._pending_regs.popitem(last=False)
                logger.warning("kvlink prefill: registration of %s dropped: %d are waiting to "
                               "be connected", dropped, MAX_DECODE_SESSIONS)
            self._regs_ready.notify()

    def _prefill_connect_loop(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                if not self._pending_regs:
                    self._regs_ready.wait(0.5)
                    continue
                session, reg = self._pending_regs.popitem(last=False)
                self._connecting.add(session)
            try:
                self._on_registration(reg)
            finally:
                with self._lock:
                    self._connecting.discard(session)

    def _layout_error(self, reg: msgs.Registration) -> str | None:
        a = self.kv_args
        if reg.page_size != a.page_size:
            return f"page size {reg.page_size} on decode, {a.page_size} here: use one --page-size"
        if len(reg.kv_regions) != len(self.kv_regions):
            return (f"decode has {len(reg.kv_regions)} KV buffers, prefill "
                    f"{len(self.kv_regions)}: serve the same model (and the same speculative "
                    "draft model, or none) on both")
        if not self.is_mla_backend and reg.attn_tp_size != self.attn_tp_size:
            return (f"attention TP {self.attn_tp_size} on prefill and {reg.attn_tp_size} on "
                    "decode: kvlink moves MHA KV between equal TP sizes only (MLA may differ)")
        if not self.is_mla_backend and reg.tp_rank % reg.attn_tp_size != self.attn_tp_rank:
            return (f"decode TP rank {reg.tp_rank} holds other heads than this prefill rank "
                    f"(attention TP rank {self.attn_tp_rank}): it registered with the wrong "
                    "prefill rank")
        if list(reg.kv_item_lens) != list(a.kv_item_lens):
            return ("KV page sizes differ between prefill and decode (model, dtype or TP "
                    "differ): serve the same model with the same --kv-cache-dtype")
        n = min(len(reg.aux_item_lens), len(a.aux_item_lens))
        if list(reg.aux_item_lens[:n]) != list(a.aux_item_lens[:n]):
            return "metadata (aux) buffers differ between prefill and decode"
        return None

    def _on_registration(self, reg: msgs.Registration) -> None:
        peer = _DecodePeer(reg, self._layout_error(reg))
        if peer.error is None:
            try:
                name = self.agent.add_peer(reg.metadata)
                if name != reg.session:
                    peer.error = (f"decode registered as {reg.session!r} but its kvlink "
                                  f"metadata names {name!r}")
                    self.agent.remove_peer(name)
            except kvlink.KvlinkError as exc:
                peer.error = f"kvlink cannot reach decode agent {reg.session!r}: {exc}"
        self.check_peer_aux_buffer_count(reg.session, len(reg.aux_regions))
        with self._lock:
            self._decode_peers.pop(reg.session, None)
            self._decode_peers[reg.session] = peer
            evicted = []
            while len(self._decode_peers) > MAX_DECODE_SESSIONS:
                evicted.append(self._decode_peers.popitem(last=False)[0])
            waiting = self._waiting_rooms.pop(reg.session, set())
        for name in evicted:   # the least recently used decode rank's kvlink peer goes too
            with contextlib.suppress(kvlink.KvlinkError):
                self.agent.remove_peer(name)
        if peer.error:
            logger.error("kvlink prefill: decode rank %s refused: %s", reg.session, peer.error)
        else:
            logger.info("kvlink prefill: decode rank %s registered (tp rank %d)", reg.session,
                        reg.tp_rank)
        for room in waiting:
            self._room_ready(room)

    def _on_room(self, info: msgs.RoomInfo) -> None:
        if len(info.dst_pages) > max(self.kv_pages):
            logger.warning("kvlink prefill: room %s names %d pages, more than this pool holds: "
                           "dropped", info.room, len(info.dst_pages))
            return
        with self._lock:
            known = info.session in self._decode_peers
            unknown = not known and (info.session not in self._pending_regs
                                     and info.session not in self._connecting)
            if known:
                self._decode_peers.move_to_end(info.session)
            elif not unknown and (info.session in self._waiting_rooms
                                  or len(self._waiting_rooms) < MAX_DECODE_SESSIONS):
                # its registration is still being connected: the room waits for it (at most
                # MAX_PENDING_ROOMS rooms a name and MAX_DECODE_SESSIONS names)
                waiting = self._waiting_rooms.setdefault(info.session, set())
                if len(waiting) < MAX_PENDING_ROOMS:
                    waiting.add(info.room)
            if not unknown:
                entry = self.transfer_infos.setdefault(info.room, {})
                old = entry.get(info.session)
                if old is not None and (old.attempt == info.attempt or info.room in self._sends):
                    return   # the first ROOM of a transfer wins; a copy cannot move its pages
                if old is None and len(entry) >= info.required_dst_info_num:
                    return   # more decode ranks than the room asked for
                entry[info.session] = info
                self._evict_rooms(info.room)
        if unknown:
            self._reply(info, f"{NOT_REGISTERED} {info.session!r}: it registers again on its "
                        "next request")
        elif known:
            self._room_ready(info.room)

    def _evict_rooms(self, keep: int) -> None:
        """Caller holds the lock. Rooms beyond MAX_PENDING_ROOMS go oldest first, never one
        whose request is being sent; a room that had no sender leaves no status behind."""
        rooms = self.transfer_infos
        for room in list(rooms)[:max(0, len(rooms) - MAX_PENDING_ROOMS)]:
            if room == keep or room in self._sends:
                continue
            rooms.pop(room, None)
            if self.request_status.get(room) == KVPoll.WaitingForInput:
                self.request_status.pop(room, None)

    def _room_ready(self, room: int) -> None:
        """WaitingForInput (prefill may compute and send) once every decode rank of the room
        named its pages and is registered here."""
        with self._lock:
            entry = dict(self.transfer_infos.get(room) or {})
            if not entry:
                return
            required = next(iter(entry.values())).required_dst_info_num
            known = all(session in self._decode_peers for session in entry)
        if len(entry) == required and known:
            self.update_status(room, KVPoll.WaitingForInput)

    def _on_abort(self, frames: list[bytes]) -> None:
        note = AbortNotification.from_zmq(frames)
        if note is None:
            return
        room = note.room
        status = self.request_status.get(room)
        if status is not None and status != KVPoll.Success:
            self.record_failure(room, "decode aborted the request")
            self.update_status(room, KVPoll.Failed)   # no further chunk of it is pushed
        target = note.deferred_ack_target()
        if target is not None:
            # decode holds the pages until this ack: it goes once the room's pushes are done
            self.register_deferred_ack_target(room, target)
            self._maybe_ack_drained_abort(room)
        elif note.decode_ip is not None and note.decode_port is not None:
            na = NetworkAddress(note.decode_ip, note.decode_port)
            try:
                self._send_multipart_locked(
                    na.to_tcp(), [ABORT_ACK_TAG, str(room).encode()], is_ipv6=na.is_ipv6)
            except Exception as exc:
                logger.debug("kvlink prefill: ABORT_ACK for room %s not sent: %s", room, exc)

    # -- prefill: the data path -----------------------------------------------------------------

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: Any,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: Any = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        """Pushes one chunk of a request to every decode rank that waits for it (SGLang calls
        this from ``KVSender.send`` on the scheduler thread; the push runs in kvlink's engine)."""
        room = bootstrap_room
        if self.request_status.get(room) in (None, KVPoll.Failed):
            return
        with self._lock:
            infos = list((self.transfer_infos.get(room) or {}).values())
            send = self._sends.setdefault(room, _Send())
        if send.error is not None:
            return
        if not infos:
            self._fail_send(room, send, f"room {room}: no decode rank named its pages here")
            return
        src_pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        pushed = 0
        try:
            for info in infos:
                if info.is_dummy:
                    continue
                segs = self._chunk_segments(info, src_pages, index_slice,
                                            aux_index if is_last_chunk else None)
                if segs.size == 0:
                    continue
                tag = msgs.chunk_tag(room, info.attempt, send.chunks, is_last_chunk)
                h = self.agent.push(info.session, segments=segs, notify=tag,
                                    timeout_s=self.push_timeout_s)
                self._track(room, send, h)
                pushed += 1
        except (kvlink.KvlinkError, ValueError) as exc:
            self._fail_send(room, send, f"kvlink push of room {room} refused: {exc}")
            return
        if pushed:
            send.chunks += 1   # decode counts chunks 0..n: a number is used only when pushed
        send.last_sent = send.last_sent or is_last_chunk

    def _track(self, room: int, send: _Send, h: kvlink.Transfer) -> None:
        with self._lock:
            send.submitted += 1
            self._inflight.setdefault(room, []).append(h)
            self._staging_outstanding[room] += 1   # SGLang's count of writes that may land
        self._inflight_ready.set()

    def _chunk_segments(
        self, info: msgs.RoomInfo, src_pages: Any, index_slice: slice, aux_index: int | None
    ) -> Any:
        with self._lock:
            peer = self._decode_peers.get(info.session)
        if peer is None:
            raise ValueError(f"{NOT_REGISTERED} {info.session!r}")
        if peer.error is not None:
            raise ValueError(peer.error)
        reg = peer.reg
        dst_pages = info.dst_pages[index_slice]
        if len(dst_pages) != len(src_pages):
            raise ValueError(f"decode gave {len(dst_pages)} pages for this chunk, prefill "
                             f"sends {len(src_pages)}")
        if len(dst_pages) and int(dst_pages.max()) >= min(reg.kv_pages):
            raise ValueError(f"decode page {int(dst_pages.max())} is outside its KV pool "
                             f"({min(reg.kv_pages)} pages)")
        parts = [kv_segments(
            src_regions=self.kv_regions, dst_regions=reg.kv_regions,
            item_lens=self.kv_args.kv_item_lens, layer_ids=self.kv_layer_ids,
            src_pages=src_pages, dst_pages=dst_pages,
        )] if len(src_pages) else []
        if aux_index is not None:
            n = min(len(self.aux_regions), len(reg.aux_regions))
            if info.aux_index >= min(reg.aux_slots[:n], default=1):
                raise ValueError(f"decode aux slot {info.aux_index} is outside its buffers")
            parts.append(aux_segments(
                src_regions=self.aux_regions[:n], dst_regions=reg.aux_regions[:n],
                item_lens=self.kv_args.aux_item_lens[:n], src_slot=aux_index,
                dst_slot=info.aux_index, layer=max(len(set(self.kv_layer_ids)) - 1, 0),
            ))
        return np.concatenate(parts) if parts else np.zeros(0)

    def _fail_send(self, room: int, send: _Send, reason: str) -> None:
        """Records the room's first failure; it is reported once every push of it is done."""
        with self._lock:
            if send.error is None:
                send.error = reason
        logger.warning("kvlink prefill: %s", reason)
        self.check_pushes(room)

    def _prefill_drain_loop(self) -> None:
        """Counts pushes as they end (also those of requests SGLang cleared already), and
        sends decode's deferred ack once none of a room's pushes can still land."""
        while not self._stopped.is_set():
            with self._lock:
                inflight = {room: list(hs) for room, hs in self._inflight.items()}
            if not inflight:
                self._inflight_ready.wait(0.5)
                self._inflight_ready.clear()
                continue
            drained = []
            for room, handles in inflight.items():
                ended = [h for h in handles if h.done]
                if not ended:
                    continue
                with self._lock:
                    send = self._sends.get(room)
                    left = [h for h in self._inflight.get(room, []) if h not in ended]
                    for h in ended:
                        self._staging_outstanding[room] -= 1
                        if send is not None:
                            send.finished += 1
                            if not h.ok and send.error is None:
                                send.error = f"kvlink push of room {room} failed: {h.error}"
                    if left:
                        self._inflight[room] = left
                    else:
                        self._inflight.pop(room, None)
                        drained.append(room)
            for room in drained:
                self._maybe_ack_drained_abort(room)
            time.sleep(DRAIN_POLL_S)

    def check_pushes(self, room: int) -> None:
        """Moves a room to Success once every push of it is verified at decode, or to Failed
        with kvlink's error (sent to decode too) once every push of it is done. Called from
        the sender's poll()."""
        with self._lock:
            send = self._sends.get(room)
            if send is None or send.concluded or send.finished < send.submitted:
                return
            if send.error is None and not send.last_sent:
                return
            send.concluded = True
            error = send.error
        if error is not None:
            self.conclude_failure(bootstrap_room=room, failure_reason=error)
        else:   # decode learns it from kvlink's notifications, not from a message
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success, targets=[])

    def forget_send(self, room: int) -> None:
        with self._lock:
            self._sends.pop(room, None)

    # -- decode: arrivals -----------------------------------------------------------------------

    def expect_room(self, room: int, senders: set[str]) -> _Arrivals:
        """Decode will accept ``room``'s chunks from the agents named ``senders`` tagged with a
        new random attempt number."""
        arrivals = _Arrivals(secrets.randbits(32), senders)
        with self._lock:
            self._arrivals[room] = arrivals
        return arrivals

    def forget_room(self, room: int, arrivals: _Arrivals | None) -> None:
        with self._lock:
            if arrivals is not None and self._arrivals.get(room) is arrivals:
                del self._arrivals[room]

    def _decode_notify_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                notes = self.agent.notifications(timeout_s=0.5)
            except kvlink.ClosedError:
                return
            for note in notes:
                try:
                    self._on_notification(note)
                except Exception:
                    logger.exception("kvlink decode: notification from %s failed", note.peer)

    def _on_notification(self, note: kvlink.Notification) -> None:
        try:
            room, attempt, chunk, last = msgs.parse_tag(note.tag)
        except msgs.MessageError as exc:
            logger.warning("kvlink decode: notification from %s ignored: %s", note.peer, exc)
            return
        with self._lock:
            arrivals = self._arrivals.get(room)
            if arrivals is None or arrivals.attempt != attempt:
                return  # concluded and cleared, an earlier attempt's, or never ours
            if note.peer not in arrivals.senders:
                logger.warning("kvlink decode: room %s: chunk from %s, which is not one of its "
                               "prefill ranks (%s): ignored", room, note.peer,
                               ", ".join(arrivals.senders))
                return
            complete = arrivals.add(note.peer, chunk, last)
            rank = arrivals.senders.index(note.peer)
        if complete:
            self.apply_prefill_status(bootstrap_room=room, status=KVPoll.Success,
                                      prefill_rank=rank)

    def _decode_status_loop(self) -> None:
        while not self._stopped.is_set():
            frames = self._recv()
            if frames is None or self.handle_abort_ack_message(frames):
                continue
            parsed = self.parse_kv_status_message(frames)
            if parsed is None:
                continue
            room, status, rank, reason = parsed
            if status != KVPoll.Failed:
                continue   # Success comes from kvlink's notifications only: they prove the
                # bytes are verified here, where a ZMQ message proves nothing
            if reason and reason.startswith(NOT_REGISTERED):
                self._register_again()
            self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank,
                                      failure_reason=reason)

    def _register_again(self) -> None:
        """A prefill rank lost this decode rank's registration (it restarted, or dropped it):
        forget the cached bootstrap entries, so the next request registers again."""
        with self.connection_lock:
            self.connection_pool.clear()


class KvlinkKVSender(CommonKVSender):
    """Prefill's handle on one request's transfer (SGLang's KVSender)."""

    kv_mgr: KvlinkKVManager
    conclude_state: Any

    def poll(self) -> int:
        if self.conclude_state is None:
            self.kv_mgr.check_pushes(self.bootstrap_room)
        return int(super().poll())

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_send(self.bootstrap_room)


class KvlinkKVReceiver(CommonKVReceiver):
    """Decode's handle on one request's transfer (SGLang's KVReceiver)."""

    kv_mgr: KvlinkKVManager
    conclude_state: Any
    _arrivals: _Arrivals | None = None

    def init(self, prefill_dp_rank: int) -> None:
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed:
            return
        mgr = self.kv_mgr
        info = getattr(self, "prefill_info", None)
        if info is not None and not mgr.is_mla_backend and info.attn_tp_size != mgr.attn_tp_size:
            reason = (f"kvlink transfer backend: prefill attention TP {info.attn_tp_size}, "
                      f"decode {mgr.attn_tp_size}: MHA KV moves between equal TP sizes only")
            mgr.record_failure(self.bootstrap_room, reason)
            mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            return
        senders = {
            msgs.prefill_agent_name(b["rank_ip"], int(b["rank_port"]))
            for b in (getattr(self, "bootstrap_infos", None) or [])
            if not b.get("is_dummy")
        }
        self._arrivals = mgr.expect_room(self.bootstrap_room, senders)

    def _clear(self) -> None:
        super()._clear()
        self.kv_mgr.forget_room(self.bootstrap_room, self._arrivals)


class KvlinkKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap table, unchanged."""
