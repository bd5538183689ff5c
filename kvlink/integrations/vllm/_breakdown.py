"""Each P/D request's latency broken down (docs/vllm.md, "Where a request's time goes").

The scheduler side of KvlinkConnector stamps a request's arrival, first scheduling and the
prompt computed; every rank's worker reports its own timestamps of the request's transfer in
its connector stats ("req_parts"), which vLLM hands back to the scheduler side
(``update_connector_output``). :class:`RequestTimes` joins them, on the host's monotonic clock
that the engine's processes share, into one record per request: logged, and handed to vLLM's
metrics as "req_records" (:class:`~kvlink.integrations.vllm._stats.KvlinkPromMetrics`).

Imports vLLM (through _stats): only ``_connector`` imports this module.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from kvlink.integrations.vllm._stats import KvlinkConnectorStats

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvlink")

#: requests being timed at once; one that never completes (its load or hand-off never came)
#: is dropped once this many newer ones are open
_MAX_OPEN = 4096


@dataclasses.dataclass
class _Times:
    """One request's timestamps on the scheduler side (time.monotonic(); the workers' on the
    same host use the same clock) and the parts its workers reported."""

    role: str
    xfer: str | None
    arrival: float
    scheduled: float | None = None
    computed: float | None = None
    parts: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class RequestTimes:
    """Each P/D request's latency broken down (docs/vllm.md, "Where a request's time goes"):
    the scheduler side's own timestamps joined with what every rank's worker reported, one
    record per request, logged and handed to vLLM's metrics."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._open: dict[str, _Times] = {}
        self._done = KvlinkConnectorStats()

    def seen(self, request: Request, role: str, xfer: str | None) -> None:
        if request.request_id in self._open:
            return
        # vLLM stamps arrival with time.time() in the front end, on this host
        arrival = time.monotonic() - max(0.0, time.time() - float(request.arrival_time))
        if len(self._open) >= _MAX_OPEN:  # requests that never completed: the oldest goes
            del self._open[next(iter(self._open))]
        self._open[request.request_id] = _Times(role, xfer, arrival)

    def scheduled(self, num_scheduled_tokens: dict[str, int]) -> None:
        now = time.monotonic()
        for req_id, t in self._open.items():
            if t.scheduled is None and num_scheduled_tokens.get(req_id):
                t.scheduled = now

    def computed(self, req_id: str, xfer: str) -> None:
        t = self._open.get(req_id)
        if t is not None:
            t.computed, t.xfer = time.monotonic(), xfer

    def forget(self, req_id: str) -> None:
        self._open.pop(req_id, None)

    def add_parts(self, stats: Any) -> None:
        for part in getattr(stats, "data", {}).get("req_parts", ()):
            t = self._open.get(part.get("req"))
            if t is None:
                continue
            t.parts.append(part)
            if len({p["rank"] for p in t.parts}) >= self.tp_size:
                del self._open[part["req"]]
                self._complete(part["req"], t)

    def _complete(self, req_id: str, t: _Times) -> None:
        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(max(0.0, b - a), 6)

        def latest(key: str) -> float | None:
            vals = [p[key] for p in t.parts if p.get(key) is not None]
            return max(vals) if vals else None

        earliest_start = min((p["t0"] for p in t.parts if p.get("t0") is not None), default=None)
        if t.role == "prefill":
            fs = min((p["fs"] for p in t.parts if p.get("fs") is not None), default=None)
            phases = {
                "prefill_queue": span(t.arrival, t.scheduled),
                "prefill_compute": span(t.scheduled, t.computed),
                "first_layer_sent": span(fs, latest("l0")),
                "kv_sent": span(t.computed, latest("end")),
            }
        else:
            phases = {
                "decode_admission": span(t.arrival, earliest_start),
                "kv_first_layer": span(earliest_start, latest("l0")),
                "kv_transfer": span(earliest_start, latest("ln")),
                "decode_first_step": span(latest("ln"), latest("end")),
            }
        rec = {
            "request": req_id, "role": t.role, "xfer": t.xfer or "",
            "ok": all(p.get("ok") for p in t.parts), "t_unix": round(time.time(), 3),
            "phases": {k: v for k, v in phases.items() if v is not None},
        }
        log.info("kvlink request %s", json.dumps(rec, separators=(",", ":")))
        self._done.record("req_records", rec)

    def take_records(self) -> KvlinkConnectorStats | None:
        if self._done.is_empty():
            return None
        out, self._done = self._done, KvlinkConnectorStats()
        return out
