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

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

import kvlink
from kvlink import kv
from kvlink.integrations.vllm import _protocol as proto
from kvlink.integrations.vllm._bootstrap import BootstrapServer, CardFetcher
from kvlink.integrations.vllm._breakdown import RequestTimes
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


# vLLM's KV cache specs kvlink moves, by kind (docs/vllm.md, "Several KV cache groups").
_FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
_SLIDING_SPECS = ("SlidingWindowSpec", "SlidingWindowMLASpec")


@dataclasses.dataclass(frozen=True)
class KvGroups:
    """The KV cache groups a request's blocks move in: vLLM's ids of the groups that transfer
    (every block list on the wire has one list per group, in this order), their names on the
    cards, and which group each layer belongs to."""

    ids: tuple[int, ...] = (0,)
    names: tuple[str, ...] = proto.FULL_ONLY
    of_layer: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def windowed(self) -> bool:
        """A group keeps only a window of blocks (the others of a request are the null block)."""
        return any(n.startswith("sliding") for n in self.names)

    @classmethod
    def of(cls, kv_cache_config: Any) -> KvGroups:
        """Raises: kvlink.ConfigError for a group of a kind kvlink does not move (Mamba state,
        chunked local attention, ...), naming it."""
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if not groups:
            return cls()
        ids = tuple(getattr(kv_cache_config, "transfer_group_ids", range(len(groups))))
        names: list[str] = []
        of_layer: dict[str, int] = {}
        for i, gid in enumerate(ids):
            g = groups[gid]
            kind = type(g.kv_cache_spec).__name__
            if kind in _SLIDING_SPECS:
                names.append(proto.group_name("sliding", g.kv_cache_spec.sliding_window,
                                              len(g.layer_names)))
            elif kind in _FULL_SPECS or len(groups) == 1:
                # one group: every block of a request is there, whatever the spec
                names.append(proto.group_name("full", None, len(g.layer_names)))
            else:
                raise kvlink.ConfigError(
                    f"KvlinkConnector: KV cache group {gid} ({kind}, layers "
                    f"{list(g.layer_names)[:3]}...) is of a kind kvlink does not move; it moves "
                    f"full-attention, MLA and sliding-window groups"
                )
            of_layer.update(dict.fromkeys(g.layer_names, i))
        if len(names) == 1 and names[0].startswith("full"):
            names = list(proto.FULL_ONLY)
        return cls(ids, tuple(names), of_layer)

    def select(self, block_ids: Any) -> proto.GroupBlocks:
        """vLLM's block ids of every group (a tuple of lists) -> the groups that move."""
        return [list(block_ids[g]) for g in self.ids]


def _nonzero(groups: proto.GroupBlocks) -> list[int]:
    """Every real block of ``groups`` (0 is vLLM's null block)."""
    return [b for g in groups for b in g if b]


def _units(
    names: list[str], tensor_of: dict[str, int], group_of: dict[str, int]
) -> tuple[dict[str, int], list[tuple[int, int]]]:
    """(each layer's unit, each unit's (tensor, group)): a unit per (tensor, group) written,
    numbered in the model's layer order so that every instance of the model numbers them
    alike. Layers of no group that moves get none; layers sharing another's KV (cross-layer
    sharing) share its unit."""
    from vllm.model_executor.models.utils import extract_layer_index

    def order(item: tuple[int, str]) -> tuple[int, int]:
        pos, name = item
        try:
            return int(extract_layer_index(name)), pos
        except (AssertionError, ValueError):
            return pos, pos

    unit_of: dict[tuple[int, int], int] = {}
    layer_index: dict[str, int] = {}
    for _, name in sorted(enumerate(names), key=order):
        g = group_of.get(name, 0 if not group_of else -1)
        if g < 0:
            continue
        layer_index[name] = unit_of.setdefault((tensor_of[name], g), len(unit_of))
    return layer_index, list(unit_of)


def _pairs(group: int, src: list[int], dst: list[int]) -> tuple[list[int], list[int]]:
    """The (source, destination) blocks of one group's positions, where decode holds a block.

    Raises:
        kvlink.InvalidArgumentError: decode needs a position prefill does not hold.
    """
    s_out: list[int] = []
    d_out: list[int] = []
    for i, d in enumerate(dst):
        if not d:
            continue
        s = src[i] if i < len(src) else 0
        if not s:
            raise kvlink.InvalidArgumentError(
                f"KV cache group {group}: decode needs block position {i}, which prefill does "
                "not hold (its window had left it)"
            )
        s_out.append(s)
        d_out.append(d)
    return s_out, d_out


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
    """Decode: load ``local_blocks`` (per KV cache group, positions ``first`` ..) of request
    ``req_id``: in this step's forward pass, or, ``async_load``, while the engine goes on (the
    request waits; reported by get_transfer_results)."""

    req_id: str
    local_blocks: proto.GroupBlocks
    source: proto.PullSource | proto.PushSource
    remote_blocks: proto.GroupBlocks  # pull: the prefill blocks paired with local_blocks
    first: int = 0
    async_load: bool = False


@dataclasses.dataclass
class PushJob:
    """Prefill: this step computes the last of ``req_id``'s prompt; push its blocks."""

    req_id: str
    transfer_id: str
    src_blocks: proto.GroupBlocks
    decode: list[proto.Card] | None  # one per decode rank; None: its offers bring them


@dataclasses.dataclass
class Hold:
    """Prefill: ``req_id`` finished; its blocks stay until decode is done or the lease ends."""

    req_id: str
    tag: str
    # Push requests: decode's offer for this transfer id is answered with a fallback (where
    # ``blocks`` are, for a pull) when the blocks are not pushed.
    transfer_id: str | None = None
    decode: list[proto.Card] | None = None
    blocks: proto.GroupBlocks = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KvlinkMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = dataclasses.field(default_factory=list)
    pushes: list[PushJob] = dataclasses.field(default_factory=list)
    holds: list[Hold] = dataclasses.field(default_factory=list)
    # prefill: requests whose blocks vLLM freed without a Hold (a finish other than the length
    # cap, an abort, a preemption): the worker fences their pushes before this step's forward
    # pass, the first that can write into those blocks again
    drops: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KvlinkHandshake(KVConnectorHandshakeMetadata):
    """A worker's card, handed by vLLM to the scheduler side after register_kv_caches (one
    per tensor-parallel rank)."""

    card: dict[str, Any]


# ---------------------------------------------------------------------------------------------


class KvlinkConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over kvlink (``kv_connector="KvlinkConnector"``,
    ``kv_connector_module_path="kvlink.integrations.vllm"``). It supports vLLM's hybrid KV
    cache manager: a model with several KV cache groups moves every group's blocks.

    Raises:
        kvlink.ConfigError: at construction, for a bad ``kv_connector_extra_config`` or a KV
            cache group kvlink does not move.
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
        groups = KvGroups.of(kv_cache_config)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self.settings, vllm_config, groups, kv_cache_config)
        else:
            num_blocks = getattr(kv_cache_config, "num_blocks", None)
            self._worker = _WorkerSide(self.settings, vllm_config, num_blocks, groups)

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
        sending = self._worker.finished(finished_req_ids)
        return sending, self._worker.async_results()[0]

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Loads that ran while the engine went on (several KV cache groups) end here: a failed
        # one is reported as received and failed (vLLM recomputes or fails it, per policy).
        assert self._worker is not None
        sending = self._worker.finished(finished_req_ids)
        received, failed = self._worker.async_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=received, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- metrics (docs/vllm.md, "Metrics") -----------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Called by vLLM after every step on the worker: the interval's counters, then a fresh
        # interval; on the scheduler side: the requests' breakdowns completed since.
        if self._worker is None:
            assert self._scheduler is not None
            return self._scheduler.times.take_records()
        return self._worker.take_interval_stats()

    def update_connector_output(self, connector_output: Any) -> None:
        # The workers' stats of the step (joined over ranks): their requests' timestamps.
        if self._scheduler is not None:
            self._scheduler.times.add_parts(connector_output.kv_connector_stats)

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

    # -- engine lifecycle (vLLM 0.33's hooks; docs/vllm.md, "vLLM's connector hooks") ------

    @property
    def requires_kv_delivery(self) -> bool:
        # A producer hands KV off: a request preempted while its hand-off is pending must be
        # recomputed, never finished on blocks the preemption freed.
        return bool(self._kv_transfer_config.is_kv_producer)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # Sleep remaps the KV cache under the registered regions and the cards peers hold:
        # refused instead of moving bytes into memory that is no longer the cache.
        return False

    def has_pending_push_work(self) -> bool:
        # Pushes planned for requests still computing their prompt keep the engine stepping;
        # once finished, their held blocks do (vLLM counts requests waiting on a send).
        return self._scheduler is not None and bool(self._scheduler._push)

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
        # vLLM calls this one with its hybrid KV cache manager off (one group).
        assert self._scheduler is not None
        return self._scheduler.finished(request, [list(block_ids)])

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, self._scheduler.groups.select(block_ids))

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A load brings the request's own blocks of every group that transfers.
        assert self._scheduler is not None
        return self._scheduler.groups.ids

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.new_request(request)


# ---------------------------------------------------------------------------------------------


