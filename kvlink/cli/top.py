"""``kvlink top`` and ``kvlink paths``: an agent's paths, read from its metrics endpoint.

    kvlink top 127.0.0.1:9400 [--interval-ms 100] [--once]
    kvlink paths 127.0.0.1:9400 [--json]

The agent serves its metrics with ``Config(metrics_port=9400)`` or ``KVLINK_METRICS_PORT=9400``
(or through a host's own endpoint: pass its URL). ``top`` redraws every ``--interval-ms``
(100 ms: the engine's own sampling period) a table of every path: its state, the rate it moved
in the last interval, the engine's estimated rate, RTT, bytes in flight, errors (times it left
service: DOWN or STALLED from UP or DEGRADED), reconnects and hedges; ``--once`` prints one
table (two scrapes apart) and exits. In a narrow console the least needed columns are left out
(the table says which). ``paths`` prints the same rows once, as a table or (``--json``) as a
JSON list for scripts.

A vLLM server's own ``/metrics`` carries KvlinkConnector's counters (``kvlink_vllm_*``, summed
over the server's workers) but no paths: ``top`` shows those counters, ``paths`` says where the
paths are (the worker's agent serves them when the server runs with ``KVLINK_METRICS_PORT``).
Exit codes: 0 ok; 1 the endpoint could not be read, or it holds nothing the command shows (the
message says where to look); 2 usage error.
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
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from . import _logging

EXIT_ERROR = 1
EXIT_USAGE = 2
_STATE_STYLE = {
    "UP": "green",
    "DEGRADED": "yellow",
    "PROBING": "cyan",
    "STALLED": "bold red",
    "DOWN": "bold red",
}
# What to tell a user whose endpoint has no paths: the worker agent's own endpoint.
_AGENT_PORT_HINT = (
    "start the server with KVLINK_METRICS_PORT=9400 in its environment (the worker's kvlink "
    "agent then serves its own endpoint on 127.0.0.1:9400; another port per server on one "
    "host) and run `kvlink {command} 127.0.0.1:9400` (docs/vllm.md, \"What to scrape\")"
)


class EndpointError(Exception):
    """The endpoint answered, but with nothing this command shows (the message says where to
    look instead)."""


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
    # names of the agents whose kvlink_agent_up the endpoint serves (also with no path yet)
    agents: list[str] = field(default_factory=list)
    # a vLLM server's KvlinkConnector series: (model_name, engine) -> sample name -> value
    vllm: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    # the endpoint serves vLLM's own series (vllm:*): a vLLM server's /metrics
    vllm_server: bool = False

    @property
    def kind(self) -> str:
        """"agent" (an agent's endpoint), "vllm" (a vLLM server's, with KvlinkConnector's
        counters) or "none" (no kvlink series)."""
        if self.agents or self.paths:
            return "agent"
        return "vllm" if self.vllm else "none"


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
# KvlinkConnector's counters on vLLM's endpoint (kvlink/integrations/vllm/_stats.py), in the
# order shown; others (e.g. KvlinkStoreConnector's kvlink_vllm_store_*) follow by name.
_VLLM_LABELS = {
    "received_bytes": "KV received, verified",
    "sent_bytes": "KV pushed, verified at decode",
    "path_received_bytes": "path bytes received",
    "path_sent_bytes": "path bytes sent",
    "received_chunks": "chunks received",
    "sent_chunks": "chunks pushed",
    "transfers_ok": "transfers ok",
    "transfers_failed": "transfers failed",
    "retries": "chunk retries",
    "path_state_changes": "path state changes",
    "path_down": "paths down or stalled",
    "transfer_seconds": "transfer time (mean)",
    "first_layer_seconds": "first layer time (mean)",
}
_VLLM_PREFIX = "kvlink_vllm_"
_VLLM_ENGINE_LABELS = {"model_name", "engine"}  # vLLM's own; series with more are not shown


def endpoint_url(target: str) -> str:
    """``host:port`` or a URL -> the metrics URL."""
    if "://" not in target:
        target = f"http://{target}"
    if target.rstrip("/").count("/") < 3:  # no path: the default one
        target = target.rstrip("/") + "/metrics"
    return target


def parse(text: str, t: float) -> Snapshot:
    """The paths and agent totals (an agent's endpoint), or KvlinkConnector's counters (a vLLM
    server's), in a Prometheus exposition."""
    paths: dict[tuple[str, str, int], PathRow] = {}
    agent: dict[str, float] = {}
    snap = Snapshot(t, paths, agent)

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
        if fam.name.startswith("vllm:"):
            snap.vllm_server = True
        # KvlinkConnector's counters and histograms (not its gauges: per-request records)
        vllm_fam = fam.name.startswith(_VLLM_PREFIX) and fam.type in ("counter", "histogram")
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
                if "agent" in s.labels and s.labels["agent"] not in snap.agents:
                    snap.agents.append(s.labels["agent"])
            elif (
                vllm_fam
                and s.name.endswith(("_total", "_sum", "_count"))
                and set(s.labels) <= _VLLM_ENGINE_LABELS  # per phase etc.: kvlink trace's
            ):
                key = (s.labels.get("model_name", ""), s.labels.get("engine", ""))
                series = snap.vllm.setdefault(key, {})
                series[s.name] = series.get(s.name, 0.0) + s.value
    return snap


def check(snap: Snapshot, url: str, command: str) -> None:
    """Raises :class:`EndpointError` when ``snap`` holds nothing ``command`` shows."""
    kind = snap.kind
    if kind == "agent" or (kind == "vllm" and command == "top"):
        return
    hint = _AGENT_PORT_HINT.format(command=command)
    if kind == "vllm":
        raise EndpointError(
            f"{url} is a vLLM server's endpoint: it carries KvlinkConnector's counters "
            f"(kvlink_vllm_*, which `kvlink top` shows) but no paths. Per-path series are on "
            f"the worker's kvlink agent's own endpoint: {hint}"
        )
    if snap.vllm_server:
        raise EndpointError(
            f"{url} is a vLLM server's endpoint without KvlinkConnector's series "
            "(kvlink_vllm_*): is the server started with --kv-transfer-config naming "
            "KvlinkConnector, and with its stat logging on (the default; not "
            f"--disable-log-stats)? For the paths: {hint}"
        )
    raise EndpointError(
        f"{url} serves no kvlink series: point `kvlink {command}` at a kvlink agent's metrics "
        "endpoint (Config(metrics_port=...) or KVLINK_METRICS_PORT) or at a vLLM server "
        "running KvlinkConnector"
    )


def fetch(url: str, timeout_s: float = 2.0) -> Snapshot:
    """Scrapes ``url`` once.

    Raises:
        httpx.HTTPError: the endpoint could not be read.
        ValueError: what it answered is not a Prometheus exposition.
    """
    r = httpx.get(url, timeout=timeout_s)
    r.raise_for_status()
    return parse(r.text, time.monotonic())


def _num(v: float) -> str:
    """3 significant digits, at most 4 characters (100 -> "100", 12.3, 1.23)."""
    return f"{v:.0f}" if v >= 99.95 else f"{v:.1f}" if v >= 9.995 else f"{v:.2f}"


def _rate(b: float) -> str:
    if b <= 0:
        return "-"
    for unit, div in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if b >= div:
            return f"{_num(b / div)} {unit}"
    return f"{b:.0f} B/s"


def _bytes(b: float) -> str:
    if b <= 0:
        return "0"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            return f"{_num(b / div)} {unit}"
    return f"{b:.0f} B"


def _seconds(s: float) -> str:
    return f"{_num(s * 1e3)} ms" if s < 10 else f"{_num(s)} s"


_GAP = 2  # columns between two table columns (the tables' left padding and separator)


def _table(**kw: Any) -> Table:
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1),
                 header_style="bold", **kw)


