"""``kvlink top`` and ``kvlink paths``: an agent's paths, read from its metrics endpoint.

    kvlink top 127.0.0.1:9400 [--interval-ms 100] [--once]
    kvlink paths 127.0.0.1:9400 [--json]

The agent serves its metrics with ``Config(metrics_port=9400)`` (or through a host's own
endpoint: pass its URL). ``top`` redraws every ``--interval-ms`` (100 ms: the engine's own
sampling period) a table of every path: its state, the rate it moved in the last interval,
the engine's estimated rate, RTT, bytes in flight, errors (times it left service: DOWN or
STALLED from UP or DEGRADED),
reconnects and hedges; ``--once`` prints one table (two scrapes apart) and exits. ``paths``
prints the same rows once, as a table or (``--json``) as a JSON list for scripts.
Exit codes: 0 ok, 1 the endpoint could not be read, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

EXIT_ERROR = 1
EXIT_USAGE = 2
_STATE_STYLE = {
    "UP": "green",
    "DEGRADED": "yellow",
    "PROBING": "cyan",
    "STALLED": "bold red",
    "DOWN": "bold red",
}


@dataclass
class PathRow:
    agent: str
    peer: str
    path: int
    local: str
    remote: str
    relay: str = ""  # "NAME@HOST:PORT" of a relayed path's relay
    state: str = "?"
    sent_bytes: int = 0
    received_bytes: int = 0
    chunks: int = 0
    inflight_bytes: int = 0
    est_rate_bytes_per_s: float = 0.0
    delivery_rate_bytes_per_s: float = 0.0
    rtt_s: float = 0.0
    nic_competing_bytes_per_s: float = 0.0
    stall_s: float = 0.0
    reconnects: int = 0
    hedges: int = 0
    errors: int = 0  # times it left service (went DOWN or STALLED from UP or DEGRADED)
    last_reasons: list[str] = field(default_factory=list)


@dataclass
class Snapshot:
    t: float
    paths: dict[tuple[str, str, int], PathRow]
    agent: dict[str, float]


_PATH_FIELDS = {
    "kvlink_path_sent_bytes_total": "sent_bytes",
    "kvlink_path_received_bytes_total": "received_bytes",
    "kvlink_path_chunks_total": "chunks",
    "kvlink_path_inflight_bytes": "inflight_bytes",
    "kvlink_path_rate_bytes_per_second": "est_rate_bytes_per_s",
    "kvlink_path_delivery_bytes_per_second": "delivery_rate_bytes_per_s",
    "kvlink_path_rtt_seconds": "rtt_s",
    "kvlink_path_nic_competing_bytes_per_second": "nic_competing_bytes_per_s",
    "kvlink_path_stall_seconds": "stall_s",
    "kvlink_path_reconnects_total": "reconnects",
    "kvlink_path_hedges_total": "hedges",
}
_INT_FIELDS = {"sent_bytes", "received_bytes", "chunks", "inflight_bytes", "reconnects", "hedges"}
_AGENT_SUMS = {
    "kvlink_transfers_total": "transfers",
    "kvlink_transfer_failures_total": "failed",
    "kvlink_transfer_retries_total": "retries",
    "kvlink_checksum_failures_total": "checksum_failures",
    "kvlink_cancels_total": "cancels",
    "kvlink_notifications_total": "notifications",
}


def endpoint_url(target: str) -> str:
    """``host:port`` or a URL -> the metrics URL."""
    if "://" not in target:
        target = f"http://{target}"
    if target.rstrip("/").count("/") < 3:  # no path: the default one
        target = target.rstrip("/") + "/metrics"
    return target


def parse(text: str, t: float) -> Snapshot:
    """The paths and agent totals in a Prometheus exposition."""
    paths: dict[tuple[str, str, int], PathRow] = {}
    agent: dict[str, float] = {}

    def row(lv: dict[str, str]) -> PathRow | None:
        try:
            key = (lv["agent"], lv["peer"], int(lv["path"]))
        except (KeyError, ValueError):
            return None
        if key not in paths:
            paths[key] = PathRow(key[0], key[1], key[2], lv.get("local", ""), lv.get("remote", ""),
                                 lv.get("relay", ""))
        return paths[key]

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in _PATH_FIELDS:
                r = row(s.labels)
                if r is not None:
                    f = _PATH_FIELDS[s.name]
                    setattr(r, f, int(s.value) if f in _INT_FIELDS else float(s.value))
            elif s.name == "kvlink_path_state" and s.value == 1:
                r = row(s.labels)
                if r is not None:
                    r.state = s.labels.get("state", "?")
            elif (
                s.name == "kvlink_path_state_changes_total"
                and s.labels.get("to_state") in ("DOWN", "STALLED")
                and s.labels.get("from_state") in ("UP", "DEGRADED")  # left service
            ):
                r = row(s.labels) if s.labels.get("path", "").isdigit() else None
                if r is not None and s.value:
                    r.errors += int(s.value)
                    r.last_reasons.append(s.labels.get("reason", ""))
            elif s.name in _AGENT_SUMS:
                k = _AGENT_SUMS[s.name]
                if s.name == "kvlink_transfers_total" and s.labels.get("outcome") != "ok":
                    continue
                agent[k] = agent.get(k, 0.0) + s.value
            elif s.name == "kvlink_agent_up":
                agent["up"] = s.value
    return Snapshot(t, paths, agent)


def fetch(url: str, timeout_s: float = 2.0) -> Snapshot:
    """Scrapes ``url`` once.

    Raises:
        httpx.HTTPError: the endpoint could not be read.
    """
    r = httpx.get(url, timeout=timeout_s)
    r.raise_for_status()
    return parse(r.text, time.monotonic())


def _rate(b: float) -> str:
    if b <= 0:
        return "-"
    for unit, div in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B/s"


def _bytes(b: float) -> str:
    if b <= 0:
        return "0"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            return f"{b / div:.1f} {unit}"
    return f"{b:.0f} B"


def render(now: Snapshot, before: Snapshot | None, url: str) -> Group:
    dt = now.t - before.t if before is not None else 0.0
    table = Table(expand=False, header_style="bold")
    for col, just in (
        ("peer", "left"),
        ("path", "right"),
        ("local -> remote", "left"),
        ("state", "left"),
        ("rate", "right"),
        ("est. rate", "right"),
        ("RTT", "right"),
        ("in flight", "right"),
        ("sent", "right"),
        ("received", "right"),
        ("errors", "right"),
        ("reconn.", "right"),
        ("hedges", "right"),
    ):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for key in sorted(now.paths):
        r = now.paths[key]
        moved = 0.0
        if before is not None and dt > 0 and key in before.paths:
            b = before.paths[key]
            moved = (r.sent_bytes + r.received_bytes - b.sent_bytes - b.received_bytes) / dt
        table.add_row(
            r.peer,
            str(r.path),
            f"{r.local} -> {r.relay.split('@')[0]} -> {r.remote}" if r.relay
            else f"{r.local} -> {r.remote}",
            Text(r.state, style=_STATE_STYLE.get(r.state, "")),
            _rate(moved),
            _rate(r.est_rate_bytes_per_s),
            f"{r.rtt_s * 1e3:.2f} ms" if r.rtt_s else "-",
            _bytes(r.inflight_bytes),
            _bytes(r.sent_bytes),
            _bytes(r.received_bytes),
            Text(str(r.errors), style="red" if r.errors else ""),
            str(r.reconnects),
            str(r.hedges),
        )
    a = now.agent
    agents = sorted({k[0] for k in now.paths}) or ["?"]
    head = Text.assemble(
        ("kvlink top ", "bold"),
        f"{url}  agent {', '.join(agents)}  ",
        f"transfers ok {a.get('transfers', 0):.0f}  failed {a.get('failed', 0):.0f}  ",
        f"retries {a.get('retries', 0):.0f}  checksum failures {a.get('checksum_failures', 0):.0f}"
        f"  cancels {a.get('cancels', 0):.0f}  notifications {a.get('notifications', 0):.0f}",
    )
    parts: list[Any] = [head, table]
    reasons = [
        f"{r.peer}/{r.path}: {r.last_reasons[-1]}"
        for r in now.paths.values()
        if r.state in ("DOWN", "STALLED", "PROBING") and r.last_reasons
    ]
    if reasons:
        parts.append(Text("down: " + "; ".join(reasons), style="red"))
    return Group(*parts)


def top(url: str, interval_s: float, once: bool, console: Console) -> int:
    try:
        before = fetch(url)
        if once:
            time.sleep(interval_s)
            console.print(render(fetch(url), before, url))
            return 0
        with Live(render(before, None, url), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval_s)
                now = fetch(url)
                live.update(render(now, before, url), refresh=True)
                before = now
    except httpx.HTTPError as exc:
        print(f"kvlink top: cannot read {url}: {exc}", file=sys.stderr)
        return EXIT_ERROR


def paths(url: str, as_json: bool, console: Console) -> int:
    try:
        snap = fetch(url)
    except httpx.HTTPError as exc:
        print(f"kvlink paths: cannot read {url}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    rows = [asdict(snap.paths[k]) for k in sorted(snap.paths)]
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        console.print(render(snap, None, url))
    return 0


def main(argv: Sequence[str], prog: str, command: str) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "target", help="the agent's metrics endpoint: HOST:PORT or a URL (.../metrics)"
    )
    if command == "top":
        parser.add_argument(
            "--interval-ms", type=int, default=100, help="redraw period (default 100 ms)"
        )
        parser.add_argument(
            "--once",
            action="store_true",
            help="print one table (two scrapes an interval apart) and exit",
        )
    else:
        parser.add_argument("--json", action="store_true", help="a JSON list, for scripts")
    args = parser.parse_args(argv)
    url = endpoint_url(args.target)
    console = Console()
    if command == "top":
        if not 10 <= args.interval_ms <= 60_000:
            parser.error(f"--interval-ms: {args.interval_ms} is outside [10, 60000]")
        return top(url, args.interval_ms / 1e3, args.once, console)
    return paths(url, args.json, console)
