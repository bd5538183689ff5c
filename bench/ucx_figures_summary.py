"""Medians, ranges and same-run ratios of fig.py's JSON rows.

    .venv/bin/python bench/ucx_figures_summary.py A.jsonl [B.jsonl ...]
"""

import json
import statistics as st
import sys
from collections import defaultdict


def med(x):
    return st.median(x) if x else float("nan")


for path in sys.argv[1:]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    meta = [r for r in rows if r.get("kind") == "meta"]
    runs = [r for r in rows if r.get("kind") == "run"]
    fails = [r for r in rows if r.get("kind") == "failure"]
    by = defaultdict(list)
    for r in runs:
        by[r["tool"]].append(r)
    print(f"\n### {path}  ({len(runs)} runs, {len(fails)} failures)")
    for m in meta:
        print("  started", m["utc"], "load", [round(x, 2) for x in m["loadavg"]])
    print("| tool | runs | GB/s median | min-max | CPU s/GiB median (tx / rx) | min-max | "
          "load (1 min) at start | verified | links | put share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for t, rs in by.items():
        g = [r["gbps"] for r in rs]
        gib = rs[0]["size_bytes"] / 2**30
        c = [r["cpu_s"] / gib for r in rs]
        ctx = med([r["cpu_tx_s"] / gib for r in rs])
        crx = med([r["cpu_rx_s"] / gib for r in rs])
        la = [r["loadavg"][0] for r in rs]
        links = sorted({r.get("links_used") for r in rs}, key=str)
        put = sorted({round(r["put_share"], 3) for r in rs if "put_share" in r})
        tr = sorted({",".join(r["tx_transports"]) for r in rs if "tx_transports" in r})
        print(f"| {t} | {len(rs)} | {med(g):.3f} | {min(g):.3f}-{max(g):.3f} | "
              f"{med(c):.2f} ({ctx:.2f} / {crx:.2f}) | {min(c):.2f}-{max(c):.2f} | "
              f"{min(la):.2f}-{max(la):.2f} | {all(r['verified'] for r in rs)} | "
              f"{'/'.join(map(str, links))} | {put or '-'} {tr or ''} |")
    for f in fails:
        print("  FAILURE", f["tool"], f["round"], f["reason"][:200])
    # ratios: ratio of medians and median of per-round ratios
    base = [t for t in by if t.startswith("kvlink-ucx")]
    for a in base:
        for b in by:
            if b == a:
                continue
            rm = med([r["gbps"] for r in by[a]]) / med([r["gbps"] for r in by[b]])
            rb = {r["round"]: r for r in by[b]}
            pr = [r["gbps"] / rb[r["round"]]["gbps"] for r in by[a] if r["round"] in rb]
            cm = med([r["cpu_s"] for r in by[a]]) / med([r["cpu_s"] for r in by[b]])
            cm = (med([r["cpu_s"] / r["size_bytes"] for r in by[a]])
                  / med([r["cpu_s"] / r["size_bytes"] for r in by[b]]))
            print(f"  {a} / {b}: GB/s ratio of medians {rm:.2f}, per-round "
                  f"{', '.join(f'{x:.2f}' for x in pr)} (median {med(pr):.2f}); "
                  f"CPU per GiB ratio {cm:.2f}")
