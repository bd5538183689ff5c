"""Draws bench/vllm_ttft.py's JSON rows: decode-side TTFT per prompt length and connector mode,
and its ratio to that run's own recompute baseline, one column per network and model.

    .venv/bin/python bench/vllm_ttft_plot.py /tmp/vllm_ttft.jsonl docs/img/vllm_ttft.png

Needs matplotlib (kvlink's ``bench`` extra; `make` installs it into .venv). When a file holds
several runs of the same connector, network and model, the latest one is drawn.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

# One colour per transfer (connector and mode); recompute is drawn per run as a dashed line.
SERIES = [("kvlink", "push"), ("kvlink", "pull"), ("nixl", "pull"), ("mooncake", "push")]
LABEL = {("kvlink", "push"): "kvlink push", ("kvlink", "pull"): "kvlink pull",
         ("nixl", "pull"): "NixlConnector", ("mooncake", "push"): "MooncakeConnector"}
COLOR = {("kvlink", "push"): "tab:blue", ("kvlink", "pull"): "tab:cyan",
         ("nixl", "pull"): "tab:red", ("mooncake", "push"): "tab:orange"}
NETWORKS = ["loopback", "4x2gbit"]
MODELS = ["tiny", "big"]


def load(paths: list[Path]) -> dict[tuple[str, str], dict[tuple[str, str], list[dict[str, Any]]]]:
    """(network, model) -> (connector, mode) -> rows of the latest run, by prompt length."""
    latest: dict[tuple[str, str, str], str] = {}
    rows: list[dict[str, Any]] = []
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("bench") != "vllm_ttft" or r.get("metric") != "ttft":
                continue
            r.setdefault("network", "loopback")
            key = (r["network"], r["model"], r["connector"])
            latest[key] = max(latest.get(key, ""), r["run"])
            rows.append(r)
    out: dict[tuple[str, str], dict[tuple[str, str], list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list))
    for r in rows:
        if r["run"] == latest[(r["network"], r["model"], r["connector"])]:
            out[(r["network"], r["model"])][(r["connector"], r["mode"])].append(r)
    for series in out.values():
        for v in series.values():
            v.sort(key=lambda r: r["prompt_tokens"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl", nargs="+", type=Path)
    ap.add_argument("png", type=Path)
    a = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("matplotlib is missing: pip install -e '.[bench]' (make does)") from None
    data = load(a.jsonl)
    panels = [(n, m) for m in MODELS for n in NETWORKS if (n, m) in data]
    if not panels:
        raise SystemExit(f"no vllm_ttft rows in {', '.join(map(str, a.jsonl))}")
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7.5), squeeze=False)
    for col, (net, model) in enumerate(panels):
        series = data[(net, model)]
        top, bottom = axes[0][col], axes[1][col]
        kv = {r["prompt_tokens"]: r["kv_mb"] for v in series.values() for r in v}
        clamped = False
        for conn, mode in SERIES:
            rows = series.get((conn, mode))
            if not rows:
                continue
            x = [r["prompt_tokens"] for r in rows]
            # push's decode-side time (decode's end-to-end minus prefill's generate()) is <= 0
            # when decode's first token came before prefill's generate() returned: such points
            # are drawn at 1 ms (ratio 0.001) as downward triangles; the JSON has the values
            ys = [r["decode_ttft_ms"] for r in rows]
            rs = [r["ratio_to_recompute"] for r in rows]
            c = COLOR[(conn, mode)]
            top.plot(x, [max(y, 1.0) for y in ys], "-", color=c, label=LABEL[(conn, mode)])
            bottom.plot(x, [max(v, 1e-3) for v in rs], "-", color=c)
            for xi, y, v in zip(x, ys, rs, strict=True):
                m = "o" if y > 1.0 else "v"
                top.plot([xi], [max(y, 1.0)], m, color=c)
                bottom.plot([xi], [max(v, 1e-3)], m, color=c)
                clamped = clamped or y <= 1.0
            base = series.get((conn, "recompute"))
            if base and mode in ("pull", "push") and (conn, mode) != ("kvlink", "pull"):
                top.plot([r["prompt_tokens"] for r in base], [r["decode_ttft_ms"] for r in base],
                         "--", color=COLOR[(conn, mode)], alpha=0.6,
                         label=f"{LABEL[(conn, mode)].split()[0]} run's recompute")
        top.set_title(f"{model} model, {net}\n"
                      + ", ".join(f"{n}: {kv[n]:g} MB" for n in sorted(kv)) + " of KV",
                      fontsize=9)
        top.set_yscale("log")
        top.set_ylabel("decode-side TTFT, ms (median)")
        bottom.set_yscale("log")
        bottom.axhline(1.0, color="grey", lw=0.8)
        bottom.set_ylabel("TTFT / same run's recompute")
        for ax in (top, bottom):
            ax.set_xlabel("prompt tokens")
            ax.set_xticks(sorted(kv))
            ax.grid(True, which="both", alpha=0.3)
        top.legend(fontsize=7)
        if clamped:
            bottom.text(0.02, 0.1, "v: decode done before prefill's generate()\nreturned "
                        "(<= 0 ms), drawn at 1 ms", transform=bottom.transAxes, fontsize=7)
    fig.suptitle("vLLM 0.32 (CPU) 1P1D, decode-side TTFT with the KV transferred, "
                 "medians (bench/vllm_ttft.py)", fontsize=10)
    fig.tight_layout()
    a.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.png, dpi=90)
    print(a.png)


if __name__ == "__main__":
    main()
