"""kvlink's counters through vLLM's own metrics pipeline (docs/vllm.md, "Metrics").

vLLM serves /metrics from its API-server process while the connector's agent lives in a worker,
so the worker hands its interval's counters to vLLM (``get_kv_connector_stats``), vLLM carries
them to its stat loggers (aggregated over workers and steps) and the Prometheus logger observes
them through :class:`KvlinkPromMetrics`, created by ``KvlinkConnector.build_prom_metrics``.

Imports vLLM: only ``_connector`` imports this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 30.0, 60.0)


@dataclasses.dataclass
class KvlinkConnectorStats(KVConnectorStats):
    """One interval of a worker's kvlink counters: ``data`` holds plain ints and lists of
    floats (what vLLM pickles from the worker to its loggers), empty when nothing moved."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:  # rebuilt from another process's data: missing keys read as zero
            for k in COUNTERS:
                self.data.setdefault(k, 0)
            for k in LATENCIES:
                self.data.setdefault(k, [])

    def reset(self) -> None:
        self.data: dict[str, Any] = {
            **dict.fromkeys(COUNTERS, 0), **{k: [] for k in LATENCIES}
        }

    def add(self, key: str, n: int) -> None:
        self.data[key] += n

    def observe(self, key: str, seconds: float) -> None:
        self.data[key].append(seconds)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in COUNTERS:
            self.data[k] += int(other.data.get(k, 0))
        for k in LATENCIES:
            self.data[k].extend(other.data.get(k, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data[k] for k in COUNTERS}
        for k in LATENCIES:
            obs = self.data[k]
            if obs:
                out[f"avg_{k}"] = round(sum(obs) / len(obs), 6)
                out[f"max_{k}"] = round(max(obs), 6)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in COUNTERS) and not any(
            self.data[k] for k in LATENCIES
        )


class KvlinkPromMetrics(KVConnectorPromMetrics):
    """``kvlink_vllm_*`` counters and histograms, one child per vLLM engine, created through
    the metric classes vLLM passes (its multiprocess-aware ones in a server)."""

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
        for k, doc in COUNTERS.items():
            c = self._counter_cls(name=f"kvlink_vllm_{k}", documentation=doc,
                                  labelnames=labelnames)
            self._counters[k] = self._per_engine(c)
        for k, doc in LATENCIES.items():
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
