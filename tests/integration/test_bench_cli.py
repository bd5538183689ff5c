"""Smoke test of kvlink-bench: two real processes over loopback, JSON out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvlink.bench.report import JSON_FIELDS, RUN_FIELDS
from tests.conftest import REQUIRE_ALL

FIELDS = set(JSON_FIELDS) | set(RUN_FIELDS)


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
    assert r["command"].endswith("kvlink-bench loopback --quick --json --layers 4")
    iperf = [x for x in rows if x.get("tool") == "iperf3"]
    if iperf:
        assert r["limit_gbps"] == iperf[0]["gbps"]
        assert r["ratio_to_limit"] == pytest.approx(r["gbps"] / r["limit_gbps"])
        over = "/".join(r["transports"])
        assert r["scenario"] == f"loopback {over} push 16MiB, 2 paths, 4 layers"
        assert r["baseline"] == "iperf3, 2 streams on the same paths"
        assert iperf[0]["scenario"] is None  # the baseline's own row is no figure
    elif REQUIRE_ALL:
        pytest.fail("iperf3 is required in CI for the limit measurement")


def test_tcp_limit_quick_json():
    """Each round: the plain-TCP baseline, then kvlink over TCP divided by it."""
    out = bench("tcp-limit", "--quick", "--json", "--iters", "2", "--io-threads", "1")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    (note,) = [r["note"] for r in rows if "note" in r]
    assert "kvlink/tcp-limit" in note and "CPU s/GiB" in note
    rows = [r for r in rows if "note" not in r]
    assert [(r["tool"], r["round"]) for r in rows] == [
        ("tcp-limit", 0), ("kvlink", 0), ("tcp-limit", 1), ("kvlink", 1)
    ]  # fmt: skip
    for base, kv in (rows[0:2], rows[2:4]):
        for r in (base, kv):
            assert set(r) >= FIELDS | {"cpu_s_per_gib", "cpu_cores"}, FIELDS - set(r)
            assert r["size_bytes"] == 16 << 20 and r["paths"] == 2 and r["verified"] is True
            assert r["gbps"] > 0 and r["cpu_s"] > 0
            assert r["cpu_s_per_gib"] == pytest.approx(r["cpu_s"] * (1 << 30) / r["size_bytes"])
        assert kv["transports"] == ["tcp"]
        assert kv["limit_gbps"] == base["gbps"] and base["ratio_to_limit"] == 1.0
        assert kv["ratio_to_limit"] == pytest.approx(kv["gbps"] / base["gbps"])


def test_tcp_limit_refuses_a_bad_io_threads():
    out = bench("tcp-limit", "--quick", "--io-threads", "many")
    assert out.returncode == 2
    assert "--io-threads" in out.stderr


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
        (["--mem", "cuda"], "--mem cuda: "),
        (["--concurrency", "0"], "argument --concurrency: 0 is out of range: must be at least 1"),
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


def test_quick_does_not_override_explicit_flags():
    """--quick only fills what was not given: --paths 3 and --size 8MiB stay."""
    out = bench("loopback", "--quick", "--json", "--compare", "none", "--paths", "3",
                "--size", "8MiB")  # fmt: skip
    assert out.returncode == 0, out.stderr
    (r,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert r["paths"] == 3 and r["size_bytes"] == 8 << 20
    assert r["chunk_bytes"] == 0  # auto, from --quick


@pytest.mark.timing
def test_size_zero_is_refused_before_any_process_starts():
    t0 = time.monotonic()
    out = bench("loopback", "--size", "0")
    assert out.returncode == 2
    assert "argument --size: '0': a size must be at least 1 byte" in out.stderr
    assert "serve did not start" not in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 20


def test_serve_that_fails_says_why():
    """A serve child that cannot start its agent: its reason, not a bare "did not start"."""
    env = dict(os.environ, KVLINK_NICS="loopback:0")
    out = subprocess.run(
        [sys.executable, "-m", "kvlink.cli.bench", "serve", "--nics", "loopback:0",
         "--bootstrap", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert out.returncode != 0
    assert "loopback:N" in out.stderr and "Traceback" not in out.stderr


def demo(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvlink.cli.bench", "demo", *argv],
        capture_output=True, text=True, timeout=timeout, check=False,
        env=dict(os.environ, COLUMNS="200"),
    )  # fmt: skip


def test_demo_shows_baselines_beside_the_result():
    out = demo("--paths", "2", "--layers", "4", "--blocks", "16")
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    assert "verified every byte" in text
    assert "memcpy of the same bytes" in text
    # the two processes share this host: the default transport copies process to process
    assert "transport: shm" in text
    if "iperf3, 2 streams on the same paths" in text:
        assert "of what iperf3 gets over TCP on the same host" in text
    elif REQUIRE_ALL:
        pytest.fail("iperf3 is required in CI for the demo's baseline")
    else:
        assert "iperf3: not installed" in text


@pytest.mark.timing
def test_failed_demo_fails_fast_with_the_reason():
    """A receiver that cannot allocate its cache: reported at once, with why."""
    t0 = time.monotonic()
    out = demo("--blocks", "100000000", "--timeout", "30", timeout=60)
    assert out.returncode == 1
    assert "decode-0: MemoryError" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 30


def _testbed_ready() -> bool:
    if os.geteuid() != 0:
        return False
    from kvlink import testbed as kt

    return kt.is_available()[0]


def kvlink_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlink.cli.main", *argv], capture_output=True,
                          text=True, timeout=timeout, check=False)  # fmt: skip


@pytest.fixture
def bench_tag():
    """A testbed tag of this test's own, taken down afterwards."""
    if not _testbed_ready():
        if REQUIRE_ALL:
            pytest.fail("the testbed (root, iproute2) is required in CI")
        pytest.skip("needs root and iproute2 (the testbed)")
    tag = f"bc{os.getpid() % 100000}"
    yield tag
    kvlink_cli("testbed", "down", "--tag", tag)


