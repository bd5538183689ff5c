"""`kvlink top` and `kvlink paths` as an operator meets them: pointed at a vLLM server's /metrics
(KvlinkConnector's counters, no paths), at an endpoint without kvlink series, at an agent with
no peer yet, and in an 80-column console. Expositions served over real HTTP on loopback;
tests/integration/test_metrics.py reads a live agent, tests/vllm/test_metrics.py a live vLLM
engine's registry."""

from __future__ import annotations

import http.server
import re
import threading
from collections.abc import Iterator

import pytest
from rich.console import Console

from kvlink.cli import top
from kvlink.cli.main import main

# Trimmed from a vLLM 0.32 OpenAI server's /metrics with KvlinkConnector (decode, after pulls)
VLLM = """\
# HELP vllm:num_requests_running (its help)
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/m"} 0.0
# HELP kvlink_vllm_received_bytes_total (its help)
# TYPE kvlink_vllm_received_bytes_total counter
kvlink_vllm_received_bytes_total{engine="0",model_name="/m"} 3.145728e+07
# HELP kvlink_vllm_received_bytes_created (its help)
# TYPE kvlink_vllm_received_bytes_created gauge
kvlink_vllm_received_bytes_created{engine="0",model_name="/m"} 1.76468e+09
# HELP kvlink_vllm_sent_bytes_total (its help)
# TYPE kvlink_vllm_sent_bytes_total counter
kvlink_vllm_sent_bytes_total{engine="0",model_name="/m"} 0.0
# HELP kvlink_vllm_path_received_bytes_total (its help)
# TYPE kvlink_vllm_path_received_bytes_total counter
kvlink_vllm_path_received_bytes_total{engine="0",model_name="/m"} 3.145728e+07
# HELP kvlink_vllm_transfers_ok_total (its help)
# TYPE kvlink_vllm_transfers_ok_total counter
kvlink_vllm_transfers_ok_total{engine="0",model_name="/m"} 6.0
# HELP kvlink_vllm_transfers_failed_total (its help)
# TYPE kvlink_vllm_transfers_failed_total counter
kvlink_vllm_transfers_failed_total{engine="0",model_name="/m"} 1.0
# HELP kvlink_vllm_transfer_seconds (its help)
# TYPE kvlink_vllm_transfer_seconds histogram
kvlink_vllm_transfer_seconds_sum{engine="0",model_name="/m"} 0.12
kvlink_vllm_transfer_seconds_bucket{engine="0",le="0.05",model_name="/m"} 6.0
kvlink_vllm_transfer_seconds_bucket{engine="0",le="+Inf",model_name="/m"} 6.0
kvlink_vllm_transfer_seconds_count{engine="0",model_name="/m"} 6.0
# HELP kvlink_vllm_request_phase_seconds (its help)
# TYPE kvlink_vllm_request_phase_seconds histogram
kvlink_vllm_request_phase_seconds_sum{engine="0",model_name="/m",phase="kv_transfer"} 9.0
kvlink_vllm_request_phase_seconds_count{engine="0",model_name="/m",phase="kv_transfer"} 3.0
# HELP kvlink_vllm_request_last_phase_seconds (its help)
# TYPE kvlink_vllm_request_last_phase_seconds gauge
kvlink_vllm_request_last_phase_seconds{engine="0",model_name="/m",phase="kv_transfer",t="1"} 0.02
"""
VLLM_WITHOUT_KVLINK = "\n".join(
    ln for ln in VLLM.splitlines() if not ln.split(" ")[-2 if ln.startswith("#") else 0]
    .startswith("kvlink_vllm")
) + "\n"
PEER = "vllm-9f8e7d6c-aaaa-bbbb-cccc-1234567890ab"  # vLLM's agent names: vllm-<engine id>
AGENT = "vllm-0f1e2d3c-aaaa-bbbb-cccc-1234567890ab"


def agent_exposition(paths: int) -> str:
    lines = [f'kvlink_agent_up{{agent="{AGENT}"}} 1.0',
             f'kvlink_transfers_total{{agent="{AGENT}",op="pull",outcome="ok"}} 3.0']
    for p in range(paths):
        lv = (f'agent="{AGENT}",peer="{PEER}",path="{p}",local="198.18.{p}.1",'
              f'remote="198.18.{p}.2:41889",relay=""')
        lines += [
            f"kvlink_path_sent_bytes_total{{{lv}}} 1.23e9",
            f"kvlink_path_received_bytes_total{{{lv}}} 4.56e9",
            f"kvlink_path_inflight_bytes{{{lv}}} 6.7e7",
            f"kvlink_path_rate_bytes_per_second{{{lv}}} 1.1e9",
            f"kvlink_path_rtt_seconds{{{lv}}} 0.0123",
            f"kvlink_path_hedges_total{{{lv}}} 2.0",
            f'kvlink_path_state{{{lv},state="{"DEGRADED" if p else "UP"}"}} 1.0',
        ]
    return "\n".join(lines) + "\n"


