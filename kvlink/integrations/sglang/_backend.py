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
import json
import logging
import queue
import threading
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_ACK_TAG,
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
# name rooms that never reach this prefill (a router that gave up); the oldest go first.
MAX_PENDING_ROOMS = 65536
# Decode ranks one prefill rank keeps registrations of (each one a kvlink peer).
MAX_DECODE_SESSIONS = 4096
# Registrations waiting to be connected: connecting may take connect_timeout_s per path, so it
# runs on its own thread and a flood of registrations cannot hold up the rooms behind it.
MAX_QUEUED_REGISTRATIONS = 64


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


def _refuse_unsupported(args: KVArgs, is_mla: bool) -> None:
    """What this backend does not move yet stops the engine at start, saying so."""
    states = list(getattr(args, "state_types", None) or [])
    if states:
        raise NotImplementedError(
            "kvlink transfer backend: this model keeps state beside its KV pages "
            f"({', '.join(str(getattr(s, 'value', s)) for s in states)}: hybrid, SWA or DSA "
            "pools), which kvlink does not move yet; use a full-attention model or "
            "--disaggregation-transfer-backend mooncake"
        )
    if get_parallel().pp_size != 1:
        raise NotImplementedError(
            "kvlink transfer backend: pipeline parallelism (--pp-size > 1) is not supported; "
            "run prefill and decode with --pp-size 1"
        )
    if get_disagg().disaggregation_decode_allocation_policy == "prefill_complete":
        raise NotImplementedError(
            "kvlink transfer backend: --disaggregation-decode-allocation-policy "
            "prefill_complete is not supported; use the default policy"
        )
    if len(args.kv_item_lens) != len(args.kv_data_ptrs) or not args.kv_data_ptrs:
        raise NotImplementedError(
            "kvlink transfer backend: this KV pool does not expose one contiguous buffer "
            "per KV entry (kv_item_lens / kv_data_ptrs), which kvlink needs"
        )


@dataclasses.dataclass
class _DecodePeer:
    """A decode rank that registered with this prefill rank."""

    reg: msgs.Registration
    error: str | None = None   # why its requests fail here (layout, connection), or None


@dataclasses.dataclass
class _Send:
    """One request's pushes on the prefill side."""

    chunks: int = 0
    pending: list[kvlink.Transfer] = dataclasses.field(default_factory=list)
    last_sent: bool = False
    error: str | None = None


class _Arrivals:
    """Which chunks of one request each prefill rank has delivered, on the decode side."""

    def __init__(self, senders: set[str]) -> None:
        self.senders = senders
        self.chunks: dict[int, set[int]] = collections.defaultdict(set)
        self.last: dict[int, int] = {}

    def add(self, rank: int, chunk: int, last: bool) -> bool:
        """Records one verified chunk; True once ``rank`` has delivered all of its chunks."""
        got = self.chunks[rank]
        got.add(chunk)
        if last:
            self.last[rank] = chunk
        n = self.last.get(rank)
        return n is not None and len(got) == n + 1 and max(got) == n


