"""Prometheus metrics of one agent (docs/cluster.md lists them).

Nothing here runs per chunk.  What the C core already keeps is read when
Prometheus scrapes: path snapshots (``kvl_paths``: bytes, chunks, in-flight,
rates, RTT, competing NIC traffic, reconnects, hedges, state).  What it
tells through its log ring (path state changes with their reasons, retries,
cancels, checksum failures, failed transfers) is counted as the log drain
hands each record on: those are rare events, not per-chunk work.  Transfers
are accounted per transfer: a submit appends the handle to a list, and the
scrape (or a later submit, once the list is long) reads the finished ones'
timestamps, which the C core took, so when they are read changes nothing.

:class:`AgentMetrics` is a ``prometheus_client`` collector: register it with
any registry (``registry.register(agent.metrics())``), or let
``Config(metrics_port=...)`` serve it over HTTP.
"""

from __future__ import annotations

import re
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ._errors import ConfigError, KvlinkError, error_for
from ._types import PathState, TransferState

if TYPE_CHECKING:
    from ._agent import Agent
    from ._inbound import InboundTransfer
    from ._native import LogRecord
    from ._transfer import Transfer

# submit -> verified of transfers from a few KiB to several GiB on fast or slow links
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
SWEEP_AT = 64  # live transfers kept before a submit sweeps the finished ones out
MAX_REASONS = 256  # distinct state-change reasons kept as labels; the rest count as "other"

_STATE_RE = re.compile(
    r"^(path|control connection) \S+ -> \S+: ([A-Z]+) -> ([A-Z]+)(?:: (.*))?$", re.S
)
_NUMBER_RE = re.compile(r"\d+(\.\d+)?")
_TRANSFER_FAILED_RE = re.compile(r"^transfer \d+ failed: ")


def _reason(why: str) -> str:
    """A state change's reason as a label: numbers blanked so one cause is one series."""
    return _NUMBER_RE.sub("N", why.strip())[:80] or "none"


