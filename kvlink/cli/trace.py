"""`kvlink trace`: where the last P/D requests' time went, read from vLLM servers' metrics.

Each vLLM server running KvlinkConnector (with stat logging on, as `vllm serve` has it) keeps
the phases of its last requests on its /metrics endpoint
(`kvlink_vllm_request_last_phase_seconds`); give this command the prefill and the decode
servers (any number of each) and it joins their records by transfer (the pull's tag or the
push's transfer id):

    kvlink trace localhost:8100 localhost:8200 --last 10
    kvlink trace prefill:8100 decode:8200 --png trace.png     # a waterfall (needs matplotlib)

Phases (docs/vllm.md, "Where a request's time goes"), each on its own side's clock:
prefill queue (arrival to scheduled), prefill compute (to the prompt computed), first layer
sent (push: the last chunk's forward pass started to layer 0 verified at decode), decode
admission (decode's arrival to its load started), KV transfer (load started to the last layer
verified on every decode rank), decode first step (to the forward pass with the first token
done).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from . import _logging
from .top import _table, endpoint_url

FAMILY = "kvlink_vllm_request_last_phase_seconds"
# (column, role, phase) in request order
COLUMNS = (
    ("P queue", "prefill", "prefill_queue"),
    ("P compute", "prefill", "prefill_compute"),
    ("1st layer", "prefill", "first_layer_sent"),
    ("D admit", "decode", "decode_admission"),
    ("KV xfer", "decode", "kv_transfer"),
    ("D 1st step", "decode", "decode_first_step"),
)


def parse(text: str) -> dict[str, dict[str, dict[str, Any]]]:
    """xfer -> role -> {"request", "t_unix", phase: seconds} from one exposition."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != FAMILY:
            continue
        for s in fam.samples:
            lv = s.labels
            rec = out.setdefault(lv.get("xfer", ""), {}).setdefault(lv.get("role", "?"), {})
            rec["request"] = lv.get("request", "")
            rec[lv.get("phase", "?")] = float(s.value)
    return out


def join(texts: Sequence[str]) -> list[dict[str, Any]]:
    """Every transfer seen on any endpoint, prefill's and decode's records side by side, the
    most recent last."""
    rows: dict[str, dict[str, Any]] = {}
    for text in texts:
        for xfer, roles in parse(text).items():
            row = rows.setdefault(xfer, {"xfer": xfer})
            for role, rec in roles.items():
                row.setdefault(role, {}).update(rec)
    return sorted(rows.values(), key=lambda r: max(
        r.get(role, {}).get("t_unix", 0.0) for role in ("prefill", "decode")))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def table(rows: list[dict[str, Any]]) -> Table:
    t = _table(title="kvlink trace (ms)")
    t.add_column("transfer", overflow="ellipsis", max_width=18, no_wrap=True)
    for name, _, _ in COLUMNS:
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(r["xfer"].rsplit("/", 1)[-1], *(
            _ms(r.get(role, {}).get(phase)) for _, role, phase in COLUMNS))
    return t


def waterfall(rows: list[dict[str, Any]], path: str) -> None:
    """One bar per request, its phases end to end (push's transfer overlaps prefill's compute
    on the wire; drawn after it, as decode sees it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = [("prefill", "prefill_queue"), ("prefill", "prefill_compute"),
             ("decode", "decode_admission"), ("decode", "kv_transfer"),
             ("decode", "decode_first_step")]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(rows) + 1.5))
    colors = ["#bbbbbb", "#4477aa", "#ccbb44", "#ee6677", "#228833"]
    for y, r in enumerate(rows):
        x = 0.0
        for (role, phase), color in zip(order, colors, strict=True):
            v = r.get(role, {}).get(phase)
            if v is None:
                continue
            ax.barh(y, v * 1e3, left=x, color=color,
                    label=phase if y == 0 else None)
            x += v * 1e3
    ax.set_yticks(range(len(rows)), [r["xfer"].rsplit("/", 1)[-1][:16] for r in rows])
    ax.set_xlabel("ms")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str], prog: str = "kvlink trace") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("endpoints", nargs="+",
                        help="vLLM servers' metrics (host:port or a URL; /metrics by default)")
    parser.add_argument("--last", type=int, default=20, help="show the last N requests (20)")
    parser.add_argument("--json", action="store_true", help="the joined records as JSON")
    parser.add_argument("--png", metavar="PATH", help="also draw a waterfall to PATH")
    _logging.add_log_level(parser)
    args = parser.parse_args(argv)
    _logging.setup(args.log_level, prog)
    if args.last < 1:
        parser.error(f"--last: {args.last} must be at least 1")
    console = Console()
    texts = []
    for target in args.endpoints:
        url = endpoint_url(target)
        try:
            r = httpx.get(url, timeout=5.0)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            console.print(f"[red]kvlink trace: cannot read {url}: {exc}[/red]")
            return 1
        if FAMILY not in r.text:
            console.print(
                f"[red]kvlink trace: {url} has no {FAMILY}: point it at a vLLM server running "
                "KvlinkConnector with stat logging on (vllm serve has it; the offline LLM needs "
                "disable_log_stats=False) that has served a P/D request[/red]")
            return 1
        texts.append(r.text)
    rows = join(texts)[-args.last:]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        console.print(table(rows))
    if args.png:
        try:
            waterfall(rows, args.png)
        except ImportError:
            console.print("[red]kvlink trace: --png needs matplotlib (pip install "
                          "'kvlink[plot]')[/red]")
            return 1
        console.print(f"waterfall written to {args.png}")
    return 0