@pytest.mark.root
def test_testbed_tag_is_reused_as_it_is(bench_tag):
    """A testbed that is up is used as it is (not rebuilt to defaults) and left up."""
    up = kvlink_cli("testbed", "up", "--tag", bench_tag, "--links", "2", "--rate", "1gbit",
                    "--subnet-base", "7")  # fmt: skip
    assert up.returncode == 0, up.stderr
    out = bench("testbed", "--tag", bench_tag, "--quick", "--size", "4MiB", "--json",
                "--compare", "none", timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    notes = " ".join(x["note"] for x in lines if "note" in x)
    assert f"using testbed '{bench_tag}' as it is (left up): 2 links" in notes
    assert "198.18.7.0/24" in notes
    (row,) = [x for x in lines if x.get("tool") == "kvlink"]
    assert row["paths"] == 2
    status = kvlink_cli("testbed", "status", "--tag", bench_tag, "--json")
    assert status.returncode == 0 and len(json.loads(status.stdout)["links"]) == 2
    clash = bench("testbed", "--tag", bench_tag, "--links", "4", "--quick")
    assert clash.returncode == 2
    assert f"--links: testbed '{bench_tag}' is up and is used as it is" in clash.stderr


@pytest.mark.root
def test_testbed_built_for_the_run_takes_subnet_base_and_is_removed(bench_tag):
    out = bench("testbed", "--tag", bench_tag, "--links", "2", "--subnet-base", "9",
                "--quick", "--size", "4MiB", "--json", "--compare", "none",
                timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    notes = " ".join(json.loads(x)["note"] for x in out.stdout.splitlines() if '"note"' in x)
    assert "198.18.9.0/24, 198.18.10.0/24" in notes
    status = kvlink_cli("testbed", "status", "--tag", bench_tag, "--json")
    assert status.returncode == 3  # not up: removed after the run


@pytest.mark.tools("fio")
def test_store_rows_against_fio_and_memcpy(tmp_path):
    """kvlink-bench store: the disk tier both ways against fio, the host tier against memcpy
    (every block checked by the command itself), latency; rows for kvlink-bench table."""
    out = bench("store", "--size", "32MiB", "--block", "1MiB", "--layers", "8", "--iters", "1",
                "--dir", str(tmp_path), "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    figures = [r for r in rows if "ratio" in r]
    assert len(figures) == 3
    for r in figures:
        assert r["section"] == "store" and r["gbps"] > 0 and r["limit_gbps"] > 0
        assert r["ratio"] > 0 and "rounds" in r["detail"]
    assert "fio O_DIRECT" in figures[0]["baseline"] and "memcpy" in figures[2]["baseline"]
    (lat,) = [r for r in rows if "lookup_64_us" in r]
    assert lat["load_1_block_us"] > 0 and lat["load_64_blocks_ms"] > 0
    assert os.listdir(tmp_path) == []  # its files are gone


def test_store_without_fio_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no fio on it
    out = subprocess.run([sys.executable, "-m", "kvlink.cli.bench", "store"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "fio is not installed" in out.stderr
