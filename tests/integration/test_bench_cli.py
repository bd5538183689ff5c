"""Smoke test of kvlink-bench: two real processes over loopback, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REQUIRE_ALL

FIELDS = {
    "tool",
    "op",
    "size_bytes",
    "chunk_bytes",
    "paths",
    "seconds",
    "gbps",
    "first_layer_s",
    "p50_s",
    "p99_s",
    "cpu_s",
    "limit_gbps",
    "ratio_to_limit",
}


def bench(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvlink.cli.bench", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_loopback_quick_json():
    out = bench("loopback", "--quick", "--json", "--layers", "4")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    kv = [r for r in rows if r.get("tool") == "kvlink"]
    assert len(kv) == 1
    r = kv[0]
    assert set(r) >= FIELDS, FIELDS - set(r)
    assert r["op"] == "push" and r["size_bytes"] == 16 << 20 and r["paths"] == 2
    assert r["gbps"] > 0 and r["seconds"] > 0 and r["verified"] is True
    assert 0 < r["first_layer_s"] <= r["seconds"]
    assert r["p50_s"] <= r["p99_s"]
    iperf = [x for x in rows if x.get("tool") == "iperf3"]
    if iperf:
        assert r["limit_gbps"] == iperf[0]["gbps"]
        assert r["ratio_to_limit"] == pytest.approx(r["gbps"] / r["limit_gbps"])
    elif REQUIRE_ALL:
        pytest.fail("iperf3 is required in CI for the limit measurement")


def test_pull_with_concurrency():
    out = bench(
        "loopback", "--quick", "--json", "--op", "pull", "--concurrency", "4", "--compare", "none"
    )
    assert out.returncode == 0, out.stderr
    (r,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert r["op"] == "pull" and r["concurrency"] == 4 and r["limit_gbps"] is None


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--mem", "cuda"], "UCX transport"),
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--compare", "rdma"], "--compare: unknown"),
    ],
)
def test_bad_arguments_are_named(argv, message):
    out = bench("loopback", "--quick", *argv)
    assert out.returncode == 2
    assert message in out.stderr


def test_run_refuses_peer_libraries():
    out = bench("run", "--connect", "127.0.0.1:1", "--compare", "iperf3,nixl")
    assert out.returncode == 2
    assert "--compare nixl: peer libraries are compared by `kvlink-bench loopback`" in out.stderr


def test_peers_that_cannot_run_are_reported_with_why(tmp_path):
    """--compare names peers; one not installed is a note with the reason, never dropped."""
    (tmp_path / "nixl_worker.py").write_text("")  # a worker, but setup.sh never ran
    out = bench(
        "loopback", "--quick", "--json", "--compare", "nixl,mooncake",
        "--peers-dir", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    notes = [x["note"] for x in lines if "note" in x]
    assert f"nixl: cannot run: not installed: run `bash {tmp_path}/setup.sh nixl`" in notes
    assert f"mooncake: cannot run: {tmp_path} has no mooncake_worker.py" in " ".join(notes)
    assert [x["tool"] for x in lines if "tool" in x] == ["kvlink"]


def test_kvlink_environment_settings_apply(monkeypatch):
    """kvlink-bench builds its Config with Config.load, so KVLINK_* tuning reaches both sides."""
    monkeypatch.setenv("KVLINK_WINDOW_CHUNKS", "not-a-number")
    out = bench("loopback", "--quick", "--json", "--compare", "none")
    assert out.returncode == 2
    assert out.stderr == "kvlink-bench: KVLINK_WINDOW_CHUNKS: cannot parse 'not-a-number'\n"