class KvlinkKVManager(CommonKVManager):
    """One SGLang rank's kvlink agent and its transfers (prefill or decode)."""

    kv_status_msg_tag = msgs.STATUS_TAG
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        _refuse_unsupported(args, bool(is_mla_backend))
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self.is_prefill = disaggregation_mode == DisaggregationMode.PREFILL
        naming = msgs.prefill_agent_name if self.is_prefill else msgs.decode_agent_name
        try:
            self.agent = kvlink.Agent(naming(self.local_ip, self.rank_port), kvlink.Config.load())
        except kvlink.KvlinkError as exc:
            raise RuntimeError(
                f"kvlink transfer backend: cannot start the kvlink agent: {exc} (settings come "
                "from KVLINK_* variables: KVLINK_NICS, KVLINK_SECRET, ...; docs/sglang.md)"
            ) from exc
        atexit.register(self.agent.close)
        self._register_buffers(writable=not self.is_prefill)
        self.push_timeout_s = kvlink.Config.load().transfer_timeout_s or None
        self._threads: list[threading.Thread] = []
        if self.is_prefill:
            self._decode_peers: collections.OrderedDict[str, _DecodePeer] = (
                collections.OrderedDict()
            )
            self._sends: dict[int, _Send] = {}
            self._registrations: queue.Queue[msgs.Registration] = queue.Queue(
                MAX_QUEUED_REGISTRATIONS)
            self._waiting_rooms: dict[str, set[int]] = {}
            self._spawn("kvlink-sglang-control", self._prefill_control_loop)
            self._spawn("kvlink-sglang-connect", self._prefill_connect_loop)
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
        on_gpu = get_device().device not in ("cpu", None)
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
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _recv(self) -> list[bytes] | None:
        """The next control message, or None every 0.5 s so the loops can see a stop."""
        if self.server_socket.poll(500):
            return list(self.server_socket.recv_multipart())
        return None

    # -- decode -> prefill messages (built on decode) -------------------------------------------

    def build_receiver_registration_message(self) -> list[bytes]:
        a = self.kv_args
        return msgs.encode_registration(msgs.Registration(
            session=self.agent.name, endpoint=self.local_ip, port=self.rank_port,
            metadata=self.agent.metadata().decode(), kv_regions=self.kv_regions,
            kv_item_lens=list(a.kv_item_lens), kv_pages=self.kv_pages,
            aux_regions=self.aux_regions, aux_item_lens=list(a.aux_item_lens),
            aux_slots=self.aux_slots, tp_rank=a.engine_rank, attn_tp_size=self.attn_tp_size,
            is_mla=bool(self.is_mla_backend), page_size=a.page_size,
        ))

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
        return msgs.encode_room(msgs.RoomInfo(
            room=bootstrap_room, session=self.agent.name, endpoint=self.local_ip,
            port=self.rank_port, dst_pages=np.asarray(kv_indices, np.int32),
            aux_index=int(aux_index or 0), required_dst_info_num=required_dst_info_num,
            is_dummy=is_dummy,
        ))

    # -- prefill: control messages --------------------------------------------------------------

    def _prefill_control_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                frames = self._recv()
                if frames is None:
                    continue
                if frames[0] == msgs.REG_TAG:
                    reg = msgs.decode_registration(frames)
                    try:
                        self._registrations.put_nowait(reg)
                    except queue.Full:
                        logger.warning("kvlink prefill: registration of %s dropped: %d are "
                                       "still being connected", reg.session,
                                       MAX_QUEUED_REGISTRATIONS)
                elif frames[0] == msgs.ROOM_TAG:
                    self._on_room(msgs.decode_room(frames))
                elif not self._on_abort(frames):
                    logger.warning("kvlink prefill: dropped a control message of unknown kind "
                                   "(%d frames)", len(frames))
            except msgs.MessageError as exc:
                logger.warning("kvlink prefill: dropped a malformed control message: %s", exc)
            except Exception:
                logger.exception("kvlink prefill: control message failed")

    def _layout_error(self, reg: msgs.Registration) -> str | None:
        a = self.kv_args
        if reg.page_size != a.page_size:
            return f"page size {reg.page_size} on decode, {a.page_size} here: use one --page-size"
        if len(reg.kv_regions) != len(self.kv_regions):
            return (f"decode has {len(reg.kv_regions)} KV buffers, prefill "
                    f"{len(self.kv_regions)}: serve the same model on both")
        if not self.is_mla_backend and reg.attn_tp_size != self.attn_tp_size:
            return (f"attention TP {self.attn_tp_size} on prefill and {reg.attn_tp_size} on "
                    "decode: kvlink moves MHA KV between equal TP sizes only (MLA may differ)")
        if list(reg.kv_item_lens) != list(a.kv_item_lens):
            return ("KV page sizes differ between prefill and decode (model, dtype or TP "
                    "differ): serve the same model with the same --kv-cache-dtype")
        n = min(len(reg.aux_item_lens), len(a.aux_item_lens))
        if list(reg.aux_item_lens[:n]) != list(a.aux_item_lens[:n]):
            return "metadata (aux) buffers differ between prefill and decode"
        return None

    def _prefill_connect_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                reg = self._registrations.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self._on_registration(reg)
            except Exception:
                logger.exception("kvlink prefill: registration of %s failed", reg.session)

    def _on_registration(self, reg: msgs.Registration) -> None:
        peer = _DecodePeer(reg, self._layout_error(reg))
        if peer.error is None:
            try:
                name = self._add_peer(reg.metadata)
                if name != reg.session:
                    peer.error = (f"decode registered as {reg.session!r} but its kvlink "
                                  f"metadata names {name!r}")
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
        for name in evicted:   # the oldest decode rank's kvlink peer goes with its registration
            with contextlib.suppress(kvlink.KvlinkError):
                self.agent.remove_peer(name)
        for room in waiting:
            self._room_ready(room)
        if peer.error:
            logger.error("kvlink prefill: decode rank %s refused: %s", reg.session, peer.error)
        else:
            logger.info("kvlink prefill: decode rank %s registered (tp rank %d)", reg.session,
                        reg.tp_rank)

    def _add_peer(self, metadata: str) -> str:
        try:
            return self.agent.add_peer(metadata)
        except kvlink.DuplicateNameError:
            # The decode rank restarted as a new instance under its old name: forget the old
            # one (its pushes failed with it) and connect to the new one.
            self.agent.remove_peer(json.loads(metadata)["name"])
            return self.agent.add_peer(metadata)

    def _on_room(self, info: msgs.RoomInfo) -> None:
        rooms = self.transfer_infos
        entry = rooms.setdefault(info.room, {})
        entry[info.session] = info
        while len(rooms) > MAX_PENDING_ROOMS:
            oldest = next(iter(rooms))
            if oldest == info.room:
                break
            rooms.pop(oldest, None)
        with self._lock:
            if info.session not in self._decode_peers:
                # its registration is still being connected: the room waits for it (a name
                # that never registers holds at most MAX_PENDING_ROOMS rooms, and at most
                # MAX_DECODE_SESSIONS such names are kept; SGLang's bootstrap timeout fails
                # their rooms)
                if (info.session not in self._waiting_rooms
                        and len(self._waiting_rooms) >= MAX_DECODE_SESSIONS):
                    return
                waiting = self._waiting_rooms.setdefault(info.session, set())
                if len(waiting) < MAX_PENDING_ROOMS:
                    waiting.add(info.room)
                return
        self._room_ready(info.room)

    def _room_ready(self, room: int) -> None:
        """WaitingForInput (prefill may compute and send) once every decode rank of the room
        named its pages and is registered here."""
        entry = self.transfer_infos.get(room)
        if not entry:
            return
        required = next(iter(entry.values())).required_dst_info_num
        with self._lock:
            known = all(session in self._decode_peers for session in entry)
        if len(entry) == required and known:
            self.update_status(room, KVPoll.WaitingForInput)

    def _on_abort(self, frames: list[bytes]) -> bool:
        note = AbortNotification.from_zmq(frames)
        if note is None:
            return False
        status = self.request_status.get(note.room)
        if status is not None and status != KVPoll.Success:
            self.record_failure(note.room, "decode aborted the request")
            self.update_status(note.room, KVPoll.Failed)
        if note.decode_ip is not None and note.decode_port is not None:
            na = NetworkAddress(note.decode_ip, note.decode_port)
            try:
                self._send_multipart_locked(
                    na.to_tcp(), [ABORT_ACK_TAG, str(note.room).encode()], is_ipv6=na.is_ipv6
                )
            except Exception as exc:
                logger.debug("kvlink prefill: ABORT_ACK for room %s not sent: %s", note.room, exc)
        return True

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
        infos = self.transfer_infos.get(room)
        if not infos:
            return
        send = self._sends.setdefault(room, _Send())
        if send.error is not None:
            return
        src_pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        try:
            for info in list(infos.values()):
                if info.is_dummy:
                    continue
                segs = self._chunk_segments(info, src_pages, index_slice,
                                            aux_index if is_last_chunk else None)
                if segs.size == 0:
                    continue
                tag = msgs.chunk_tag(room, self._prefill_unique_rank(), send.chunks,
                                     is_last_chunk)
                send.pending.append(self.agent.push(
                    info.session, segments=segs, notify=tag, timeout_s=self.push_timeout_s))
        except (kvlink.KvlinkError, ValueError) as exc:
            self._fail_send(room, send, f"kvlink push of room {room} refused: {exc}")
            return
        send.chunks += 1
        send.last_sent = send.last_sent or is_last_chunk

    def _chunk_segments(
        self, info: msgs.RoomInfo, src_pages: Any, index_slice: slice, aux_index: int | None
    ) -> Any:
        with self._lock:
            peer = self._decode_peers.get(info.session)
        if peer is None:
            raise ValueError(f"decode rank {info.session!r} never registered with this "
                             "prefill rank (or its registration was forgotten)")
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
        send.error = reason
        logger.warning("kvlink prefill: %s", reason)
        self.conclude_failure(bootstrap_room=room, failure_reason=reason)

    def check_pushes(self, room: int) -> None:
        """Moves a room to Success once every push of it is verified at decode, or to Failed
        with kvlink's error (sent to decode too). Called from the sender's poll()."""
        send = self._sends.get(room)
        if send is None or send.error is not None:
            return
        still = []
        for h in send.pending:
            if not h.done:
                still.append(h)
            elif not h.ok:
                self._fail_send(room, send, f"kvlink push of room {room} failed: {h.error}")
                return
        send.pending = still
        if send.last_sent and not still:
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)

    def forget_send(self, room: int) -> None:
        self._sends.pop(room, None)

    # -- decode: arrivals -----------------------------------------------------------------------

    def expect_room(self, room: int, senders: set[str]) -> None:
        """Decode will accept ``room``'s chunks from the agents named ``senders``."""
        with self._lock:
            self._arrivals[room] = _Arrivals(senders)

    def forget_room(self, room: int) -> None:
        with self._lock:
            self._arrivals.pop(room, None)

    def _decode_notify_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                notes = self.agent.notifications(timeout_s=0.5)
            except kvlink.ClosedError:
                return
            for note in notes:
                self._on_notification(note)

    def _on_notification(self, note: kvlink.Notification) -> None:
        try:
            room, rank, chunk, last = msgs.parse_tag(note.tag)
        except msgs.MessageError as exc:
            logger.warning("kvlink decode: notification from %s ignored: %s", note.peer, exc)
            return
        with self._lock:
            arrivals = self._arrivals.get(room)
            if arrivals is None:
                return  # concluded and cleared, or never ours: nothing to complete
            if note.peer not in arrivals.senders:
                logger.warning("kvlink decode: room %s: chunk from %s, which is not one of its "
                               "prefill ranks (%s): ignored", room, note.peer,
                               ", ".join(sorted(arrivals.senders)))
                return
            complete = arrivals.add(rank, chunk, last)
        if complete:
            self.apply_prefill_status(bootstrap_room=room, status=KVPoll.Success,
                                      prefill_rank=rank)

    def _decode_status_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                frames = self._recv()
                if frames is None or self.handle_abort_ack_message(frames):
                    continue
                parsed = self.parse_kv_status_message(frames)
                if parsed is None:
                    continue
                room, status, rank, reason = parsed
                if status == KVPoll.Failed:
                    self.apply_prefill_status(bootstrap_room=room, status=status,
                                              prefill_rank=rank, failure_reason=reason)
                # Success comes from kvlink's notifications only: they prove the bytes are
                # verified here, where a ZMQ message proves nothing.
            except Exception:
                logger.exception("kvlink decode: status message failed")


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
        mgr.expect_room(self.bootstrap_room, senders)

    def _clear(self) -> None:
        super()._clear()
        self.kv_mgr.forget_room(self.bootstrap_room)


class KvlinkKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap table, unchanged."""