class _SchedulerSide:
    def __init__(self, settings: Settings, vllm_config: VllmConfig, groups: KvGroups,
                 kv_cache_config: Any) -> None:
        tc = vllm_config.kv_transfer_config
        assert tc is not None
        self.settings = settings
        self.groups = groups
        # vLLM reports failed synchronous loads by block id only with one KV cache group:
        # with several, loads run while the engine goes on and fail by request.
        self.async_load = len(getattr(kv_cache_config, "kv_cache_groups", None) or [0]) > 1
        self.engine_id = str(tc.engine_id)
        self.producer = bool(tc.is_kv_producer)
        self.consumer = bool(tc.is_kv_consumer)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        # What peers get to reach this engine: one card, or every rank's (proto.cards_to_wire).
        self.card: dict[str, Any] | list[dict[str, Any]] | None = None
        self.cards: list[proto.Card] = []  # the same, parsed (rank order)
        self._loads: dict[str, LoadJob] = {}
        self._local: dict[str, int] = {}  # req -> locally computed tokens at the match
        self._sources: dict[str, proto.PullSource | proto.PushSource] = {}  # ... its source
        # req -> (request, transfer id, decode's cards: None when its offers bring them)
        self._push: dict[str, tuple[Request, str, list[proto.Card] | None]] = {}
        # vllm-router's push flow: prefill serves its cards, decode fetches prefills' cards
        self._bootstrap: BootstrapServer | None = None
        self._fetcher = CardFetcher(settings.connect_timeout_s)
        self._holds: list[Hold] = []
        # req -> what its push job was, from the job until the request finished: a preempted
        # request pushes again when its prompt is recomputed
        self._pushed: dict[str, tuple[Request, str, list[proto.Card] | None]] = {}
        self._drops: list[str] = []
        self.times = RequestTimes(self.tp_size)

    def set_handshake(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Every rank's card, keyed by tensor-parallel rank (vLLM refuses pipeline ranks > 0
        for connectors that do not say they support them)."""
        if sorted(metadata) != list(range(self.tp_size)):
            raise kvlink.ConfigError(
                f"KvlinkConnector: cards came from ranks {sorted(metadata)}, expected one from "
                f"each of the {self.tp_size} tensor-parallel ranks"
            )
        cards = []
        for rank in range(self.tp_size):
            meta = metadata[rank]
            assert isinstance(meta, KvlinkHandshake)
            cards.append(proto.Card.from_dict(meta.card, f"rank {rank}'s card"))
        self.cards = cards
        self.card = proto.cards_to_wire(cards)
        if self.producer and self.settings.bootstrap_port and self._bootstrap is None:
            self._bootstrap = BootstrapServer(
                self.settings.bootstrap_host, self.settings.bootstrap_port, self.engine_id,
                self.card, [c.agent for c in cards],
            )

    def close(self) -> None:
        if self._bootstrap is not None:
            self._bootstrap.close()
            self._bootstrap = None

    def _decode_source(self, params: dict[str, Any]) -> proto.PullSource | proto.PushSource | None:
        """The load ``params`` ask for; None while prefill's cards are being fetched from its
        bootstrap server (vllm-router's push flow).

        Raises:
            proto.ParamsError: malformed params, or prefill's cards could not be fetched.
        """
        routed = proto.router_push(params)
        if routed is None:
            return proto.parse_decode_params(params)
        tid, addr = routed
        assert addr is not None  # do_remote_prefill is set
        cards = self._fetcher.cards(addr)
        return None if cards is None else proto.PushSource(cards, tid, addr)

    def _allowed(self, mode: Mode) -> bool:
        return self.settings.mode in (Mode.AUTO, mode)

    def new_request(self, request: Request) -> None:
        """Prefill with a sliding-window group: computes all but the prompt's last token.
        vLLM frees a window's blocks for the next token to compute, so a prefill of the whole
        prompt can have freed the block holding token n - window, which decode's computation
        of token n - 1 reads; computing up to token n - 2 keeps exactly decode's window."""
        params = request.kv_transfer_params
        if (not self.groups.windowed or not self.producer or not params
                or not params.get("do_remote_decode") or params.get("kvlink_short")
                or request.num_prompt_tokens < 2 or request.prompt_token_ids is None):
            return
        del request.prompt_token_ids[-1]
        del request._all_token_ids[-1]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["kvlink_short"] = True  # once, also after a preemption

    def matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not self.consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        try:
            src = self._decode_source(params)
        except proto.ParamsError as exc:
            log.error("request %s: %s; computing its prompt here", request.request_id, exc)
            return 0, False
        if src is None:
            return None, False  # asked again next step
        mode = Mode.PUSH if isinstance(src, proto.PushSource) else Mode.PULL
        if not self._allowed(mode):
            log.error(
                "request %s asks for a %s load but kv_connector_extra_config['mode'] is %r; "
                "computing its prompt here", request.request_id, mode.value,
                self.settings.mode.value,
            )
            return 0, False
        if src.cards[0].metadata is None and self.settings.discovery is None:
            log.error(
                "request %s: prefill %r is published through discovery but this instance has "
                "none; computing its prompt here (give it the same kv_connector_extra_config"
                "['discovery'])", request.request_id, src.cards[0].agent,
            )
            return 0, False
        if src.cards[0].block_size != self.block_size:
            log.error(
                "request %s: prefill uses block_size %d, this instance %d; computing its prompt "
                "here (give both instances the same --block-size)",
                request.request_id, src.cards[0].block_size, self.block_size,
            )
            return 0, False
        if self.cards:
            try:  # the two engines' tensor-parallel splits must map onto each other
                proto.pieces(src.cards, self.cards)
            except proto.ParamsError as exc:
                log.error("request %s: %s; computing its prompt here", request.request_id, exc)
                return 0, False
        if isinstance(src, proto.PullSource) and len(src.blocks) != len(self.groups.ids):
            log.error("request %s: prefill sent block ids of %d KV cache groups, this instance "
                      "has %d; computing its prompt here", request.request_id, len(src.blocks),
                      len(self.groups.ids))
            return 0, False
        # The last prompt position is computed here: its logits give the first token.
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        if isinstance(src, proto.PullSource):
            count = min(count, len(src.blocks[0]) * self.block_size - num_computed_tokens)
        if count <= 0 or num_computed_tokens % self.block_size:
            return 0, False
        self._local[request.request_id] = num_computed_tokens
        self._sources[request.request_id] = src
        self.times.seen(request, "decode",
                        src.tag if isinstance(src, proto.PullSource) else src.transfer_id)
        # Loaded synchronously, inside the forward pass that needs it: the attention of layer
        # i waits for layer i only, so layer 0 runs as soon as it is here. With several KV
        # cache groups, while the engine goes on (self.async_load).
        return count, self.async_load

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
            self.times.seen(request, "prefill", push[0] if push else None)
        if num_external_tokens <= 0 or not params.get("do_remote_prefill"):
            return
        src = self._sources.pop(req_id, None)
        if src is None:  # no match of ours: nothing to load
            return
        local_computed = self._local.pop(req_id, 0)
        first = local_computed // self.block_size
        last = math.ceil((local_computed + num_external_tokens) / self.block_size)
        local = [g[first:last] for g in self.groups.select(blocks.get_block_ids())]
        # prefill's whole lists: paired with local's by position (from ``first``)
        remote = src.blocks if isinstance(src, proto.PullSource) else []
        self._loads[req_id] = LoadJob(req_id, local, src, remote, first, self.async_load)
        # Loaded once: after a preemption the request recomputes instead of loading again.
        params["do_remote_prefill"] = False

    def build_meta(self, so: SchedulerOutput, kv_cache_manager: Any) -> KvlinkMetadata:
        for req_id in getattr(so, "preempted_req_ids", None) or ():
            job = self._pushed.pop(req_id, None)
            if job is not None:  # its blocks are gone: fenced now, pushed again once recomputed
                self._drops.append(req_id)
                self._push[req_id] = job
        meta = KvlinkMetadata(loads=list(self._loads.values()), holds=self._holds,
                              drops=self._drops)
        self._loads = {}
        self._holds = []
        self._drops = []
        self.times.scheduled(so.num_scheduled_tokens)
        for req_id, (request, tid, decode) in list(self._push.items()):
            n = so.num_scheduled_tokens.get(req_id, 0)
            if n and request.num_computed_tokens + n >= request.num_prompt_tokens:
                self._pushed[req_id] = self._push.pop(req_id)
                nblocks = math.ceil(request.num_prompt_tokens / self.block_size)
                blocks = [g[:nblocks] for g in
                          self.groups.select(kv_cache_manager.get_block_ids(req_id))]
                meta.pushes.append(PushJob(req_id, tid, blocks, decode))
        return meta

    def finished(
        self, request: Request, block_ids: proto.GroupBlocks
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks of every group that moves."""
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self._push.pop(req_id, None)
        pushed = self._pushed.pop(req_id, None) is not None
        self._loads.pop(req_id, None)
        self._local.pop(req_id, None)
        self._sources.pop(req_id, None)
        params = request.kv_transfer_params
        if params and params.get("kvlink_card_only"):
            # A proxy asking for this instance's card(s) (push mode needs both up front).
            return False, {"kvlink": {"card": self.card}}
        if not self.producer or not params or not params.get("do_remote_decode"):
            return False, None
        if self.card is None:
            log.error("request %s: this worker published no card; nothing to hand off", req_id)
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not _nonzero(block_ids):
            # vLLM frees the blocks now (EOS, a stop token or string, an abort): no push of
            # theirs may read them once they are reused
            if pushed:
                self._drops.append(req_id)
            self.times.forget(req_id)
            return False, None
        tag = f"kvl/{self.engine_id}/{req_id}"
        hold = Hold(req_id, tag)
        try:
            push = proto.parse_prefill_push(params)
        except proto.ParamsError:
            push = None  # logged in after_alloc
        self.times.computed(req_id, push[0] if push else tag)
        if push is not None:
            # Also when this instance does not push (mode "pull"): decode's offer is then
            # answered with a fallback to a pull instead of waiting for decode's timeout.
            hold.transfer_id, hold.decode, hold.blocks = push[0], push[1], block_ids
        self._holds.append(hold)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req_id,
            "remote_block_ids": proto.blocks_to_wire(block_ids),
            "kvlink": {
                "card": self.card,
                "tag": tag,
                # Decode starts no pull after this (unix time); a pull it started runs at most
                # max_pull_s, and the blocks are held until expires + max_pull_s.
                "expires": time.time() + self.settings.lease_s,
                "max_pull_s": self.settings.load_timeout_s,
            },
        }


def _warn_spinning_omp(workers: int) -> None:
    """CPU engines whose workers fill the host's cores: OpenMP's default spin-waiting starves
    kvlink's I/O threads (docs/vllm.md, "Tensor parallelism"); say so once, at start."""
    import os

    from vllm.platforms import current_platform

    cores = os.cpu_count()
    if (current_platform.device_type == "cpu" and workers >= (cores or 1)
            and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"):
        log.warning(
            "kvlink: %d CPU model workers on %s cores with OpenMP's threads spinning "
            "(OMP_WAIT_POLICY is not PASSIVE): they can starve kvlink's transfers for "
            "seconds; set OMP_WAIT_POLICY=PASSIVE in the engine's environment (docs/vllm.md, "
            "\"Tensor parallelism\")", workers, cores,
        )


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (vLLM's process group, set up before the connector)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


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
    # prefill: requests whose blocks vLLM freed before a hand-off (their pushes cancelled and
    # waited for, no late one started), and the pushes so cancelled
    sends_fenced: int = 0
    pushes_fenced: int = 0
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
class _Source:
    """Decode: one prefill rank this rank reads part of a request's blocks from."""

    piece: proto.Piece
    card: proto.Card  # that prefill rank's
    readers: int  # decode ranks reading that prefill rank (it frees once each has pulled)
    pull: kvlink.Transfer | None = None
    layer_pushes: dict[int, kvlink.InboundTransfer] = dataclasses.field(default_factory=dict)
    down_since: float | None = None  # time.monotonic(): every path to it DOWN


@dataclasses.dataclass
class _Load:
    """A load in this step's forward pass (decode side)."""

    job: LoadJob
    deadline: float  # time.monotonic()
    sources: list[_Source] = dataclasses.field(default_factory=list)
    units: set[int] = dataclasses.field(default_factory=set)  # the units with blocks to load
    layers_waited: set[int] = dataclasses.field(default_factory=set)
    failed: str | None = None
    # time.monotonic(): started, layer 0 and the last layer verified (the request's breakdown)
    t_start: float = 0.0
    t_layer0: float | None = None
    t_last: float | None = None


@dataclasses.dataclass
class _Target:
    """Prefill, push: one decode rank this rank pushes (part of) a request's blocks to."""

    piece: proto.Piece
    card: proto.Card  # that decode rank's
    offer: proto.Offer | None = None  # its destination, once it came
    layers_pushed: int = 0  # units 0 .. layers_pushed-1 pushed (or nothing of them to push)
    pushes: list[kvlink.Transfer] = dataclasses.field(default_factory=list)
    failed: bool = False  # the push was given up: the blocks wait for its pull (or the lease)
    fallback_sent: bool = False
    pulled: bool = False  # it pulled instead (after a fallback)

    def done(self, num_layers: int) -> bool:
        return self.pulled or (
            not self.failed and self.layers_pushed == num_layers
            and all(t.done and t.ok for t in self.pushes)
        )


@dataclasses.dataclass
class _Send:
    """A prefill request whose blocks this worker holds (push and/or pull)."""

    req_id: str
    expires: float  # time.monotonic(); the lease
    tag: str | None = None  # known once the Hold arrived (the step after the push job)
    push: PushJob | None = None
    offer_deadline: float = 0.0  # time.monotonic(); push given up without an offer by then
    # push requests (from the PushJob or the Hold): the decode ranks this rank serves
    transfer_id: str | None = None
    targets: dict[int, _Target] | None = None
    decode_from_offers: bool = False  # decode's cards come with its offers (vllm-router)
    src_blocks: proto.GroupBlocks = dataclasses.field(default_factory=list)
    # time.monotonic(): the forward pass computing the prompt's last chunk, with pushes
    t_forward_start: float | None = None
    t_forward_end: float | None = None


class _WorkerSide:
    """Moves the bytes. Its unit of transfer and completion is a *unit*: one KV tensor's
    blocks of one KV cache group (vLLM's layers of different groups share tensors, each in its
    own blocks), numbered in the model's layer order, the same on every instance of a model;
    with one group, a unit is a layer's tensor."""

    def __init__(
        self, settings: Settings, vllm_config: VllmConfig, num_blocks: int | None,
        groups: KvGroups,
    ) -> None:
        tc = vllm_config.kv_transfer_config
        assert tc is not None
        self.settings = settings
        self.groups = groups
        self.vllm_config = vllm_config
        self.engine_id = str(tc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.num_blocks = num_blocks
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.rank = _tp_rank() if self.tp_size > 1 else 0
        if self.rank == 0:
            _warn_spinning_omp(self.tp_size)
        self.config = settings.kvlink_config()
        if self.rank and self.config.metrics_port:
            # Each rank's agent serves its own endpoint: rank r on the port after rank r-1's.
            self.config = dataclasses.replace(
                self.config, metrics_port=self.config.metrics_port + self.rank
            )
        self.agent: kvlink.Agent | None = None
        self.layout: kv.PagedLayout | None = None
        self.card: proto.Card | None = None
        self.layer_index: dict[str, int] = {}  # vLLM's layer name -> unit
        self.units: list[tuple[int, int]] = []  # unit -> (tensor, group)
        self.num_layers = 0  # units
        self._regions: list[kvlink.Region] = []
        self._loads: list[_Load] = []
        self._async: dict[str, _Load] = {}  # loads running while the engine goes on
        self._errors: set[int] = set()
        self._sends: dict[str, _Send] = {}
        self._offers: dict[tuple[str, int], proto.Offer] = {}  # (transfer id, decode rank)
        # decode: (transfer id, prefill rank) -> its answer "pull instead"
        self._fallbacks: dict[tuple[str, int], proto.Fallback] = {}
        # prefill: pull notifications by tag: (readers, the decode ranks that pulled); a
        # release (nobody reads this rank) is (0, {})
        self._pulled: dict[str, tuple[int, set[int]]] = {}
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

        name = self.settings.agent_name or f"vllm-{self.engine_id}"
        if self.tp_size > 1:
            name = f"{name[:58]}-tp{self.rank}"
        name = name[:63]
        # Layers that share another layer's KV (vLLM's cross-layer KV sharing) hand in the same
        # tensor under their own name: it is registered and moved once, as that layer.
        tensors: list[Any] = []
        by_ptr: dict[int, int] = {}
        tensor_of: dict[str, int] = {}
        for n, t in kv_caches.items():
            i = by_ptr.setdefault(int(t.data_ptr()), len(tensors))
            if i == len(tensors):
                tensors.append(t)
            tensor_of[n] = i
        layer_index, units = _units(list(kv_caches), tensor_of, self.groups.of_layer)
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
        self.agent = kvlink.Agent(name, self.config)
        self.layer_index, self.units = layer_index, units
        self.num_layers = len(units)
        names = {i: n for n, i in reversed(tensor_of.items())}  # each tensor's first name
        for i, t in enumerate(tensors):
            self._regions.append(
                self.agent.register(t, remote_read=True, remote_write=True, name=names[i][-63:])
            )
        self.layout = kv.PagedLayout.from_tensors(self.agent, tensors, planes=planes)
        shard = self._shard(shape[planes:], self.layout.block_bytes)
        # Starts the agent's accounting: its log drain counts path state changes.
        self._agent_metrics = self.agent.metrics()
        # With discovery the card names the agent (etcd has the rest): kv_transfer_params stay
        # small however many regions and addresses the worker has.
        self.card = proto.Card(
            self.agent.name,
            None if self.settings.discovery else self.agent.metadata().decode(),
            self.layout, self.block_size, f"{self.agent.instance_id:016x}", shard,
            self.groups.names,
        )
        log.info(
            "kvlink agent %s: %d layers of %d blocks (%d bytes each, %d planes; TP rank %d of "
            "%d, %s; KV cache groups %s) on %s", name, len(tensors), num_blocks,
            self.layout.block_bytes, planes, shard.rank, shard.size,
            "replicated KV" if shard.replicated else f"KV heads {list(shard.heads())}",
            "/".join(self.groups.names), ", ".join(f"{h}:{p}" for h, p in self.agent.addresses),
        )

    def _shard(self, block_shape: tuple[int, ...], block_bytes: int) -> proto.Shard:
        """This rank's part of the model's KV. A block's heads can be cut out (head_bytes > 0)
        when the head axis is the block's outermost: [heads, block_size, ...]."""
        mc = self.vllm_config.model_config
        if getattr(mc, "use_mla", False):
            return proto.Shard(self.rank, self.tp_size, 0, 0, True)
        total = int(mc.get_total_num_kv_heads())
        local = int(mc.get_num_kv_heads(self.vllm_config.parallel_config))
        head_bytes = 0
        if (len(block_shape) >= 2 and block_shape[0] == local and block_shape[1] ==
                self.block_size and (local != self.block_size or len(block_shape) == 3)):
            head_bytes = block_bytes // local
        return proto.Shard(self.rank, self.tp_size, total, head_bytes, False)

    def _engine_cards(self, one: proto.Card) -> list[proto.Card]:
        """Every rank's card of the engine ``one`` belongs to, as far as the mapping of pieces
        needs them: the ranks of an engine hold alike blocks and differ only in their rank."""
        return [
            dataclasses.replace(one, shard=dataclasses.replace(one.shard, rank=r))
            for r in range(one.shard.size)
        ]

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

    def _targets(self, decode: list[proto.Card]) -> dict[int, _Target]:
        """Prefill, push: the decode ranks this rank pushes to, with what each gets.

        Raises:
            proto.ParamsError: the two engines' splits do not map onto each other.
        """
        assert self.card is not None
        return {
            pc.dst_rank: _Target(pc, decode[pc.dst_rank])
            for pc in proto.pieces(self._engine_cards(self.card), decode)
            if pc.src_rank == self.rank
        }

    def begin_step(self, meta: KvlinkMetadata) -> None:
        """This step's pushes (prefill) and finished requests to hold; first, the pushes of
        requests whose blocks vLLM freed are fenced (before the forward pass reuses them)."""
        for req_id in meta.drops:
            self._fence(req_id)
        now = time.monotonic()
        for push in meta.pushes:
            s = self._sends.setdefault(push.req_id, _Send(push.req_id, now + self.settings.lease_s))
            s.push = push
            s.t_forward_start = now
            s.offer_deadline = now + self.settings.offer_timeout_s
            s.transfer_id, s.src_blocks = push.transfer_id, push.src_blocks
            if push.decode is None:
                s.decode_from_offers = True
                self._step_pushes.append(s)
                continue
            try:
                s.targets = self._targets(push.decode)
            except proto.ParamsError as exc:
                log.warning("request %s: %s; its blocks are held for a pull", push.req_id, exc)
                s.push, s.targets = None, None
                continue
            self._step_pushes.append(s)
        for hold in meta.holds:
            s = self._sends.setdefault(hold.req_id, _Send(hold.req_id, 0.0))
            s.tag = hold.tag
            if s.transfer_id is None and hold.transfer_id is not None:
                s.transfer_id, s.src_blocks = hold.transfer_id, hold.blocks
                s.decode_from_offers = hold.decode is None
                try:
                    s.targets = None if hold.decode is None else self._targets(hold.decode)
                except proto.ParamsError:
                    s.targets = None  # logged by the scheduler side's match on decode
            s.expires = now + self.settings.lease_s + self.settings.load_timeout_s

    def _fence(self, req_id: str) -> None:
        """Prefill: vLLM freed ``req_id``'s blocks without a hand-off (the request ended
        before its length cap, was aborted or preempted). Every push still reading them is
        cancelled and waited for (decode's handle fails: it recomputes or fails by its policy,
        never uses what was sent), and no later offer starts one."""
        s = self._sends.pop(req_id, None)
        if s is None:
            return
        pushes = [t for tg in (s.targets or {}).values() for t in tg.pushes]
        running = [t for t in pushes if not t.done]
        why = "prefill's engine freed the request's blocks before handing them off"
        for t in running:
            t.cancel(why)
        for t in running:
            # a chunk half-written to a socket is finished first: a frozen decode holds it
            # until the stall rule cuts the path (seconds), well inside load_timeout_s
            with contextlib.suppress(kvlink.KvlinkError):  # it failed: what a fence asks
                t.wait(timeout_s=self.settings.load_timeout_s)
            if not t.done:
                log.error("request %s: a push of its freed blocks did not stop within "
                          "load_timeout_s=%s (transfer %d); decode's handle of it fails when "
                          "it ends", req_id, self.settings.load_timeout_s, t.id)
        self.stats.sends_fenced += 1
        self.stats.pushes_fenced += len(running)
        self._interval.add("sends_fenced", 1)
        self._interval.add("pushes_fenced", len(running))
        if s in self._step_pushes:
            self._step_pushes.remove(s)
        log.info("request %s ended without a hand-off; %d push(es) of its blocks fenced",
                 req_id, len(running))

    def _sources(self, job: LoadJob) -> list[_Source]:
        """Decode: the prefill ranks this rank reads ``job``'s blocks from. Prefill ranks no
        decode rank reads (replicated KV, fewer decode ranks) are told to free their blocks by
        the decode rank ``p % tp`` (pull: nobody else would).

        Raises:
            proto.ParamsError: the two engines' splits do not map onto each other.
            kvlink.KvlinkError: a release could not be sent.
        """
        assert self.agent is not None and self.card is not None
        cards = job.source.cards
        all_pieces = proto.pieces(cards, self._engine_cards(self.card))
        readers: dict[int, set[int]] = {}
        for pc in all_pieces:
            readers.setdefault(pc.src_rank, set()).add(pc.dst_rank)
        if isinstance(job.source, proto.PullSource):
            for p, card in enumerate(cards):
                if p not in readers and p % self.tp_size == self.rank:
                    self.agent.prepare(self._peer(card), layout=proto.make_release(
                        job.source.tag), timeout_s=self.settings.connect_timeout_s)
        return [
            _Source(pc, cards[pc.src_rank], len(readers[pc.src_rank]))
            for pc in all_pieces if pc.dst_rank == self.rank
        ]

    def _segments(self, src: kv.PagedLayout, dst: kv.PagedLayout, piece: proto.Piece,
                  src_blocks: proto.GroupBlocks, dst_blocks: proto.GroupBlocks,
                  units: Any = None) -> Any:
        """Segments of ``units`` (default: all), each segment's layer its unit: per group,
        block i of ``src_blocks`` goes to block i of ``dst_blocks`` where decode holds one;
        None when none of the units has a block to move.

        Raises:
            kvlink.InvalidArgumentError: decode needs a block prefill does not hold, or
                block lists of another number of groups.
        """
        whole = piece.whole and src.block_bytes == dst.block_bytes == piece.length
        ng = len(self.groups.ids)
        if len(src_blocks) != ng or len(dst_blocks) != ng:
            raise kvlink.InvalidArgumentError(
                f"block ids of {len(src_blocks)} / {len(dst_blocks)} KV cache groups, the model "
                f"has {ng}"
            )
        pairs = [_pairs(g, s, d) for g, (s, d) in enumerate(zip(src_blocks, dst_blocks,
                                                                strict=True))]
        out = []
        for u in range(len(self.units)) if units is None else units:
            tensor, g = self.units[u]
            if not pairs[g][0]:
                continue
            segs = kv.block_segments(
                src, dst, pairs[g][0], pairs[g][1], [tensor],
                piece=None if whole else (piece.src_offset, piece.dst_offset, piece.length),
            )
            segs["layer"] = u
            out.append(segs)
        return np.concatenate(out) if out else None

    def _units_to_load(self, dst_blocks: proto.GroupBlocks) -> set[int]:
        """The units with blocks to load into ``dst_blocks`` (a group of null blocks only:
        none)."""
        return {u for u, (_, g) in enumerate(self.units) if g < len(dst_blocks)
                and any(dst_blocks[g])}

    def _pull(self, load: _Load, src: _Source, blocks: proto.GroupBlocks, tag: str,
              deadline: float) -> None:
        """Starts ``src``'s pull of ``blocks`` (prefill's whole lists, paired with the load's
        by position)."""
        assert self.agent is not None and self.layout is not None
        segs = self._segments(src.card.layout, self.layout, src.piece,
                              [g[load.job.first:] for g in blocks], load.job.local_blocks)
        if segs is None:
            raise kvlink.InvalidArgumentError("the load has no block to move")
        src.pull = self.agent.pull(
            self._peer(src.card), segments=segs,
            notify=proto.pull_note(tag, self.rank, src.readers),
            timeout_s=max(0.001, deadline - time.monotonic()),
            instance=proto.instance_of(src.card),
        )
        self._watch.append((False, src.pull))

    def start_loads(self, meta: KvlinkMetadata) -> None:
        """Starts this step's loads (decode): pulls, or offers for pushes."""
        assert self.agent is not None and self.layout is not None
        now = time.monotonic()
        self._loads = []
        for job in meta.loads:
            load = _Load(job, now + self.settings.load_timeout_s, t_start=now,
                         units=self._units_to_load(job.local_blocks))
            if job.async_load:
                self._async[job.req_id] = load
            else:
                self._loads.append(load)
            try:
                load.sources = self._sources(job)
                if isinstance(job.source, proto.PullSource):
                    if time.time() > job.source.expires:
                        raise kvlink.TransferTimeoutError(
                            "prefill's lease on these blocks has expired (kv_connector_extra_"
                            "config['lease_s'] on prefill; hosts need synchronised clocks)"
                        )
                    load.deadline = now + min(self.settings.load_timeout_s, job.source.max_pull_s)
                    for src in load.sources:
                        self._pull(load, src, job.remote_blocks, job.source.tag, load.deadline)
                else:
                    offer = proto.make_offer(proto.Offer(
                        job.source.transfer_id, self.rank, job.local_blocks,
                        time.time() + self.settings.load_timeout_s, job.first,
                        self.card if job.source.bootstrap is not None else None,
                    ))
                    for src in load.sources:
                        self.agent.prepare(
                            self._peer(src.card), layout=offer,
                            timeout_s=self.settings.connect_timeout_s,
                        )
            except (kvlink.KvlinkError, ValueError) as exc:
                self._fail(load, f"could not start: {exc}")

    def forward_done(self) -> None:
        if self._step_pushes:
            now = time.monotonic()
            self.stats.forward_end_t.append(now)
            for s in self._step_pushes:
                s.t_forward_end = now

    def _fail(self, load: _Load, why: str) -> None:
        if load.failed is None:
            load.failed = why
            self.stats.last_load_failure = why
            self.stats.load_failures += 1
            blocks = _nonzero(load.job.local_blocks)
            self.stats.blocks_failed += len(blocks)
            if not load.job.async_load:  # an async load fails by request (async_results)
                self._errors.update(blocks)
            log.warning(
                "request %s: loading %d blocks failed (%s); they are reported to vLLM "
                "(kv_load_failure_policy decides: recompute or fail)",
                load.job.req_id, len(blocks), why,
            )

    def wait_layer(self, layer_name: str) -> None:
        i = self.layer_index.get(layer_name)
        if i is None:
            return
        assert self.agent is not None
        for load in self._loads:
            if load.failed is not None:
                continue
            if i not in load.units:
                load.layers_waited.add(i)
                continue
            try:
                for src in load.sources:
                    if load.deadline - time.monotonic() <= 0:
                        raise kvlink.TransferTimeoutError(
                            f"no KV within load_timeout_s={self.settings.load_timeout_s}"
                        )
                    if src.pull is None:
                        h = src.layer_pushes.get(i)
                        if h is None:
                            h = self._inbound_or_fallback(load, src, i)
                        if h is not None:
                            self._wait_pushed_layer(load, src, h)
                    if src.pull is not None:
                        self._wait_pulled_layer(load, src, i)
                now = time.monotonic()
                if i == 0 and isinstance(load.job.source, proto.PushSource):
                    self.stats.layer0_ready_t.append(now)
                if i == 0:
                    load.t_layer0 = now
                if i == max(load.units):
                    load.t_last = now
                load.layers_waited.add(i)
            except (kvlink.KvlinkError, ValueError) as exc:
                self._fail(load, f"layer {i}: {exc}")

    def _inbound_or_fallback(
        self, load: _Load, src: _Source, i: int
    ) -> kvlink.InboundTransfer | None:
        """Push load: layer ``i``'s push from ``src`` once it announced it; or, while it has
        pushed nothing yet, its fallback answer, which turns this source into a pull (then
        None).

        Raises:
            kvlink.TransferTimeoutError: neither before the load's deadline.
        """
        assert self.agent is not None
        job_src = load.job.source
        assert isinstance(job_src, proto.PushSource)
        tid, p = job_src.transfer_id, src.piece.src_rank
        tag = proto.layer_tag(tid, p, i)
        while True:
            remaining = load.deadline - time.monotonic()
            if remaining <= 0:
                raise kvlink.TransferTimeoutError(
                    f"prefill rank {p} pushed nothing within load_timeout_s="
                    f"{self.settings.load_timeout_s}"
                )
            try:
                # Short waits: between them, a fallback answer is looked for.
                h = self.agent.inbound(tag, timeout_s=min(remaining, _FALLBACK_POLL_S))
            except kvlink.TransferTimeoutError:
                self._check_source(load, src)
                if src.layer_pushes:
                    continue  # layers are arriving: no fallback will come
                self._drain_notifications()
                fb = self._fallbacks.pop((tid, p), None)
                if fb is not None:
                    self._start_fallback_pull(load, src, fb)
                    return None
                continue
            src.layer_pushes[i] = h
            self._watch.append((False, h))
            return h

    def _wait_pushed_layer(self, load: _Load, src: _Source, h: kvlink.InboundTransfer) -> None:
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
                self._check_source(load, src)

    def _wait_pulled_layer(self, load: _Load, src: _Source, i: int) -> None:
        """Waits for layer ``i`` of ``src``'s pull, in short waits with prefill's paths checked
        between them: kvlink keeps a pull whose paths are all down waiting for one until its
        deadline (a link flap is no failure), which for a prefill that died is load_timeout_s.

        Raises:
            kvlink.KvlinkError: the pull failed, or as :meth:`_check_source`.
        """
        pull = src.pull
        assert pull is not None
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
                self._check_source(load, src)

    def _check_source(self, load: _Load, src: _Source) -> None:
        """Fails a load once every path to one of its prefill ranks (pushing, or pulled from)
        has been DOWN for connect_timeout_s (prefill killed, or every link cut), instead of
        holding decode's forward pass, and every request in it, until load_timeout_s. A shorter
        outage (a link flap) is waited out: kvlink reconnects and the transfers go on.

        Raises:
            kvlink.PeerUnreachableError: prefill has been unreachable for connect_timeout_s.
        """
        assert self.agent is not None
        name = src.card.agent
        states = [p.state for p in self.agent.paths() if p.peer == name]
        now = time.monotonic()
        down = (kvlink.PathState.DOWN, kvlink.PathState.PROBING)  # PROBING: reconnecting
        if not states or any(st not in down for st in states):
            src.down_since = None
            return
        if src.down_since is None:
            src.down_since = now
        down_s = now - src.down_since
        if down_s >= self.settings.connect_timeout_s:
            self.stats.source_down_failures += 1
            raise kvlink.PeerUnreachableError(
                f"prefill {name!r}: every path to it has been down for {down_s:.1f} s "
                f"(connect_timeout_s={self.settings.connect_timeout_s}): it died or every link "
                "is cut, so its KV will not come", peer=name,
            )

    def _start_fallback_pull(self, load: _Load, src: _Source, fb: proto.Fallback) -> None:
        """A prefill rank will not push: pull its held blocks into the blocks decode
        offered."""
        job_src = load.job.source
        assert isinstance(job_src, proto.PushSource)
        if time.time() > fb.expires:
            raise kvlink.TransferTimeoutError(
                "prefill answered with a fallback whose lease has expired (kv_connector_extra_"
                "config['lease_s'] on prefill)"
            )
        load.deadline = min(load.deadline, time.monotonic() + fb.max_pull_s)
        self._pull(load, src, fb.blocks, fb.tag, load.deadline)
        self.stats.pull_fallbacks += 1
        log.info("request %s: prefill rank %d does not push (transfer %s); pulling its blocks "
                 "instead", load.job.req_id, fb.rank, job_src.transfer_id)

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

    def _targets_from_offers(self, s: _Send) -> bool:
        """vllm-router's push flow: the decode ranks of ``s``, known once the first of their
        offers (which carry decode's cards) is here. Whether ``s`` has its targets."""
        if s.targets is not None:
            return True
        if not s.decode_from_offers or s.transfer_id is None:
            return False
        offer = next((o for (tid, _), o in self._offers.items()
                      if tid == s.transfer_id and o.card is not None), None)
        if offer is None or offer.card is None:
            return False
        try:
            s.targets = self._targets(self._engine_cards(offer.card))
        except proto.ParamsError as exc:
            log.warning("request %s: %s; its blocks are held for a pull", s.req_id, exc)
            s.decode_from_offers = False
            return False
        return True

    def _claim_offer(self, s: _Send, d: int, tg: _Target) -> proto.Offer | None:
        """Decode rank ``d``'s offer for ``s``, once it came (its card with it, in
        vllm-router's flow)."""
        if tg.offer is None and s.transfer_id is not None:
            tg.offer = self._offers.pop((s.transfer_id, d), None)
            if tg.offer is not None and s.decode_from_offers:
                if tg.offer.card is None:
                    raise kvlink.InvalidArgumentError(
                        f"decode rank {d}'s offer has no card, and prefill was not given one"
                    )
                tg.card = tg.offer.card
        return tg.offer

    def _push_layers(self, s: _Send, upto: int, late: bool = False) -> None:
        """Pushes layers .. upto-1 of ``s`` to every decode rank whose offer is here."""
        assert self.agent is not None and self.layout is not None
        if s.push is None or not self._targets_from_offers(s) or not s.targets:
            return
        for d, tg in s.targets.items():
            if tg.failed or tg.layers_pushed >= upto:
                continue
            try:
                if self._claim_offer(s, d, tg) is None:
                    continue
            except kvlink.InvalidArgumentError as exc:
                tg.failed = True
                log.warning("request %s: %s; blocks held for a pull", s.req_id, exc)
                continue
            assert tg.offer is not None
            remaining = tg.offer.expires - time.time()
            try:
                if remaining <= 0:
                    raise kvlink.TransferTimeoutError("decode's offer expired")
                peer = self._peer(tg.card)
                tid = s.push.transfer_id
                src_blocks = [g[tg.offer.first:] for g in s.push.src_blocks]
                for layer in range(tg.layers_pushed, upto):
                    segs = self._segments(self.layout, tg.card.layout, tg.piece,
                                          src_blocks, tg.offer.blocks, [layer])
                    if segs is None:  # decode needs no block of this unit
                        tg.layers_pushed = layer + 1
                        continue
                    t = self.agent.push(
                        peer, segments=segs, notify=proto.layer_tag(tid, self.rank, layer),
                        timeout_s=remaining, instance=proto.instance_of(tg.card),
                    )
                    tg.pushes.append(t)
                    self._watch.append((True, t))
                    self.stats.layers_pushed += 1
                    self.stats.layers_pushed_late += late
                    tg.layers_pushed = layer + 1
            except (kvlink.KvlinkError, ValueError) as exc:
                tg.failed = True
                self.stats.push_failures += 1
                log.warning("request %s: push to decode rank %d failed (%s); blocks held for "
                            "a pull", s.req_id, d, exc)

    def _drain_notifications(self) -> None:
        assert self.agent is not None
        for note in self.agent.notifications(timeout_s=0):
            if note.op == kvlink.Op.PULL:
                try:
                    tag, reader, readers = proto.parse_pull_note(
                        note.tag.decode(errors="replace"))
                except proto.ParamsError as exc:
                    log.warning("ignored a pull notification from %s: %s", note.peer, exc)
                    continue
                seen = self._pulled.get(tag, (readers, set()))[1]
                seen.add(reader)
                _bounded_put(self._pulled, tag, (readers, seen))
            elif note.op == kvlink.Op.PREPARE:
                try:
                    layout = note.prepare_request().get("layout")
                    offer = proto.parse_offer(layout)
                    fallback = proto.parse_fallback(layout)
                    release = proto.parse_release(layout)
                except (proto.ParamsError, ValueError) as exc:
                    log.warning("ignored an announcement from %s: %s", note.peer, exc)
                    continue
                if offer is not None:
                    _bounded_put(self._offers, (offer.transfer_id, offer.rank), offer)
                if fallback is not None:
                    _bounded_put(self._fallbacks, (fallback.transfer_id, fallback.rank), fallback)
                if release is not None:
                    _bounded_put(self._pulled, release, (0, set()))
        # Offers and fallbacks nobody claims (a request that never came here, or one that gave
        # up) are dropped once expired.
        now = time.time()
        for key in [k for k, o in self._offers.items() if o.expires < now]:
            del self._offers[key]
        for key in [k for k, f in self._fallbacks.items() if f.expires < now]:
            del self._fallbacks[key]

    def _answer_offers(self) -> None:
        """Prefill: decode's offers for held blocks that will not be pushed (the push was given
        up before the offer came, or this instance does not push) are answered with a fallback,
        so decode pulls them now instead of waiting for its load_timeout_s."""
        now = time.monotonic()
        for s in self._sends.values():
            if s.transfer_id is None or s.tag is None or not self._targets_from_offers(s):
                continue
            assert s.targets is not None
            for d, tg in s.targets.items():
                if tg.fallback_sent or tg.layers_pushed or (s.push is not None and not tg.failed):
                    continue
                try:
                    offer = self._claim_offer(s, d, tg)
                except kvlink.InvalidArgumentError:
                    continue
                if offer is None:
                    continue
                tg.fallback_sent = True
                # Decode starts its pull by then, and it runs at most load_timeout_s: the
                # blocks are held until s.expires, past both.
                start_by = time.time() + (s.expires - now - self.settings.load_timeout_s)
                fb = proto.Fallback(s.transfer_id, self.rank, s.src_blocks, s.tag, start_by,
                                    self.settings.load_timeout_s)
                try:
                    assert self.agent is not None
                    self.agent.prepare(
                        self._peer(tg.card), layout=proto.make_fallback(fb),
                        timeout_s=self.settings.connect_timeout_s,
                    )
                except (kvlink.KvlinkError, ValueError) as exc:
                    log.warning("request %s: could not answer decode rank %d's offer with a "
                                "fallback to a pull (%s); the blocks stay held until the lease "
                                "ends", s.req_id, d, exc)
                    continue
                self.stats.fallbacks_sent += 1
                log.info("request %s: answered decode rank %d's offer with a fallback to a pull",
                         s.req_id, d)

    def _handed_off(self, s: _Send, num_layers: int) -> bool:
        """Whether every decode rank that reads this rank's blocks of ``s`` has them."""
        assert s.tag is not None
        readers, seen = self._pulled.get(s.tag, (None, set()))
        if readers == 0:
            return True  # released: no decode rank reads this rank
        if s.targets is not None:
            for d in seen:
                if d in s.targets:
                    s.targets[d].pulled = True
            return all(tg.done(num_layers) for tg in s.targets.values())
        return readers is not None and len(seen) >= readers

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose held blocks may be freed now."""
        if self.agent is None:
            return set()
        self._finish_loads()
        self._drain_notifications()
        num_layers = self.num_layers
        # A push whose offer came after the forward pass goes out now (the blocks are held).
        now = time.monotonic()
        for s in self._sends.values():
            if s.push is None:
                continue
            self._push_layers(s, num_layers, late=True)
            for d, tg in (s.targets or {}).items():
                if tg.offer is None and not tg.failed and now > s.offer_deadline:
                    tg.failed = True
                    self.stats.push_failures += 1
                    log.warning(
                        "request %s: decode rank %d sent no destination within offer_timeout_s="
                        "%s; the push is given up, the blocks stay held for a pull until the "
                        "lease ends (a later offer is answered with a fallback to a pull)",
                        s.req_id, d, self.settings.offer_timeout_s,
                    )
        self._answer_offers()
        self._step_pushes = []
        done: set[str] = set()
        now = time.monotonic()
        for req_id, s in list(self._sends.items()):
            if s.tag is None:
                continue  # the Hold comes with the next step
            pushes = [t for tg in (s.targets or {}).values() for t in tg.pushes]
            pushes_done = all(t.done for t in pushes)
            for d, tg in (s.targets or {}).items():
                if (not tg.failed and tg.pushes and all(t.done for t in tg.pushes)
                        and not all(t.ok for t in tg.pushes)):
                    # A push that failed at decode (a cut link, decode gone): the blocks wait
                    # for a pull or the lease, as after any push given up.
                    tg.failed = True
                    self.stats.push_failures += 1
                    log.warning("request %s: a push to decode rank %d failed; the blocks stay "
                                "held for a pull until the lease ends", req_id, d)
            if self._handed_off(s, num_layers) and pushes_done:
                reason = None
            elif now >= s.expires and pushes_done:
                reason = "lease expired"
            else:
                continue
            self._pulled.pop(s.tag, None)
            done_t = [t.info() for tg in (s.targets or {}).values() for t in tg.pushes[:1]]
            last_t = [t.info() for tg in (s.targets or {}).values() for t in tg.pushes[-1:]]
            self._interval.record("req_parts", {
                "req": req_id, "rank": self.rank, "ok": reason is None,
                "fs": s.t_forward_start, "fe": s.t_forward_end,
                # layer 0 and the last layer verified at decode (kvlink's clock is
                # CLOCK_MONOTONIC, as time.monotonic())
                "l0": max((i.t_done_ns / 1e9 for i in done_t), default=None),
                "ln": max((i.t_done_ns / 1e9 for i in last_t), default=None),
                "end": now,
            })
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
            if load.failed is None and not load.units <= load.layers_waited:
                # The attention of some layer ran without waiting for its KV.
                self._fail(load, f"only layers {sorted(load.layers_waited)} were waited for")
            for src in load.sources:
                if src.pull is None:
                    continue
                try:
                    src.pull.wait(timeout_s=max(0.0, load.deadline - time.monotonic()))
                except kvlink.KvlinkError as exc:
                    self._fail(load, str(exc))
                    # The pull's own deadline is the load deadline: it ends by then.
                    with contextlib.suppress(kvlink.KvlinkError):
                        src.pull.wait(timeout_s=1.0)
            self._loaded(load)
        self._loads = []

    def _loaded(self, load: _Load) -> None:
        """Counts an ended load and records its times (the request's breakdown)."""
        if load.failed is None:
            self.stats.blocks_loaded += len(_nonzero(load.job.local_blocks))
        job_src = load.job.source
        self._interval.record("req_parts", {
            "req": load.job.req_id, "rank": self.rank, "ok": load.failed is None,
            "xfer": (job_src.tag if isinstance(job_src, proto.PullSource)
                     else job_src.transfer_id),
            "t0": load.t_start, "l0": load.t_layer0, "ln": load.t_last,
            "end": time.monotonic(),
        })

    def async_results(self) -> tuple[set[str], set[str]]:
        """(ended, failed) loads that run while the engine goes on (several KV cache groups):
        every request of ``failed`` is also in ``ended``. A load ends once nothing of it is
        in flight any more, so a failed one writes nothing into blocks vLLM then reuses."""
        ended: set[str] = set()
        failed: set[str] = set()
        if not self._async or self.agent is None:
            return ended, failed
        self._drain_notifications()
        for req_id, load in list(self._async.items()):
            if not self._poll(load):
                continue
            del self._async[req_id]
            self._loaded(load)
            ended.add(req_id)
            if load.failed is not None:
                failed.add(req_id)
        return ended, failed

    def _poll(self, load: _Load) -> bool:
        """Moves an async load on without waiting: claims the layers pushed so far (or
        prefill's fallback), checks prefill's paths and the deadline. Whether it ended."""
        now = time.monotonic()
        if load.failed is None:
            try:
                if now >= load.deadline:
                    raise kvlink.TransferTimeoutError(
                        f"no KV within load_timeout_s={self.settings.load_timeout_s}"
                    )
                for src in load.sources:
                    if src.pull is None:
                        self._claim_pushes(load, src)
                    self._check_source(load, src)
            except (kvlink.KvlinkError, ValueError) as exc:
                self._fail(load, str(exc))
        transfers = [t for src in load.sources
                     for t in ([src.pull] if src.pull is not None else
                               list(src.layer_pushes.values()))]
        if any(not t.done for t in transfers):
            return False  # also after a failure: until nothing writes into the blocks
        if load.failed is None:
            for t in transfers:
                if not t.ok:
                    try:
                        t.wait(timeout_s=0)
                    except kvlink.KvlinkError as exc:
                        self._fail(load, str(exc))
                        break
            else:
                complete = all(src.pull is not None or set(src.layer_pushes) >= load.units
                               for src in load.sources)
                if not complete:
                    return False
                load.t_layer0 = load.t_last = now
        return True

    def _claim_pushes(self, load: _Load, src: _Source) -> None:
        """Async push load: the layer pushes of ``src`` announced so far; or, while it has
        pushed nothing, its fallback answer, which turns ``src`` into a pull."""
        assert self.agent is not None
        job_src = load.job.source
        assert isinstance(job_src, proto.PushSource)
        tid, p = job_src.transfer_id, src.piece.src_rank
        for u in sorted(load.units - set(src.layer_pushes)):
            try:
                h = self.agent.inbound(proto.layer_tag(tid, p, u), timeout_s=0)
            except kvlink.TransferTimeoutError:
                continue
            src.layer_pushes[u] = h
            self._watch.append((False, h))
        if not src.layer_pushes:
            fb = self._fallbacks.pop((tid, p), None)
            if fb is not None:
                self._start_fallback_pull(load, src, fb)

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