class AgentMetrics(Collector):
    """Every metric of one agent, read at scrape time."""

    def __init__(self, agent: Agent) -> None:
        self._agent = weakref.ref(agent)
        self.name = agent.name
        self._lock = threading.Lock()
        self._live: list[Transfer] = []
        self._inbound: list[InboundTransfer] = []
        self._sweep_at = SWEEP_AT  # doubles while most tracked transfers are running
        # what the log drain counts, keyed by label values
        self._state_changes: dict[tuple[str, str, str, str, str], int] = {}
        self._retries: dict[str, int] = {}
        self._checksum: dict[str, int] = {}
        self._cancels: dict[str, int] = {}
        self._hedge_logs: dict[str, int] = {}
        self._failed_logs: dict[str, int] = {}
        self._dropped = 0
        self._notifications: dict[str, int] = {}
        # histograms and counters prometheus_client keeps; in a registry of
        # their own so they reach a scrape only through this collector
        own = CollectorRegistry(auto_describe=False)
        labels = ["agent", "op"]
        self._seconds = Histogram(
            "kvlink_transfer_seconds",
            "Transfers this agent initiated: submit to every byte verified at the destination",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self._first = Histogram(
            "kvlink_transfer_first_chunk_seconds",
            "Submit to the first verified chunk (chunks are planned layer-major, so this is "
            "when the first layer starts to be usable)",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self._first_layer = Histogram(
            "kvlink_transfer_first_layer_seconds",
            "Submit to every chunk of layer 0 verified at the destination: when the receiver "
            "can start on the first layer",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self._transfers = Counter(
            "kvlink_transfers",
            "Transfers this agent initiated, by outcome",
            ["agent", "op", "peer", "outcome"],
            registry=own,
        )
        self._bytes = Counter(
            "kvlink_transfer_bytes",
            "Bytes of the transfers that finished verified",
            ["agent", "op", "peer"],
            registry=own,
        )
        self._xretries = Counter(
            "kvlink_transfer_retries",
            "Chunk sends beyond the first, of finished transfers",
            ["agent", "peer"],
            registry=own,
        )
        self._in_seconds = Histogram(
            "kvlink_inbound_seconds",
            "Pushes received through Agent.inbound() handles: announced to every byte verified "
            "here",
            ["agent"], buckets=LATENCY_BUCKETS, registry=own,
        )
        self._in_transfers = Counter(
            "kvlink_inbound_transfers",
            "Pushes received through Agent.inbound() handles, by sender and outcome",
            ["agent", "peer", "outcome"], registry=own,
        )
        self._in_bytes = Counter(
            "kvlink_inbound_bytes",
            "Bytes of pushes received through Agent.inbound() handles, verified here",
            ["agent", "peer"], registry=own,
        )
        self._own = own

    # ---- feeding -----------------------------------------------------------

    def track(self, t: Transfer) -> None:
        """A transfer was submitted (called once per transfer, never per chunk)."""
        with self._lock:
            self._live.append(t)
            sweep = len(self._live) >= self._sweep_at
        if sweep:
            self.sweep()

    def track_inbound(self, h: InboundTransfer) -> None:
        """The application took the handle of a push arriving here (once per push)."""
        with self._lock:
            self._inbound.append(h)
            sweep = len(self._inbound) >= self._sweep_at
        if sweep:
            self.sweep()

    def _sweep_inbound(self) -> None:
        with self._lock:
            live, self._inbound = self._inbound, []
        keep = []
        for h in live:
            try:
                i = h.info()
            except KvlinkError:
                continue
            if i.state == TransferState.RUNNING:
                keep.append(h)
                continue
            if i.state == TransferState.DONE:
                self._in_seconds.labels(self.name).observe(
                    max(0, i.t_done_ns - i.t_announce_ns) / 1e9
                )
                self._in_bytes.labels(self.name, i.peer).inc(i.bytes_total)
                outcome = "ok"
            else:
                outcome = type(error_for(i.error_code, "", transfer=True)).__name__
            self._in_transfers.labels(self.name, i.peer, outcome).inc()
        with self._lock:
            self._inbound[:0] = keep

    def sweep(self) -> None:
        """Accounts the transfers that finished since the last sweep."""
        self._sweep_inbound()
        with self._lock:
            live, self._live = self._live, []
        keep = []
        for t in live:
            try:
                i = t.info()
            except KvlinkError:
                continue
            if i.state == TransferState.RUNNING:
                keep.append(t)
                continue
            op = t.op.name.lower()
            if i.t_first_byte_ns and i.t_first_byte_ns >= i.t_submit_ns:
                self._first.labels(self.name, op).observe((i.t_first_byte_ns - i.t_submit_ns) / 1e9)
            if i.t_first_layer_ns and i.t_first_layer_ns >= i.t_submit_ns:
                first_layer = (i.t_first_layer_ns - i.t_submit_ns) / 1e9
                self._first_layer.labels(self.name, op).observe(first_layer)
            if i.state == TransferState.DONE:
                self._seconds.labels(self.name, op).observe((i.t_done_ns - i.t_submit_ns) / 1e9)
                self._bytes.labels(self.name, op, t.peer).inc(i.bytes_total)
                outcome = "ok"
            else:
                outcome = type(error_for(i.error_code, "", transfer=True)).__name__
            self._transfers.labels(self.name, op, t.peer, outcome).inc()
            if i.retries:
                self._xretries.labels(self.name, t.peer).inc(i.retries)
        with self._lock:
            self._live[:0] = keep
            # thousands running at once must not make every submit sweep them all
            self._sweep_at = max(SWEEP_AT, 2 * len(self._live), 2 * len(self._inbound))

    def on_log(self, rec: LogRecord) -> None:
        """Counts what a log record reports (called by the log drain)."""
        peer, msg = rec.peer, rec.msg
        with self._lock:
            self._dropped += rec.dropped
            m = _STATE_RE.match(msg)
            if m:
                path = "control" if m.group(1) != "path" else str(rec.path)
                key = (peer, path, m.group(2), m.group(3), _reason(m.group(4) or ""))
                if key not in self._state_changes and len(self._state_changes) >= MAX_REASONS:
                    key = (*key[:4], "other")
                self._state_changes[key] = self._state_changes.get(key, 0) + 1
            elif msg.startswith("retry: "):
                self._retries[peer] = self._retries.get(peer, 0) + 1
                if "crc32c mismatch" in msg:
                    self._checksum[peer] = self._checksum.get(peer, 0) + 1
            elif msg.startswith("cancel: "):
                self._cancels[peer] = self._cancels.get(peer, 0) + 1
            elif msg.startswith("hedge: "):
                self._hedge_logs[peer] = self._hedge_logs.get(peer, 0) + 1
            elif _TRANSFER_FAILED_RE.match(msg):
                self._failed_logs[peer] = self._failed_logs.get(peer, 0) + 1
                if "crc32c" in msg:
                    self._checksum[peer] = self._checksum.get(peer, 0) + 1

    def state_changes(self) -> dict[tuple[str, str, str, str, str], int]:
        """Path and control-connection state changes counted so far, keyed by (peer, path,
        from state, to state, reason); a copy, safe to read from any thread."""
        with self._lock:
            return dict(self._state_changes)

    def notified(self, peer: str, n: int = 1) -> None:
        with self._lock:
            self._notifications[peer] = self._notifications.get(peer, 0) + n

    # ---- scraping ----------------------------------------------------------

    def describe(self) -> list[Any]:
        return []  # no describe at registration: that would scrape the agent

    def collect(self) -> Iterator[Any]:
        agent = self._agent()
        up = GaugeMetricFamily("kvlink_agent_up", "1 while the agent is open", labels=["agent"])
        if agent is None or agent.closed:
            up.add_metric([self.name], 0)
            yield up
            return
        try:
            paths = agent.paths()
            peers = agent.peers()
        except KvlinkError:  # closed meanwhile
            up.add_metric([self.name], 0)
            yield up
            return
        up.add_metric([self.name], 1)
        yield up
        self.sweep()
        yield from self._path_families(paths)
        yield from self._agent_families(agent, paths, peers)
        yield from self._own.collect()

    def _path_families(self, paths: list[Any]) -> Iterator[Any]:
        # relay: "" for a direct path, else "NAME@HOST:PORT" (hop one local -> it, hop two it ->
        # remote: docs/relays.md)
        labels = ["agent", "peer", "path", "local", "remote", "relay"]

        def fam(kind: type, name: str, doc: str) -> Any:
            return kind(name, doc, labels=labels)

        sent = fam(CounterMetricFamily, "kvlink_path_sent_bytes", "Payload bytes sent on the path")
        recv = fam(
            CounterMetricFamily, "kvlink_path_received_bytes", "Payload bytes received on the path"
        )
        chunks = fam(
            CounterMetricFamily,
            "kvlink_path_chunks",
            "Chunks this agent initiated that completed on the path",
        )
        hedges = fam(CounterMetricFamily, "kvlink_path_hedges", "Straggler copies sent on the path")
        reconnects = fam(
            CounterMetricFamily,
            "kvlink_path_reconnects",
            "Times the path was re-established after going down",
        )
        inflight = fam(GaugeMetricFamily, "kvlink_path_inflight_bytes", "Bytes in flight")
        rate = fam(
            GaugeMetricFamily,
            "kvlink_path_rate_bytes_per_second",
            "Estimated rate (EWMA of the busy-period delivery rate)",
        )
        delivery = fam(
            GaugeMetricFamily,
            "kvlink_path_delivery_bytes_per_second",
            "The kernel's latest delivery-rate sample (TCP_INFO)",
        )
        rtt = fam(
            GaugeMetricFamily,
            "kvlink_path_rtt_seconds",
            "Smoothed RTT (TCP_INFO while busy, probes while idle)",
        )
        other = fam(
            GaugeMetricFamily,
            "kvlink_path_nic_competing_bytes_per_second",
            "Traffic on the path's local NIC that is not kvlink's",
        )
        stall = fam(
            GaugeMetricFamily, "kvlink_path_stall_seconds", "Time without progress while busy"
        )
        state = GaugeMetricFamily(
            "kvlink_path_state", "1 for the path's current state", labels=[*labels, "state"]
        )
        for p in paths:
            relay = f"{p.relay}@{p.relay_addr}" if p.relay else ""
            lv = [self.name, p.peer, str(p.index), p.local, p.remote, relay]
            sent.add_metric(lv, p.bytes_sent)
            recv.add_metric(lv, p.bytes_recv)
            chunks.add_metric(lv, p.chunks_done)
            hedges.add_metric(lv, p.hedges)
            reconnects.add_metric(lv, p.reconnects)
            inflight.add_metric(lv, p.inflight_bytes)
            rate.add_metric(lv, p.est_gbps * 1e9)
            delivery.add_metric(lv, p.delivery_gbps * 1e9)
            rtt.add_metric(lv, p.rtt_us / 1e6)
            other.add_metric(lv, p.nic_other_gbps * 1e9)
            stall.add_metric(lv, p.stall_ms / 1e3)
            for s in PathState:
                state.add_metric([*lv, s.name], 1.0 if p.state == s else 0.0)
        yield from (
            sent,
            recv,
            chunks,
            hedges,
            reconnects,
            inflight,
            rate,
            delivery,
            rtt,
            other,
            stall,
            state,
        )

    def _agent_families(self, agent: Agent, paths: list[Any], peers: list[Any]) -> Iterator[Any]:
        with self._lock:
            changes = dict(self._state_changes)
            per_peer = {
                "kvlink_chunk_failures": (
                    self._retries,
                    "Chunk sends that failed (connection lost, checksum) and were sent again; "
                    "kvlink_transfer_retries also counts re-sends after a stall cut",
                ),
                "kvlink_checksum_failures": (
                    self._checksum,
                    "Chunks that failed their crc32c check at the receiver",
                ),
                "kvlink_cancels": (
                    self._cancels,
                    "Copies cancelled because another copy of the chunk won",
                ),
                "kvlink_hedges": (self._hedge_logs, "Straggler copies sent (hedges)"),
                "kvlink_transfer_failures": (self._failed_logs, "Transfers that failed"),
                "kvlink_notifications": (
                    self._notifications,
                    "Notifications this agent's application took",
                ),
            }
            per_peer = {k: (dict(v), d) for k, (v, d) in per_peer.items()}
            dropped = self._dropped
        sc = CounterMetricFamily(
            "kvlink_path_state_changes",
            "Path state changes, with their reasons",
            labels=["agent", "peer", "path", "from_state", "to_state", "reason"],
        )
        for (peer, path, old, new, why), n in sorted(changes.items()):
            sc.add_metric([self.name, peer, path, old, new, why], n)
        yield sc
        for name, (values, doc) in per_peer.items():
            c = CounterMetricFamily(name, doc, labels=["agent", "peer"])
            for peer, n in sorted(values.items()):
                c.add_metric([self.name, peer], n)
            yield c
        d = CounterMetricFamily(
            "kvlink_log_records_dropped",
            "Engine log records lost before the drain took them (the "
            "counters above miss what they said)",
            labels=["agent"],
        )
        d.add_metric([self.name], dropped)
        yield d
        g = GaugeMetricFamily("kvlink_peers", "Peers this agent knows", labels=["agent", "kind"])
        g.add_metric([self.name, "connected"], sum(p.connected for p in peers))
        g.add_metric([self.name, "discovered"], sum(p.discovered for p in peers))
        yield g
        conns = GaugeMetricFamily(
            "kvlink_paths", "Paths to peers, by state", labels=["agent", "state"]
        )
        for s in PathState:
            conns.add_metric([self.name, s.name], sum(p.state == s for p in paths))
        yield conns
        yield from self._inbound_families(agent)
        d_ = agent.discovery
        if d_ is not None:
            r = CounterMetricFamily(
                "kvlink_discovery_republished",
                "Times this agent's record was written again after etcd "
                "lost it (restart without data, expired lease)",
                labels=["agent"],
            )
            r.add_metric([self.name], d_.republished)
            yield r
            e = CounterMetricFamily(
                "kvlink_discovery_errors",
                "Discovery rounds that failed (etcd unreachable, refused)",
                labels=["agent"],
            )
            e.add_metric([self.name], d_.errors)
            yield e

    def _inbound_families(self, agent: Agent) -> Iterator[Any]:
        try:
            st = agent.inbound_stats()
        except KvlinkError:  # closed meanwhile
            return
        held = GaugeMetricFamily(
            "kvlink_inbound_held",
            "What peers' pushes and notifications hold on this agent (each sender's part is "
            "bounded: docs/security.md)",
            labels=["agent", "what"],
        )
        for what in (
            "senders",
            "pushes",
            "tombstones",
            "chunks",
            "layers",
            "tag_bytes",
            "notifications",
            "notification_bytes",
            "queued_handles",
        ):
            held.add_metric([self.name, what], getattr(st, what))
        yield held
        refused = CounterMetricFamily(
            "kvlink_inbound_refused",
            "Inbound pushes refused (over their sender's share or out of room), evicted to make "
            "room, and notifications not acknowledged for room (their senders send them again)",
            labels=["agent", "what"],
        )
        refused.add_metric([self.name, "pushes"], st.refused_pushes)
        refused.add_metric([self.name, "evicted_pushes"], st.evicted_pushes)
        refused.add_metric([self.name, "notifications"], st.refused_notifications)
        yield refused


class MetricsServer:
    """``Config(metrics_port=...)``: the agent's metrics over HTTP (``/metrics``)."""

    def __init__(self, metrics: AgentMetrics, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(metrics)
        try:
            self._server, self._thread = start_http_server(port, host, self.registry)
        except OSError as exc:
            raise ConfigError(
                f"metrics_port: cannot serve metrics on {host}:{port} ({exc.strerror or exc}); "
                "choose a free port, or 0 for any"
            ) from exc
        self.address = (host, int(self._server.server_port))

    def close(self) -> None:
        # At interpreter exit the (daemon) serving thread is frozen and
        # shutdown() would wait for it forever: only close the socket then.
        if not sys.is_finalizing() and self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5)
        self._server.server_close()