def _fit(widths: list[int], drop: list[int], width: int, out: set[int]) -> set[int]:
    """``out`` and the columns (indices) left out besides so that the rest fit ``width``: by
    ``drop`` rank, highest first (0: never)."""
    out = set(out)
    order = sorted((r, -i) for i, r in enumerate(drop) if r > 0 and i not in out)
    while order and sum(w + _GAP for i, w in enumerate(widths) if i not in out) - _GAP > width:
        out.add(-order.pop()[1])
    return out


# (header, justify, drop rank: in a narrow console the highest goes first, 0: always shown;
# least width: what the widest value takes, so that columns stay put while top redraws)
_PATH_COLUMNS = (
    ("peer", "left", 0, 0),
    ("path", "right", 0, 0),
    ("local -> remote", "left", 6, 0),
    ("state", "left", 0, 8),  # DEGRADED
    ("rate", "right", 0, 9),  # 1.23 GB/s
    ("est. rate", "right", 4, 9),
    ("RTT", "right", 2, 7),  # 12.3 ms
    ("in flight", "right", 3, 8),  # 1.23 GiB
    ("sent", "right", 0, 8),
    ("recv.", "right", 0, 8),
    ("errors", "right", 1, 0),
    ("reconn.", "right", 5, 0),
    ("hedges", "right", 5, 0),
)