@pytest.fixture
def serve() -> Iterator[dict[str, str]]:
    """An HTTP server on loopback answering /metrics with ``pages["/metrics"]``."""
    pages: dict[str, str] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write((body or "not found").encode())

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    pages["address"] = f"127.0.0.1:{srv.server_address[1]}"
    try:
        yield pages
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(autouse=True)
def _columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # rich's console width where stdout is no terminal


def test_paths_on_vllms_endpoint_says_where_the_paths_are(serve, capsys) -> None:  # type: ignore[no-untyped-def]
    serve["/metrics"] = VLLM
    for argv in (["paths", serve["address"]], ["paths", serve["address"], "--json"]):
        rc, out, err = run(capsys, *argv)
        assert rc == 1 and out == ""
        assert "is a vLLM server's endpoint" in err and "KVLINK_METRICS_PORT=" in err, err


def test_top_on_vllms_endpoint_shows_the_connectors_counters(serve, capsys) -> None:  # type: ignore[no-untyped-def]
    serve["/metrics"] = VLLM
    rc, out, err = run(capsys, "top", serve["address"], "--once", "--interval-ms", "10")
    assert rc == 0, err
    assert "engine 0  model /m" in out
    assert re.search(r"KV received, verified\s+30\.0 MiB", out), out
    assert re.search(r"transfers ok\s+6", out) and re.search(r"transfers failed\s+1", out), out
    assert re.search(r"transfer time \(mean\)\s+20\.0 ms", out), out
    assert "phase" not in out  # per-phase and per-request series are `kvlink trace`'s
    assert "KVLINK_METRICS_PORT=" in out  # where the paths are
    assert max(map(len, out.splitlines())) <= 80, out


@pytest.mark.parametrize("command", ["top", "paths"])
def test_no_kvlink_series_is_an_error_not_an_empty_table(serve, capsys, command) -> None:  # type: ignore[no-untyped-def]
    serve["/metrics"] = VLLM_WITHOUT_KVLINK
    extra = ["--once", "--interval-ms", "10"] if command == "top" else []
    rc, out, err = run(capsys, command, serve["address"], *extra)
    assert rc == 1 and out == ""
    assert "without KvlinkConnector's series" in err and "KVLINK_METRICS_PORT" in err, err
    serve["/metrics"] = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.0\n"
    rc, out, err = run(capsys, command, serve["address"], *extra)
    assert rc == 1 and "serves no kvlink series" in err, err


def test_an_agent_without_peers_is_named(serve, capsys) -> None:  # type: ignore[no-untyped-def]
    serve["/metrics"] = agent_exposition(0)
    rc, out, err = run(capsys, "paths", serve["address"])
    assert rc == 0, err
    assert f"agent {AGENT}" in out and "no paths: this agent has opened none" in out
    rc, out, _ = run(capsys, "paths", serve["address"], "--json")
    assert rc == 0 and out.strip() == "[]"


def test_top_fits_80_columns(serve, capsys) -> None:  # type: ignore[no-untyped-def]
    serve["/metrics"] = agent_exposition(4)
    rc, out, err = run(capsys, "top", serve["address"], "--once", "--interval-ms", "10")
    assert rc == 0, err
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80, "\n" + out
    assert f"peer {PEER}" in out  # the whole name, above its paths
    header = next(ln for ln in lines if ln.lstrip().startswith("path"))
    for col in ("state", "rate", "RTT", "sent", "recv.", "errors"):
        assert col in header, header
    assert "DEGRADED" in out and "4.25 GiB" in out  # 4.56e9 bytes received
    assert "left out at 80 columns:" in out


@pytest.mark.parametrize("width", [60, 80, 100, 132, 200])
def test_the_table_fits_every_width_and_keeps_the_essentials(width: int) -> None:
    snap = top.parse(agent_exposition(4), 0.0)
    console = Console(width=width, record=True)
    with console.capture() as cap:
        console.print(top.render(snap, None, "http://127.0.0.1:9400/metrics", width))
    out = cap.get()
    assert max(map(len, out.splitlines())) <= width, "\n" + out
    assert "UP" in out and "DEGRADED" in out
    if width >= 200:  # everything on one line per path, the peer in its own column
        assert "local -> remote" in out and "hedges" in out and f"peer {PEER}" not in out
