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
    "sends_fenced": "Prefill requests whose blocks vLLM freed before a hand-off (EOS, a stop, an "
    "abort, a preemption): their pushes were cancelled and waited for before the blocks' reuse",
    "pushes_fenced": "Pushes (one per layer) so cancelled: decode's load of them fails",
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
# Each request's latency broken down (docs/vllm.md, "Where a request's time goes"): the phases
# a joined record carries, per role. Seconds, each side on its own monotonic clock.
PHASES: dict[str, str] = {
    "prefill_queue": "prefill: arrival to first scheduled",
    "prefill_compute": "prefill: first scheduled to the prompt computed (request finished)",
    "first_layer_sent": "prefill, push: forward pass of the last chunk started to layer 0 "
    "verified at decode",
    "kv_sent": "prefill: prompt computed to every rank's blocks handed off (pushed and "
    "verified, or pulled)",
    "decode_admission": "decode: arrival to its KV load started",
    "kv_first_layer": "decode: load started to layer 0 verified on every rank",
    "kv_transfer": "decode: load started to the last layer verified on every rank",
    "decode_first_step": "decode: last layer verified to the forward pass with the first token "
    "done",
}
#: most per-request entries one interval carries (a burst beyond is dropped, counted)
MAX_RECORDS = 1024
#: requests whose phases the last-requests gauge shows, per engine (what `kvlink trace` reads)
LAST_REQUESTS = 32

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 30.0, 60.0)


@dataclasses.dataclass
class KvlinkConnectorStats(KVConnectorStats):
    """One interval of a worker's kvlink counters: ``data`` holds plain ints and lists of
    floats (what vLLM pickles from the worker to its loggers), empty when nothing moved."""

    counters: ClassVar[dict[str, str]] = COUNTERS
    latencies: ClassVar[dict[str, str]] = LATENCIES
    # per-request entries: a worker's timestamps of a request ("req_parts"), and the scheduler
    # side's records joined from them ("req_records")
    records: ClassVar[tuple[str, ...]] = ("req_parts", "req_records")

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:  # rebuilt from another process's data: missing keys read as zero
            for k in self.counters:
                self.data.setdefault(k, 0)
            for k in (*self.latencies, *self.records):
                self.data.setdefault(k, [])

    def reset(self) -> None:
        self.data: dict[str, Any] = {
            **dict.fromkeys(self.counters, 0),
            **{k: [] for k in (*self.latencies, *self.records)},
        }

    def add(self, key: str, n: int) -> None:
        self.data[key] += n

    def observe(self, key: str, seconds: float) -> None:
        self.data[key].append(seconds)

    def record(self, key: str, entry: dict[str, Any]) -> None:
        if len(self.data[key]) < MAX_RECORDS:
            self.data[key].append(entry)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in self.counters:
            self.data[k] += int(other.data.get(k, 0))
        for k in self.latencies:
            self.data[k].extend(other.data.get(k, ()))
        for k in self.records:
            room = MAX_RECORDS - len(self.data[k])
            self.data[k].extend(list(other.data.get(k, ()))[:max(0, room)])
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
            self.data[k] for k in (*self.latencies, *self.records)
        )


class KvlinkPromMetrics(KVConnectorPromMetrics):
    """``kvlink_vllm_*`` counters and histograms, one child per vLLM engine, created through
    the metric classes vLLM passes (its multiprocess-aware ones in a server)."""

    counters: ClassVar[dict[str, str]] = COUNTERS
    latencies: ClassVar[dict[str, str]] = LATENCIES
    records: ClassVar[tuple[str, ...]] = KvlinkConnectorStats.records

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
        self._phases: Any = None
        self._last: Any = None
        self._shown: dict[int, list[tuple[str, ...]]] = {}  # engine -> label sets on the gauge
        if "req_records" in self.records:
            self._phases = self._histogram_cls(
                name="kvlink_vllm_request_phase_seconds",
                documentation="Each P/D request's time by phase (docs/vllm.md); prefill_* and "
                "kv_sent on prefill, the rest on decode",
                labelnames=[*labelnames, "phase"], buckets=BUCKETS)
            self._last = self._gauge_cls(
                name="kvlink_vllm_request_last_phase_seconds",
                documentation=f"The phases of this engine's last {LAST_REQUESTS} P/D requests "
                "(kvlink trace joins prefill's and decode's by xfer); phase t_unix is when the "
                "record was complete",
                labelnames=[*labelnames, "xfer", "request", "role", "phase"],
                multiprocess_mode="mostrecent")

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
        if self._phases is not None:
            for rec in transfer_stats_data.get("req_records", ()):
                self._observe_request(rec, engine_idx)

    def _observe_request(self, rec: dict[str, Any], engine_idx: int) -> None:
        lv = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        shown = self._shown.setdefault(engine_idx, [])
        for phase, seconds in rec["phases"].items():
            self._phases.labels(*lv, phase).observe(seconds)
        for phase, value in [*rec["phases"].items(), ("t_unix", rec["t_unix"])]:
            labels = (*lv, rec["xfer"], rec["request"], rec["role"], phase)
            self._last.labels(*labels).set(value)
            shown.append(labels)
        # Only the last LAST_REQUESTS records stay: the series of older ones are removed.
        while len({lab[-4] for lab in shown}) > LAST_REQUESTS:
            oldest = shown[0][-4]
            for labels in [lab for lab in shown if lab[-4] == oldest]:
                self._last.remove(*labels)
                shown.remove(labels)


@dataclasses.dataclass
class StoreConnectorStats(KvlinkConnectorStats):
    """One interval of KvlinkStoreConnector's counters."""

    counters: ClassVar[dict[str, str]] = STORE_COUNTERS
    latencies: ClassVar[dict[str, str]] = {}
    records: ClassVar[tuple[str, ...]] = ()


class StorePromMetrics(KvlinkPromMetrics):
    """``kvlink_vllm_store_*`` counters, one child per vLLM engine."""

    counters: ClassVar[dict[str, str]] = STORE_COUNTERS
    latencies: ClassVar[dict[str, str]] = {}
    records: ClassVar[tuple[str, ...]] = ()
