"""kvlink's counters through vLLM's own metrics pipeline (docs/vllm.md, "Metrics").

vLLM serves /metrics from its API-server process while the connector's agent lives in a worker,
so the worker hands its interval's counters to vLLM (``get_kv_connector_stats``), vLLM carries
them to its stat loggers (aggregated over workers and steps) and the Prometheus logger observes
them through :class:`KvlinkPromMetrics`, created by ``KvlinkConnector.build_prom_metrics``.

Imports vLLM: only ``_connector`` imports this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# Counters: deltas over the interval. Help texts name the Prometheus metrics (kvlink_vllm_*).
COUNTERS: dict[str, str] = {
    "sent_bytes": "Bytes of pushes this worker sent that finished verified at decode",
    "sent_chunks": "Chunks of pushes this worker sent that finished verified",
    "received_bytes": "Bytes of KV loads (pulls and pushes) that arrived verified here",
    "received_chunks": "Chunks of KV loads that arrived verified here",
    "path_sent_bytes": "Payload bytes on the paths this worker's agent opened: pushes it sent "
    "(hedged and re-sent copies count)",
    "path_received_bytes": "Payload bytes on the paths this worker's agent opened: pulls it "
    "received",
    "transfers_ok": "KV transfers of this worker (pulls, pushes, pushes received) that finished "
    "verified",
    "transfers_failed": "KV transfers of this worker that failed",
    "retries": "Chunk sends beyond the first, of this worker's finished transfers",
    "path_state_changes": "State changes of the agent's paths and control connections",
    "path_down": "Paths or control connections that went DOWN or STALLED",
}
# Observations: seconds, one per finished transfer.
LATENCIES: dict[str, str] = {
    "transfer_seconds": "KV transfers of this worker: submit (or announce) to every byte "
    "verified",
    "first_layer_seconds": "KV transfers this worker initiated: submit to layer 0 verified at "
    "the destination",
}
# kvlink's own latency buckets (kvlink/_metrics.py), kept in step by hand: no import of the
# agent's metrics module here.
# KvlinkStoreConnector's counters (kvlink_vllm_store_*): blocks and bytes per tier.
STORE_COUNTERS: dict[str, str] = {
    "store_hit_blocks_host": "Blocks loads served from the store's host tier",
    "store_hit_blocks_disk": "Blocks loads served from the store's disk tier",
    "store_hit_blocks_remote": "Blocks loads or prefetches pulled from other hosts' stores",
    "store_miss_blocks": "Blocks loads asked for that no store held",
    "store_loaded_blocks": "Blocks loaded into the engine and verified",
    "store_failed_blocks": "Blocks a load could not serve (reported to vLLM, recomputed)",
    "store_saved_blocks": "Blocks of finished requests stored",
    "store_read_bytes_host": "Bytes read from the store's host tier",
    "store_read_bytes_disk": "Bytes read from the store's disk tier",
    "store_read_bytes_remote": "Bytes pulled from other hosts' stores",
    "store_written_bytes_host": "Bytes written to the store's host tier",
    "store_written_bytes_disk": "Bytes written to the store's disk tier",
    "store_evictions_host": "Blocks evicted from the host tier (moved down or dropped)",
    "store_evictions_disk": "Blocks evicted from the disk tier (dropped)",
    "store_discarded_blocks": "Blocks that failed their checks (torn, changed) and were dropped",
    "store_prefetch_missed": "Requests whose prefetch missed its deadline (the rest recomputed)",
}
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 30.0, 60.0)


@dataclasses.dataclass
class KvlinkConnectorStats(KVConnectorStats):
    """One interval of a worker's kvlink counters: ``data`` holds plain ints and lists of
    floats (what vLLM pickles from the worker to its loggers), empty when nothing moved."""

    counters: ClassVar[dict[str, str]] = COUNTERS
    latencies: ClassVar[dict[str, str]] = LATENCIES

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:  # rebuilt from another process's data: missing keys read as zero
            for k in self.counters:
                self.data.setdefault(k, 0)
            for k in self.latencies:
                self.data.setdefault(k, [])

    def reset(self) -> None:
        self.data: dict[str, Any] = {
            **dict.fromkeys(self.counters, 0), **{k: [] for k in self.latencies}
        }

    def add(self, key: str, n: int) -> None:
        self.data[key] += n

    def observe(self, key: str, seconds: float) -> None:
        self.data[key].append(seconds)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in self.counters:
            self.data[k] += int(other.data.get(k, 0))
        for k in self.latencies:
            self.data[k].extend(other.data.get(k, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data[k] for k in self.counters}
        for k in self.latencies:
            obs = self.data[k]
            if obs:
                out[f"avg_{k}"] = round(sum(obs) / len(obs), 6)
                out[f"max_{k}"] = round(max(obs), 6)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in self.counters) and not any(
            self.data[k] for k in self.latencies
        )


class KvlinkPromMetrics(KVConnectorPromMetrics):
    """``kvlink_vllm_*`` counters and histograms, one child per vLLM engine, created through
    the metric classes vLLM passes (its multiprocess-aware ones in a server)."""

    counters: ClassVar[dict[str, str]] = COUNTERS
    latencies: ClassVar[dict[str, str]] = LATENCIES

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        self._histograms: dict[str, dict[int, Any]] = {}
        for k, doc in self.counters.items():
            c = self._counter_cls(name=f"kvlink_vllm_{k}", documentation=doc,
                                  labelnames=labelnames)
            self._counters[k] = self._per_engine(c)
        for k, doc in self.latencies.items():
            h = self._histogram_cls(name=f"kvlink_vllm_{k}", documentation=doc,
                                    labelnames=labelnames, buckets=BUCKETS)
            self._histograms[k] = self._per_engine(h)

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {i: metric.labels(*lv) for i, lv in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, per_engine in self._counters.items():
            n = transfer_stats_data.get(k, 0)
            if n:
                per_engine[engine_idx].inc(n)
        for k, per_engine in self._histograms.items():
            for s in transfer_stats_data.get(k, ()):
                per_engine[engine_idx].observe(s)


@dataclasses.dataclass
class StoreConnectorStats(KvlinkConnectorStats):
    """One interval of KvlinkStoreConnector's counters."""

    counters: ClassVar[dict[str, str]] = STORE_COUNTERS
    latencies: ClassVar[dict[str, str]] = {}


class StorePromMetrics(KvlinkPromMetrics):
    """``kvlink_vllm_store_*`` counters, one child per vLLM engine."""

    counters: ClassVar[dict[str, str]] = STORE_COUNTERS
    latencies: ClassVar[dict[str, str]] = {}
