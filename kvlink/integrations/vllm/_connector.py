"""KvlinkConnector: vLLM's KV connector (v1 API) moving KV blocks between instances with kvlink.

Two halves, as vLLM runs them: the scheduler side (in the engine core) decides what each request
loads, holds or pushes and sends that to the worker side in the step's connector metadata; the
worker side (in each worker) owns the kvlink Agent and the registered KV tensors and moves the
bytes. The halves share nothing else, so they work in one process or in two. The scheduler side
learns its worker's card (how peers reach it) through vLLM's handshake-metadata channel.

docs/vllm.md describes the flows, the settings and the failure policy.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvlink
from kvlink import kv
from kvlink.integrations.vllm import _protocol as proto
from kvlink.integrations.vllm._settings import Mode, Settings, parse_settings
from kvlink.integrations.vllm._stats import KvlinkConnectorStats, KvlinkPromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so that the engine's own log configuration shows these records beside its own.
log = logging.getLogger("vllm.kvlink")

# Decode, push: how often a wait for layer 0 also looks for prefill's fallback answer. Short
# against a pull's time, long enough that the poll costs nothing measurable.
_FALLBACK_POLL_S = 0.05
# Announcements peers send ahead of their use (pull notifications, offers, fallbacks) wait in
# tables until a request claims them or they expire; a peer must not grow them without limit.
_MAX_PENDING = 4096


def _bounded_put(table: dict[Any, Any], key: Any, value: Any) -> None:
    """table[key] = value, dropping the oldest entry first when ``table`` is full."""
    if key not in table and len(table) >= _MAX_PENDING:
        dropped = next(iter(table))
        del table[dropped]
        log.warning("more than %d unclaimed peer announcements: dropped the oldest (%s)",
                    _MAX_PENDING, dropped)
    table[key] = value


# ---------------------------------------------------------------------------------------------
# What the scheduler side sends its workers each step


@dataclasses.dataclass
class LoadJob:
    """Decode: load ``local_blocks`` of request ``req_id`` in this step's forward pass."""

    req_id: str
    local_blocks: list[int]
    source: proto.PullSource | proto.PushSource
    remote_blocks: list[int]  # pull: the prefill blocks paired with local_blocks


@dataclasses.dataclass
class PushJob:
    """Prefill: this step computes the last of ``req_id``'s prompt; push its blocks."""

    req_id: str
    transfer_id: str
    src_blocks: list[int]
    decode: proto.Card


@dataclasses.dataclass
class Hold:
    """Prefill: ``req_id`` finished; its blocks stay until decode is done or the lease ends."""

    req_id: str
    tag: str
    # Push requests: decode's offer for this transfer id is answered with a fallback (where
    # ``blocks`` are, for a pull) when the blocks are not pushed.
    transfer_id: str | None = None
    decode: proto.Card | None = None
    blocks: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KvlinkMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = dataclasses.field(default_factory=list)
    pushes: list[PushJob] = dataclasses.field(default_factory=list)
    holds: list[Hold] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KvlinkHandshake(KVConnectorHandshakeMetadata):
    """A worker's card, handed by vLLM to the scheduler side after register_kv_caches."""

    card: dict[str, Any]


# ---------------------------------------------------------------------------------------------