def render_paths(now: Snapshot, before: Snapshot | None, url: str, width: int = 80) -> Group:
    """One row per path. When the table does not fit ``width``, the peer column becomes a
    heading above its paths' rows, then the least needed columns are left out (it says which).
    """
    dt = now.t - before.t if before is not None else 0.0
    rows: list[list[str]] = []
    for key in sorted(now.paths):
        r = now.paths[key]
        moved = 0.0
        if before is not None and dt > 0 and key in before.paths:
            b = before.paths[key]
            moved = (r.sent_bytes + r.received_bytes - b.sent_bytes - b.received_bytes) / dt
        rows.append([
            r.peer,
            str(r.path),
            f"{r.local} -> {r.relay.split('@')[0]} -> {r.remote}" if r.relay
            else f"{r.local} -> {r.remote}",
            r.state,
            _rate(moved),
            _rate(r.est_rate_bytes_per_s),
            _seconds(r.rtt_s) if r.rtt_s else "-",
            _bytes(r.inflight_bytes),
            _bytes(r.sent_bytes),
            _bytes(r.received_bytes),
            str(r.errors),
            str(r.reconnects),
            str(r.hedges),
        ])
    widths = [max([len(c[0]), c[3], *(len(row[i]) for row in rows)])
              for i, c in enumerate(_PATH_COLUMNS)]
    drop = [c[2] for c in _PATH_COLUMNS]
    left_out = _fit(widths, drop, width, set())
    grouped = bool(left_out)  # the peer column goes first: a heading per peer instead
    if grouped:
        left_out = _fit(widths, drop, width, {0})
    shown = [i for i in range(len(_PATH_COLUMNS)) if i not in left_out]

    def table(header: bool) -> Table:
        t = _table(show_header=header)
        for i in shown:
            name, just = _PATH_COLUMNS[i][:2]
            # fixed widths: the tables of several peers line up
            t.add_column(name, justify=just, no_wrap=True,  # type: ignore[arg-type]
                         overflow="ellipsis", width=min(widths[i], width))
        return t

    def add(t: Table, row: list[str]) -> None:
        cells: list[Any] = []
        for i in shown:
            style = ""
            if i == 3:
                style = _STATE_STYLE.get(row[i], "")
            elif i == 10 and row[i] != "0":
                style = "red"
            cells.append(Text(row[i], style=style))
        t.add_row(*cells)

    a = now.agent
    agents = sorted({k[0] for k in now.paths} | set(now.agents)) or ["?"]
    parts: list[Any] = [Text.assemble(
        ("kvlink top", "bold"), f"  {url}\n",
        f"agent {', '.join(agents)}\n",
        f"transfers ok {a.get('transfers', 0):.0f}  failed {a.get('failed', 0):.0f}  "
        f"retries {a.get('retries', 0):.0f}  checksum failures "
        f"{a.get('checksum_failures', 0):.0f}  cancels {a.get('cancels', 0):.0f}  "
        f"notifications {a.get('notifications', 0):.0f}",
    )]
    if not rows:
        parts.append(Text("no paths: this agent has opened none (paths belong to the agent "
                          "that connects: a prefill that is only pulled from has none; its "
                          "peers show theirs)", style="dim"))
    elif not grouped:
        t = table(True)
        for row in rows:
            add(t, row)
        parts.append(t)
    else:
        peers = list(dict.fromkeys(row[0] for row in rows))
        for n, peer in enumerate(peers):
            parts.append(Text(f"peer {peer}", style="bold"))
            t = table(n == 0)
            for row in rows:
                if row[0] == peer:
                    add(t, row)
            parts.append(t)
        hidden = [_PATH_COLUMNS[i][0] for i in sorted(left_out - {0})]
        if hidden:
            parts.append(Text(
                f"left out at {width} columns: {', '.join(hidden)} (a wider console shows "
                "them; kvlink paths --json has every field)", style="dim"))
    for r in now.paths.values():
        if r.state in ("DOWN", "STALLED", "PROBING") and r.last_reasons:
            parts.append(Text(f"{r.state.lower()}: {r.peer}/{r.path}: {r.last_reasons[-1]}",
                              style="red"))
    return Group(*parts)


def _vllm_label(name: str) -> str:
    return _VLLM_LABELS.get(name, name.replace("_", " "))