class KvlinkConnector(KVConnectorBase_V1):
    """vLLM KV connector over kvlink (``kv_connector="KvlinkConnector"``,
    ``kv_connector_module_path="kvlink.integrations.vllm"``).

    Raises:
        kvlink.ConfigError: at construction, for a bad ``kv_connector_extra_config``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = parse_settings(tc.kv_connector_extra_config)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self.settings, vllm_config)
        else:
            num_blocks = getattr(kv_cache_config, "num_blocks", None)
            self._worker = _WorkerSide(self.settings, vllm_config, num_blocks)

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        assert self._worker is not None
        card = self._worker.card
        return None if card is None else KvlinkHandshake(card.to_dict())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before the forward pass (start_load_kv comes after it in steps without synchronous
        # loads, i.e. on prefill): the pushes of this step must be known when its first layer
        # is saved.
        assert self._worker is not None and isinstance(connector_metadata, KvlinkMetadata)
        self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Before the forward pass when this step loads (vLLM orders it after the zeroing of
        # new blocks, so nothing overwrites what arrives).
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvlinkMetadata)
        self._worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        # Pushes run on while the blocks are held (request_finished keeps them): nothing to
        # wait for here, so the engine goes on with the next step at once.
        assert self._worker is not None
        self._worker.forward_done()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.finished(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- metrics (docs/vllm.md, "Metrics") -----------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Called by vLLM after every step on the worker (and on the scheduler side, which
        # moves nothing): the interval's counters, then a fresh interval.
        if self._worker is None:
            return None
        return self._worker.take_interval_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvlinkConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvlinkPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side --------------------------------------------------------------------

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.set_handshake(metadata)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output, self._kv_cache_manager)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids)


# ---------------------------------------------------------------------------------------------


class _SchedulerSide:
    def __init__(self, settings: Settings, vllm_config: VllmConfig) -> None:
        tc = vllm_config.kv_transfer_config
        assert tc is not None
        self.settings = settings
        self.engine_id = str(tc.engine_id)
        self.producer = bool(tc.is_kv_producer)
        self.consumer = bool(tc.is_kv_consumer)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.card: dict[str, Any] | None = None
        self._loads: dict[str, LoadJob] = {}
        self._local: dict[str, int] = {}  # req -> locally computed tokens at the match
        self._push: dict[str, tuple[Request, str, proto.Card]] = {}
        self._holds: list[Hold] = []

    def set_handshake(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if len(metadata) != 1:
            # One card per engine: every tp rank would need its own agent and its own share of
            # the blocks, which this connector does not do yet.
            raise kvlink.ConfigError(
                f"KvlinkConnector supports one worker per engine (tensor_parallel_size=1), got "
                f"{len(metadata)} workers"
            )
        (meta,) = metadata.values()
        assert isinstance(meta, KvlinkHandshake)
        self.card = meta.card

    def _allowed(self, mode: Mode) -> bool:
        return self.settings.mode in (Mode.AUTO, mode)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not self.consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        try:
            src = proto.parse_decode_params(params)
        except proto.ParamsError as exc:
            log.error("request %s: %s; computing its prompt here", request.request_id, exc)
            return 0, False
        mode = Mode.PUSH if isinstance(src, proto.PushSource) else Mode.PULL
        if not self._allowed(mode):
            log.error(
                "request %s asks for a %s load but kv_connector_extra_config['mode'] is %r; "
                "computing its prompt here", request.request_id, mode.value,
                self.settings.mode.value,
            )
            return 0, False
        if src.card.metadata is None and self.settings.discovery is None:
            log.error(
                "request %s: prefill %r is published through discovery but this instance has "
                "none; computing its prompt here (give it the same kv_connector_extra_config"
                "['discovery'])", request.request_id, src.card.agent,
            )
            return 0, False
        if src.card.block_size != self.block_size:
            log.error(
                "request %s: prefill uses block_size %d, this instance %d; computing its prompt "
                "here (give both instances the same --block-size)",
                request.request_id, src.card.block_size, self.block_size,
            )
            return 0, False
        # The last prompt position is computed here: its logits give the first token.
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        if isinstance(src, proto.PullSource):
            count = min(count, len(src.blocks) * self.block_size - num_computed_tokens)
        if count <= 0 or num_computed_tokens % self.block_size:
            return 0, False
        self._local[request.request_id] = num_computed_tokens
        # Loaded synchronously, inside the forward pass that needs it: the attention of layer
        # i waits for layer i only, so layer 0 runs as soon as it is here.
        return count, False

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        req_id = request.request_id
        if self.producer and params.get("do_remote_decode") and self._allowed(Mode.PUSH):
            try:
                push = proto.parse_prefill_push(params)
            except proto.ParamsError as exc:
                log.error("request %s: %s; its blocks will be held for a pull", req_id, exc)
                push = None
            if push is not None:
                self._push[req_id] = (request, push[0], push[1])
        if num_external_tokens <= 0 or not params.get("do_remote_prefill"):
            return
        src = proto.parse_decode_params(params)  # checked in matched_tokens
        local_computed = self._local.pop(req_id, 0)
        first = local_computed // self.block_size
        last = math.ceil((local_computed + num_external_tokens) / self.block_size)
        local = list(blocks.get_block_ids()[0][first:last])
        remote = src.blocks[first:last] if isinstance(src, proto.PullSource) else []
        self._loads[req_id] = LoadJob(req_id, local, src, remote)
        # Loaded once: after a preemption the request recomputes instead of loading again.
        params["do_remote_prefill"] = False

    def build_meta(self, so: SchedulerOutput, kv_cache_manager: Any) -> KvlinkMetadata:
        meta = KvlinkMetadata(loads=list(self._loads.values()), holds=self._holds)
        self._loads = {}
        self._holds = []
        for req_id, (request, tid, decode) in list(self._push.items()):
            n = so.num_scheduled_tokens.get(req_id, 0)
            if n and request.num_computed_tokens + n >= request.num_prompt_tokens:
                del self._push[req_id]
                nblocks = math.ceil(request.num_prompt_tokens / self.block_size)
                blocks = list(kv_cache_manager.get_block_ids(req_id)[0][:nblocks])
                meta.pushes.append(PushJob(req_id, tid, blocks, decode))
        return meta

    def finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self._push.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._local.pop(req_id, None)
        params = request.kv_transfer_params
        if params and params.get("kvlink_card_only"):
            # A proxy asking for this instance's card (push mode needs both up front).
            return False, {"kvlink": {"card": self.card}}
        if not self.producer or not params or not params.get("do_remote_decode"):
            return False, None
        if self.card is None:
            log.error("request %s: this worker published no card; nothing to hand off", req_id)
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            return False, None
        tag = f"kvl/{self.engine_id}/{req_id}"
        hold = Hold(req_id, tag)
        try:
            push = proto.parse_prefill_push(params)
        except proto.ParamsError:
            push = None  # logged in after_alloc
        if push is not None:
            # Also when this instance does not push (mode "pull"): decode's offer is then
            # answered with a fallback to a pull instead of waiting for decode's timeout.
            hold.transfer_id, hold.decode, hold.blocks = push[0], push[1], list(block_ids)
        self._holds.append(hold)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req_id,
            "remote_block_ids": list(block_ids),
            "kvlink": {
                "card": self.card,
                "tag": tag,
                # Decode starts no pull after this (unix time); a pull it started runs at most
                # max_pull_s, and the blocks are held until expires + max_pull_s.
                "expires": time.time() + self.settings.lease_s,
                "max_pull_s": self.settings.load_timeout_s,
            },
        }


# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ConnectorStats:
    """Counters of one worker (what tests and benchmarks read; cheap to keep)."""

    blocks_loaded: int = 0  # decode: blocks whose every layer arrived
    blocks_failed: int = 0  # decode: blocks reported to vLLM as failed
    load_failures: int = 0  # decode: requests whose load failed
    layers_pushed: int = 0  # prefill: per-layer pushes started
    layers_pushed_late: int = 0  # ... of which after the forward pass (decode's offer was late)
    push_failures: int = 0  # prefill: pushes given up (blocks then wait for a pull or the lease)
    fallbacks_sent: int = 0  # prefill: offers answered with "pull these blocks instead"
    pull_fallbacks: int = 0  # decode: push loads that became pulls on prefill's fallback
    source_down_failures: int = 0  # decode: loads failed early, prefill's paths all down
    last_load_failure: str = ""  # decode: why the last failed load failed (for operators, tests)
    handed_off: int = 0  # prefill: held requests freed because decode has their KV
    leases_expired: int = 0  # prefill: held requests freed by their lease
    # monotonic times (same clock in every process of a host): decode's layer 0 of a push
    # verified, prefill's forward passes that pushed ended. Bounded: the last 64 only.
    layer0_ready_t: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=64)
    )
    forward_end_t: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=64)
    )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer0_ready_t"] = list(self.layer0_ready_t)
        d["forward_end_t"] = list(self.forward_end_t)
        return d


@dataclasses.dataclass
class _Load:
    """A load in this step's forward pass (decode side)."""

    job: LoadJob
    deadline: float  # time.monotonic()
    pull: kvlink.Transfer | None = None
    layer_pushes: dict[int, kvlink.InboundTransfer] = dataclasses.field(default_factory=dict)
    layers_waited: set[int] = dataclasses.field(default_factory=set)
    failed: str | None = None
    source_down_since: float | None = None  # time.monotonic(): every path to prefill DOWN