def render_vllm(now: Snapshot, before: Snapshot | None, url: str, width: int = 80) -> Group:
    """KvlinkConnector's counters on a vLLM server's endpoint: per engine, each counter's total
    and its rate over the last interval, and each histogram's mean."""
    dt = now.t - before.t if before is not None else 0.0
    parts: list[Any] = [Text.assemble(
        ("kvlink top", "bold"), f"  {url}\n",
        "a vLLM server: KvlinkConnector's counters (kvlink_vllm_*, its workers summed)",
    )]
    for key in sorted(now.vllm):
        model, engine = key
        cur = now.vllm[key]
        prev = before.vllm.get(key, {}) if before is not None else {}
        names = sorted({n[len(_VLLM_PREFIX):].removesuffix("_total").removesuffix("_sum")
                        .removesuffix("_count") for n in cur},
                       key=lambda n: (list(_VLLM_LABELS).index(n) if n in _VLLM_LABELS
                                      else len(_VLLM_LABELS), n))
        table = _table(title=f"engine {engine}  model {model}", title_justify="left")
        table.add_column("counter", no_wrap=True)
        table.add_column("total", justify="right", no_wrap=True)
        table.add_column(f"last {dt:.1f} s" if dt > 0 else "last interval", justify="right",
                         no_wrap=True)
        for n in names:
            full = _VLLM_PREFIX + n
            if f"{full}_count" in cur:  # a histogram: its mean, overall and in the interval
                count, total = cur.get(f"{full}_count", 0.0), cur.get(f"{full}_sum", 0.0)
                dc = count - prev.get(f"{full}_count", 0.0) if prev else 0.0
                ds = total - prev.get(f"{full}_sum", 0.0) if prev else 0.0
                table.add_row(_vllm_label(n), _seconds(total / count) if count else "-",
                              _seconds(ds / dc) if dc > 0 else "-")
                continue
            v = cur.get(f"{full}_total", cur.get(full, 0.0))
            d = v - prev.get(f"{full}_total", prev.get(full, v)) if prev and dt > 0 else 0.0
            if "bytes" in n:
                table.add_row(_vllm_label(n), _bytes(v), _rate(d / dt) if dt > 0 else "-")
            else:
                table.add_row(_vllm_label(n), f"{v:.0f}",
                              f"{d / dt:.1f}/s" if dt > 0 and d else "-")
        parts.append(table)
    parts.append(Text(
        "Per-path detail (state, RTT, bytes in flight) is on the worker's kvlink agent's own "
        "endpoint: " + _AGENT_PORT_HINT.format(command="top"), style="dim"))
    return Group(*parts)


def render(now: Snapshot, before: Snapshot | None, url: str, width: int = 80) -> Group:
    if now.kind == "vllm":
        return render_vllm(now, before, url, width)
    return render_paths(now, before, url, width)


def top(url: str, interval_s: float, once: bool, console: Console) -> int:
    try:
        before = fetch(url)
        check(before, url, "top")
        if once:
            time.sleep(interval_s)
            now = fetch(url)
            check(now, url, "top")
            console.print(render(now, before, url, console.width))
            return 0
        with Live(render(before, None, url, console.width), console=console,
                  auto_refresh=False) as live:
            while True:
                time.sleep(interval_s)
                now = fetch(url)
                check(now, url, "top")
                live.update(render(now, before, url, console.width), refresh=True)
                before = now
    except (httpx.HTTPError, ValueError) as exc:
        print(f"kvlink top: cannot read {url}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except EndpointError as exc:
        print(f"kvlink top: {exc}", file=sys.stderr)
        return EXIT_ERROR


def paths(url: str, as_json: bool, console: Console) -> int:
    try:
        snap = fetch(url)
        check(snap, url, "paths")
    except (httpx.HTTPError, ValueError) as exc:
        print(f"kvlink paths: cannot read {url}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except EndpointError as exc:
        print(f"kvlink paths: {exc}", file=sys.stderr)
        return EXIT_ERROR
    rows = [asdict(snap.paths[k]) for k in sorted(snap.paths)]
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        console.print(render(snap, None, url, console.width))
    return 0


def main(argv: Sequence[str], prog: str, command: str) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "target",
        help="the metrics endpoint: HOST:PORT or a URL (.../metrics) of an agent, or of a vLLM "
        "server running KvlinkConnector",
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
    _logging.add_log_level(parser)
    args = parser.parse_args(argv)
    _logging.setup(args.log_level, prog)
    url = endpoint_url(args.target)
    console = Console()
    if command == "top":
        if not 10 <= args.interval_ms <= 60_000:
            parser.error(f"--interval-ms: {args.interval_ms} is outside [10, 60000]")
        return top(url, args.interval_ms / 1e3, args.once, console)
    return paths(url, args.json, console)