@dataclasses.dataclass
class _Send:
    """A prefill request whose blocks this worker holds (push and/or pull)."""

    req_id: str
    expires: float  # time.monotonic(); the lease
    tag: str | None = None  # known once the Hold arrived (the step after the push job)
    push: PushJob | None = None
    offer_deadline: float = 0.0  # time.monotonic(); push given up without an offer by then
    offer: tuple[str, list[int], float] | None = None  # decode's destination
    layers_pushed: int = 0
    pushes: list[kvlink.Transfer] = dataclasses.field(default_factory=list)
    push_failed: bool = False
    # push requests (from the PushJob or the Hold): what a fallback answer needs
    transfer_id: str | None = None
    decode: proto.Card | None = None
    src_blocks: list[int] = dataclasses.field(default_factory=list)
    fallback_sent: bool = False


class _WorkerSide:
    def __init__(
        self, settings: Settings, vllm_config: VllmConfig, num_blocks: int | None
    ) -> None:
        tc = vllm_config.kv_transfer_config
        assert tc is not None
        self.settings = settings
        self.engine_id = str(tc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.num_blocks = num_blocks
        self.config = settings.kvlink_config()
        self.agent: kvlink.Agent | None = None
        self.layout: kv.PagedLayout | None = None
        self.card: proto.Card | None = None
        self.layer_index: dict[str, int] = {}
        self._regions: list[kvlink.Region] = []
        self._loads: list[_Load] = []
        self._errors: set[int] = set()
        self._sends: dict[str, _Send] = {}
        self._offers: dict[str, tuple[str, list[int], float]] = {}  # transfer id -> offer
        self._fallbacks: dict[str, proto.Fallback] = {}  # decode: transfer id -> prefill's answer
        self._pulled: dict[str, None] = {}  # tags decode has pulled (insertion-ordered)
        self._step_pushes: list[_Send] = []
        self.stats = ConnectorStats()
        # vLLM's metrics: transfers watched until done (read once each, then dropped), the
        # interval's counters, and where the agent's own counters stood at the last interval.
        self._watch: list[tuple[bool, kvlink.Transfer | kvlink.InboundTransfer]] = []
        self._interval = KvlinkConnectorStats()
        self._agent_metrics: Any = None
        self._last_paths: dict[tuple[str, int], tuple[int, int]] = {}
        self._last_paths_t = 0.0
        self._last_changes = (0, 0)

    # -- set-up ------------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Registers every layer's KV tensor and makes this worker's card.

        Raises:
            kvlink.RegistrationError / kvlink.InvalidArgumentError: a KV layout kvlink cannot
                describe as blocks (the message names the shape).
        """
        if not kv_caches:
            raise kvlink.InvalidArgumentError("register_kv_caches: no KV cache tensors")
        import torch

        name = self.settings.agent_name or f"vllm-{self.engine_id}"[:63]
        self.agent = kvlink.Agent(name, self.config)
        tensors = list(kv_caches.values())
        self.layer_index = {n: i for i, n in enumerate(kv_caches)}
        shape = tuple(tensors[0].shape)
        for n, t in kv_caches.items():
            if tuple(t.shape) != shape or t.dtype != tensors[0].dtype:
                raise kvlink.InvalidArgumentError(
                    f"register_kv_caches: layer {n!r} has shape {tuple(t.shape)} / {t.dtype}, "
                    f"the first layer {shape} / {tensors[0].dtype}: every layer must be alike"
                )
            if not isinstance(t, torch.Tensor) or not t.is_contiguous():
                raise kvlink.InvalidArgumentError(
                    f"register_kv_caches: layer {n!r} is not a contiguous tensor"
                )
        # Where the block axis is, read from the shape (CPU: [blocks, heads, block_size, 2*d];
        # flash-attn: [2, blocks, block_size, heads, d]; MLA: [blocks, block_size, d]).
        num_blocks = self._num_blocks(shape)
        if shape[0] == num_blocks:
            planes = 1
        elif len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
            planes = 2
        else:
            raise kvlink.InvalidArgumentError(
                f"register_kv_caches: KV tensors of shape {shape} have no block axis of "
                f"{num_blocks} blocks first (or after a K/V axis of 2); this layout is not "
                "supported"
            )
        for n, t in kv_caches.items():
            self._regions.append(
                self.agent.register(t, remote_read=True, remote_write=True, name=n[-63:])
            )
        self.layout = kv.PagedLayout.from_tensors(self.agent, tensors, planes=planes)
        # Starts the agent's accounting: its log drain counts path state changes.
        self._agent_metrics = self.agent.metrics()
        # With discovery the card names the agent (etcd has the rest): kv_transfer_params stay
        # small however many regions and addresses the worker has.
        self.card = proto.Card(
            self.agent.name,
            None if self.settings.discovery else self.agent.metadata().decode(),
            self.layout, self.block_size, f"{self.agent.instance_id:016x}",
        )
        log.info(
            "kvlink agent %s: %d layers of %d blocks (%d bytes each, %d planes) on %s",
            name, len(tensors), num_blocks, self.layout.block_bytes, planes,
            ", ".join(f"{h}:{p}" for h, p in self.agent.addresses),
        )

    def _num_blocks(self, shape: tuple[int, ...]) -> int:
        # vLLM's KVCacheConfig says how many blocks there are; without it (older engines) the
        # first axis is taken as the block axis.
        return int(self.num_blocks) if self.num_blocks else int(shape[0])

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    # -- per step ------------------------------------------------------------------------------

    def _peer(self, card: proto.Card) -> str:
        """The peer of ``card``, connected.

        Raises:
            kvlink.ConfigError: a discovery card on an instance without discovery.
            kvlink.PeerUnreachableError: discovery lists another instance of that name (the
                worker restarted since it made the card: the blocks named are not there).
            kvlink.KvlinkError: as add_peer, or a discovery look-up.
        """
        assert self.agent is not None
        if card.metadata is not None:
            return self.agent.add_peer(card.metadata)
        d = self.agent.discovery
        if d is None:
            raise kvlink.ConfigError(
                f"peer {card.agent!r} is published through discovery (its card has no metadata) "
                "but this instance has none: give it the same kv_connector_extra_config"
                "['discovery']"
            )
        assert card.instance is not None  # checked by Card.from_dict
        want = int(card.instance, 16)
        known = {p.name: p for p in self.agent.peers() if p.connected}
        if card.agent not in known or known[card.agent].instance != want:
            # Not connected yet, or to another instance: etcd says which instance is there now.
            rec = d.lookup(card.agent)
            if rec is None:
                raise kvlink.UnknownPeerError(
                    f"peer {card.agent!r}: discovery ({d.url}) lists no agent of that name",
                    peer=card.agent,
                )
            if rec.instance != want:
                raise kvlink.PeerUnreachableError(
                    f"peer {card.agent!r} restarted since it sent its card (instance "
                    f"{card.instance}, discovery lists {rec.instance:016x}): the blocks it named "
                    "are gone", peer=card.agent,
                )
            d.connect(self.agent, rec)
        return card.agent

    def begin_step(self, meta: KvlinkMetadata) -> None:
        """This step's pushes (prefill) and finished requests to hold."""
        now = time.monotonic()
        for push in meta.pushes:
            s = self._sends.setdefault(push.req_id, _Send(push.req_id, now + self.settings.lease_s))
            s.push = push
            s.offer_deadline = now + self.settings.offer_timeout_s
            s.transfer_id, s.decode, s.src_blocks = push.transfer_id, push.decode, push.src_blocks
            self._step_pushes.append(s)
        for hold in meta.holds:
            s = self._sends.setdefault(hold.req_id, _Send(hold.req_id, 0.0))
            s.tag = hold.tag
            if s.transfer_id is None and hold.transfer_id is not None:
                s.transfer_id, s.decode, s.src_blocks = (
                    hold.transfer_id, hold.decode, hold.blocks
                )
            s.expires = now + self.settings.lease_s + self.settings.load_timeout_s

    def start_loads(self, meta: KvlinkMetadata) -> None:
        """Starts this step's loads (decode): pulls, or offers for pushes."""
        assert self.agent is not None and self.layout is not None
        now = time.monotonic()
        self._loads = []
        for job in meta.loads:
            load = _Load(job, now + self.settings.load_timeout_s)
            self._loads.append(load)
            try:
                peer = self._peer(job.source.card)
                if isinstance(job.source, proto.PullSource):
                    if time.time() > job.source.expires:
                        raise kvlink.TransferTimeoutError(
                            "prefill's lease on these blocks has expired (kv_connector_extra_"
                            "config['lease_s'] on prefill; hosts need synchronised clocks)"
                        )
                    load.deadline = now + min(self.settings.load_timeout_s, job.source.max_pull_s)
                    segs = kv.block_segments(
                        job.source.card.layout, self.layout, job.remote_blocks, job.local_blocks
                    )
                    load.pull = self.agent.pull(
                        peer, segments=segs, notify=job.source.tag.encode(),
                        timeout_s=max(0.001, load.deadline - now),
                        instance=proto.instance_of(job.source.card),
                    )
                    self._watch.append((False, load.pull))
                else:
                    offer = proto.make_offer(
                        job.source.transfer_id, job.local_blocks,
                        time.time() + self.settings.load_timeout_s,
                    )
                    self.agent.prepare(
                        peer, layout=offer, timeout_s=self.settings.connect_timeout_s
                    )
            except (kvlink.KvlinkError, ValueError) as exc:
                self._fail(load, f"could not start: {exc}")

    def forward_done(self) -> None:
        if self._step_pushes:
            self.stats.forward_end_t.append(time.monotonic())

    def _fail(self, load: _Load, why: str) -> None:
        if load.failed is None:
            load.failed = why
            self.stats.last_load_failure = why[:500]
            self.stats.load_failures += 1
            self.stats.blocks_failed += len(load.job.local_blocks)
            self._errors.update(load.job.local_blocks)
            log.warning(
                "request %s: loading %d blocks failed (%s); they are reported to vLLM "
                "(kv_load_failure_policy decides: recompute or fail)",
                load.job.req_id, len(load.job.local_blocks), why,
            )

    def wait_layer(self, layer_name: str) -> None:
        i = self.layer_index.get(layer_name)
        if i is None:
            return
        assert self.agent is not None
        for load in self._loads:
            if load.failed is not None:
                continue
            remaining = load.deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise kvlink.TransferTimeoutError(
                        f"no KV within load_timeout_s={self.settings.load_timeout_s}"
                    )
                if load.pull is None:
                    h = load.layer_pushes.get(i)
                    if h is None:
                        h = self._inbound_or_fallback(load, i)
                    if h is not None:
                        self._wait_pushed_layer(load, h)
                        if i == 0:
                            self.stats.layer0_ready_t.append(time.monotonic())
                if load.pull is not None:
                    self._wait_pulled_layer(load, load.pull, i)
                load.layers_waited.add(i)
            except (kvlink.KvlinkError, ValueError) as exc:
                self._fail(load, f"layer {i}: {exc}")

    def _inbound_or_fallback(self, load: _Load, i: int) -> kvlink.InboundTransfer | None:
        """Push load: layer ``i``'s push once prefill announced it; or, while nothing has been
        pushed yet, prefill's fallback answer, which turns the load into a pull (then None).

        Raises:
            kvlink.TransferTimeoutError: neither before the load's deadline.
        """
        assert self.agent is not None
        src = load.job.source
        assert isinstance(src, proto.PushSource)
        tag = proto.layer_tag(src.transfer_id, i)
        while True:
            remaining = load.deadline - time.monotonic()
            if remaining <= 0:
                raise kvlink.TransferTimeoutError(
                    f"prefill pushed nothing within load_timeout_s={self.settings.load_timeout_s}"
                )
            try:
                # Short waits: between them, a fallback answer is looked for.
                h = self.agent.inbound(tag, timeout_s=min(remaining, _FALLBACK_POLL_S))
            except kvlink.TransferTimeoutError:
                self._check_source(load)
                if load.layer_pushes:
                    continue  # layers are arriving: no fallback will come
                self._drain_notifications()
                fb = self._fallbacks.pop(src.transfer_id, None)
                if fb is not None:
                    self._start_fallback_pull(load, fb)
                    return None
                continue
            load.layer_pushes[i] = h
            self._watch.append((False, h))
            return h

    def _wait_pushed_layer(self, load: _Load, h: kvlink.InboundTransfer) -> None:
        """Waits for an announced layer push, in short waits with prefill's paths checked
        between them (a sender that died mid-push sends no failure)."""
        while True:
            remaining = load.deadline - time.monotonic()
            try:
                h.wait(timeout_s=max(0.0, min(remaining, _FALLBACK_POLL_S)))
                return
            except kvlink.TransferTimeoutError:
                if remaining <= _FALLBACK_POLL_S:
                    raise
                self._check_source(load)

    def _wait_pulled_layer(self, load: _Load, pull: kvlink.Transfer, i: int) -> None:
        """Waits for layer ``i`` of a pull, in short waits with prefill's paths checked
        between them: kvlink keeps a pull whose paths are all down waiting for one until its
        deadline (a link flap is no failure), which for a prefill that died is load_timeout_s.

        Raises:
            kvlink.KvlinkError: the pull failed, or as :meth:`_check_source`.
        """
        while True:
            remaining = load.deadline - time.monotonic()
            try:
                pull.wait_layer(i, timeout_s=max(0.0, min(remaining, _FALLBACK_POLL_S)))
                return
            except kvlink.TransferTimeoutError:
                if pull.done:  # it ended meanwhile: its outcome (returns, or raises why)
                    pull.wait_layer(i, timeout_s=0)
                    return
                if remaining <= _FALLBACK_POLL_S:
                    raise
                self._check_source(load)

    def _check_source(self, load: _Load) -> None:
        """Fails a load once every path to its prefill (pushing, or pulled from) has been
        DOWN for connect_timeout_s (prefill killed, or every link cut), instead of holding
        decode's forward pass, and every request in it, until load_timeout_s. A shorter
        outage (a link flap) is waited out: kvlink reconnects and the transfers go on.

        Raises:
            kvlink.PeerUnreachableError: prefill has been unreachable for connect_timeout_s.
        """
        assert self.agent is not None
        name = load.job.source.card.agent
        states = [p.state for p in self.agent.paths() if p.peer == name]
        now = time.monotonic()
        down = (kvlink.PathState.DOWN, kvlink.PathState.PROBING)  # PROBING: reconnecting
        if not states or any(st not in down for st in states):
            load.source_down_since = None
            return
        if load.source_down_since is None:
            load.source_down_since = now
        down_s = now - load.source_down_since
        if down_s >= self.settings.connect_timeout_s:
            self.stats.source_down_failures += 1
            raise kvlink.PeerUnreachableError(
                f"prefill {name!r}: every path to it has been down for {down_s:.1f} s "
                f"(connect_timeout_s={self.settings.connect_timeout_s}): it died or every link "
                "is cut, so its KV will not come", peer=name,
            )

    def _start_fallback_pull(self, load: _Load, fb: proto.Fallback) -> None:
        """Prefill will not push: pull its held blocks into the blocks decode offered."""
        assert self.agent is not None and self.layout is not None
        src = load.job.source
        assert isinstance(src, proto.PushSource)
        if len(fb.blocks) != len(load.job.local_blocks):
            raise kvlink.InvalidArgumentError(
                f"prefill's fallback names {len(fb.blocks)} blocks for the "
                f"{len(load.job.local_blocks)} offered"
            )
        if time.time() > fb.expires:
            raise kvlink.TransferTimeoutError(
                "prefill answered with a fallback whose lease has expired (kv_connector_extra_"
                "config['lease_s'] on prefill)"
            )
        now = time.monotonic()
        load.deadline = min(load.deadline, now + fb.max_pull_s)
        segs = kv.block_segments(src.card.layout, self.layout, fb.blocks, load.job.local_blocks)
        load.pull = self.agent.pull(
            self._peer(src.card), segments=segs, notify=fb.tag.encode(),
            timeout_s=max(0.001, load.deadline - now), instance=proto.instance_of(src.card),
        )
        self._watch.append((False, load.pull))
        self.stats.pull_fallbacks += 1
        log.info("request %s: prefill does not push (transfer %s); pulling its blocks instead",
                 load.job.req_id, src.transfer_id)

    def layer_saved(self, layer_name: str) -> None:
        """Prefill: layer ``layer_name`` of this step is in the cache; push it where decode's
        destination is known."""
        if not self._step_pushes:
            return
        i = self.layer_index.get(layer_name)
        if i is None:
            return
        self._drain_notifications()
        for s in self._step_pushes:
            self._push_layers(s, i + 1)

    def _push_layers(self, s: _Send, upto: int, late: bool = False) -> None:
        """Pushes layers s.layers_pushed .. upto-1 of ``s`` if decode's offer is here."""
        assert self.agent is not None and self.layout is not None
        if s.push is None or s.push_failed or s.layers_pushed >= upto:
            return
        if s.offer is None:
            s.offer = self._offers.pop(s.push.transfer_id, None)
            if s.offer is None:
                return
        tid, dst_blocks, expires = s.offer
        remaining = expires - time.time()
        try:
            if remaining <= 0:
                raise kvlink.TransferTimeoutError("decode's offer expired")
            peer = self._peer(s.push.decode)
            n = len(dst_blocks)
            if n > len(s.push.src_blocks):
                raise kvlink.InvalidArgumentError(
                    f"decode offered {n} blocks for a prompt of {len(s.push.src_blocks)}"
                )
            for layer in range(s.layers_pushed, upto):
                segs = kv.block_segments(
                    self.layout, s.push.decode.layout, s.push.src_blocks[:n], dst_blocks, [layer]
                )
                t = self.agent.push(
                    peer, segments=segs, notify=proto.layer_tag(tid, layer),
                    timeout_s=remaining, instance=proto.instance_of(s.push.decode),
                )
                s.pushes.append(t)
                self._watch.append((True, t))
                self.stats.layers_pushed += 1
                self.stats.layers_pushed_late += late
                s.layers_pushed = layer + 1
        except (kvlink.KvlinkError, ValueError) as exc:
            s.push_failed = True
            self.stats.push_failures += 1
            log.warning("request %s: push to decode failed (%s); blocks held for a pull",
                        s.req_id, exc)

    def _drain_notifications(self) -> None:
        assert self.agent is not None
        for note in self.agent.notifications(timeout_s=0):
            if note.op == kvlink.Op.PULL:
                _bounded_put(self._pulled, note.tag.decode(errors="replace"), None)
            elif note.op == kvlink.Op.PREPARE:
                try:
                    layout = note.prepare_request().get("layout")
                    offer = proto.parse_offer(layout)
                    fallback = proto.parse_fallback(layout)
                except (proto.ParamsError, ValueError) as exc:
                    log.warning("ignored an announcement from %s: %s", note.peer, exc)
                    continue
                if offer is not None:
                    _bounded_put(self._offers, offer[0], offer)
                if fallback is not None:
                    _bounded_put(self._fallbacks, fallback.transfer_id, fallback)
        # Offers and fallbacks nobody claims (a request that never came here, or one that gave
        # up) are dropped once expired.
        now = time.time()
        for tid in [t for t, o in self._offers.items() if o[2] < now]:
            del self._offers[tid]
        for tid in [t for t, f in self._fallbacks.items() if f.expires < now]:
            del self._fallbacks[tid]

    def _answer_offers(self) -> None:
        """Prefill: decode's offers for held blocks that will not be pushed (the push was given
        up before the offer came, or this instance does not push) are answered with a fallback,
        so decode pulls them now instead of waiting for its load_timeout_s."""
        now = time.monotonic()
        for s in self._sends.values():
            if (
                s.transfer_id is None or s.decode is None or s.tag is None or s.fallback_sent
                or s.layers_pushed or (s.push is not None and not s.push_failed)
            ):
                continue
            offer = self._offers.pop(s.transfer_id, None) or s.offer
            if offer is None:
                continue
            s.fallback_sent = True
            n = len(offer[1])
            # Decode starts its pull by then, and it runs at most load_timeout_s: the blocks
            # are held until s.expires, past both.
            start_by = time.time() + (s.expires - now - self.settings.load_timeout_s)
            fb = proto.Fallback(
                s.transfer_id, s.src_blocks[:n], s.tag, start_by, self.settings.load_timeout_s
            )
            try:
                if n > len(s.src_blocks):
                    raise kvlink.InvalidArgumentError(
                        f"decode offered {n} blocks for a prompt of {len(s.src_blocks)}"
                    )
                assert self.agent is not None
                self.agent.prepare(
                    self._peer(s.decode), layout=proto.make_fallback(fb),
                    timeout_s=self.settings.connect_timeout_s,
                )
            except (kvlink.KvlinkError, ValueError) as exc:
                log.warning("request %s: could not answer decode's offer with a fallback to a "
                            "pull (%s); the blocks stay held until the lease ends", s.req_id, exc)
                continue
            self.stats.fallbacks_sent += 1
            log.info("request %s: answered decode's offer with a fallback to a pull", s.req_id)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose held blocks may be freed now."""
        if self.agent is None:
            return set()
        self._finish_loads()
        self._drain_notifications()
        num_layers = len(self.layer_index)
        # A push whose offer came after the forward pass goes out now (the blocks are held).
        now = time.monotonic()
        for s in self._sends.values():
            if s.push is not None and not s.push_failed and s.layers_pushed < num_layers:
                self._push_layers(s, num_layers, late=True)
                if s.offer is None and now > s.offer_deadline:
                    s.push_failed = True
                    self.stats.push_failures += 1
                    log.warning(
                        "request %s: decode sent no destination within offer_timeout_s=%s; "
                        "the push is given up, the blocks stay held for a pull until the lease "
                        "ends (a later offer is answered with a fallback to a pull)",
                        s.req_id, self.settings.offer_timeout_s,
                    )
        self._answer_offers()
        self._step_pushes = []
        done: set[str] = set()
        now = time.monotonic()
        for req_id, s in list(self._sends.items()):
            if s.tag is None:
                continue  # the Hold comes with the next step
            pushes_done = all(t.done for t in s.pushes)
            if s.pushes and pushes_done and not s.push_failed and not all(t.ok for t in s.pushes):
                # A push that failed at decode (a cut link, decode gone): the blocks wait for
                # a pull or the lease, as after any push given up.
                s.push_failed = True
                self.stats.push_failures += 1
                log.warning("request %s: a push to decode failed; the blocks stay held for a "
                            "pull until the lease ends", req_id)
            if s.tag in self._pulled:
                del self._pulled[s.tag]
                reason = None
            elif s.push is not None and s.layers_pushed == num_layers and pushes_done and all(
                t.ok for t in s.pushes
            ):
                reason = None
            elif now >= s.expires and pushes_done:
                reason = "lease expired"
            else:
                continue
            if reason:
                self.stats.leases_expired += 1
                log.warning("request %s: %s; its blocks are freed", req_id, reason)
            else:
                self.stats.handed_off += 1
            del self._sends[req_id]
            done.add(req_id)
        return done

    def _finish_loads(self) -> None:
        """After the forward pass: every load of the step ends (or is failed) here, and no
        failed pull writes into blocks vLLM will reuse."""
        for load in self._loads:
            if load.failed is None and len(load.layers_waited) != len(self.layer_index):
                # The attention of some layer ran without waiting for its KV.
                self._fail(load, f"only layers {sorted(load.layers_waited)} were waited for")
            if load.pull is None and load.failed is None:
                self.stats.blocks_loaded += len(load.job.local_blocks)
            if load.pull is not None:
                try:
                    load.pull.wait(timeout_s=max(0.0, load.deadline - time.monotonic()))
                    if load.failed is None:
                        self.stats.blocks_loaded += len(load.job.local_blocks)
                except kvlink.KvlinkError as exc:
                    self._fail(load, str(exc))
                    # The pull's own deadline is the load deadline: it ends by then.
                    with contextlib.suppress(kvlink.KvlinkError):
                        load.pull.wait(timeout_s=1.0)
        self._loads = []

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- vLLM's metrics ------------------------------------------------------------------------

    def take_interval_stats(self) -> KvlinkConnectorStats | None:
        """The counters since the last call (None when nothing changed), then a new interval.
        Per finished transfer and per path, never per chunk; the paths are read at most once
        a second (the agent refreshes them every monitor interval anyway)."""
        if self.agent is None:
            return None
        st = self._interval
        keep: list[tuple[bool, kvlink.Transfer | kvlink.InboundTransfer]] = []
        for sent, t in self._watch:
            if not t.done:
                keep.append((sent, t))
                continue
            info = t.info()
            if t.ok:
                st.add("transfers_ok", 1)
                st.add("sent_bytes" if sent else "received_bytes", info.bytes_total)
                st.add("sent_chunks" if sent else "received_chunks", info.chunks_total)
                if isinstance(info, kvlink.TransferInfo):
                    if info.t_first_layer_ns:
                        st.observe("first_layer_seconds",
                                   (info.t_first_layer_ns - info.t_submit_ns) / 1e9)
                    st.observe("transfer_seconds", (info.t_done_ns - info.t_submit_ns) / 1e9)
                elif info.t_announce_ns and info.t_done_ns:
                    st.observe("transfer_seconds", (info.t_done_ns - info.t_announce_ns) / 1e9)
            else:
                st.add("transfers_failed", 1)
            if isinstance(info, kvlink.TransferInfo):
                st.add("retries", info.retries)
        self._watch = keep
        now = time.monotonic()
        if now - self._last_paths_t >= 1.0:
            self._last_paths_t = now
            for p in self.agent.paths():
                key = (p.peer, p.index)
                sent0, recv0 = self._last_paths.get(key, (0, 0))
                # A path re-created under the same key starts from zero again.
                st.add("path_sent_bytes", max(0, p.bytes_sent - sent0))
                st.add("path_received_bytes", max(0, p.bytes_recv - recv0))
                self._last_paths[key] = (p.bytes_sent, p.bytes_recv)
            m = self._agent_metrics
            if m is not None:
                changes = list(m.state_changes().items())
                total = sum(n for _, n in changes)
                down = sum(n for k, n in changes if k[3] in ("DOWN", "STALLED"))
                st.add("path_state_changes", max(0, total - self._last_changes[0]))
                st.add("path_down", max(0, down - self._last_changes[1]))
                self._last_changes = (total, down)
        if st.is_empty():
            return None
        self._interval = KvlinkConnectorStats()
        return st
