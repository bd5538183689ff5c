"""Prometheus metrics, scraped over real HTTP from Config(metrics_port=0) or collected from a
host's own registry: values that move while a transfer runs and settle on its size, a path's
state change counted with its reason, outcomes, notifications, bad ports."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvlink

MiB = 1 << 20


def scrape(agent: Any) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of the agent's /metrics, by sample name."""
    host, port = agent.metrics_address
    text = httpx.get(f"http://{host}:{port}/metrics", timeout=5).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(samples: dict[str, Any], name: str, **labels: str) -> float:
    return sum(
        v for lv, v in samples.get(name, []) if all(lv.get(k) == x for k, x in labels.items())
    )


def until(what: Callable[[], Any], timeout_s: float = 10.0, why: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s} s: {why}")
        time.sleep(0.05)
    return got


def test_bytes_move_while_a_push_runs_and_equal_its_size(make_agent, scripted_receiver):
    # The receiver withholds its ACKs: the push is in flight for certain while we scrape.
    size = 48 * MiB
    rx = scripted_receiver("rx", paths=2, region="kv", nbytes=size)
    # No hedging, and no stall cut while the ACKs are held (at least 3 ticks of 2 s): a hedge
    # or a retry sends a second copy of a chunk, which the path counters count.
    tx = make_agent(
        "tx",
        nics="loopback:2",
        metrics_port=0,
        chunk_bytes=4 * MiB,
        hedge=False,
        monitor_interval_ms=2000,
        stall_factor=1000,
    )
    src = np.ones(size, np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata)
    before = scrape(tx)
    assert total(before, "kvlink_path_sent_bytes_total") == 0
    assert total(before, "kvlink_agent_up", agent="tx") == 1
    h = tx.push("rx", src, "kv")
    assert rx.data_seen.wait(10)

    def moving() -> Any:
        s = scrape(tx)
        return s if total(s, "kvlink_path_sent_bytes_total") > 0 else None

    mid = until(moving, why="sent bytes moving")
    assert not h.done
    assert 0 < total(mid, "kvlink_path_sent_bytes_total") <= size
    assert total(mid, "kvlink_path_inflight_bytes") > 0
    assert total(mid, "kvlink_transfer_seconds_count") == 0  # not finished: not counted yet
    rx.release()
    assert h.wait(30).ok
    end = scrape(tx)
    # every byte sent once (no hedges, no retries on loopback): the paths add up to the push
    assert total(end, "kvlink_path_sent_bytes_total", peer="rx") == size
    assert total(end, "kvlink_transfer_bytes_total", peer="rx", op="push") == size
    assert total(end, "kvlink_transfers_total", outcome="ok") == 1
    assert total(end, "kvlink_transfer_seconds_count", op="push") == 1
    assert total(end, "kvlink_transfer_first_chunk_seconds_count", op="push") == 1
    assert total(end, "kvlink_transfer_first_layer_seconds_count", op="push") == 1
    assert h.info().t_submit_ns < h.info().t_first_layer_ns <= h.info().t_done_ns
    assert total(end, "kvlink_path_chunks_total", peer="rx") == h.info().chunks_total
    assert total(end, "kvlink_path_inflight_bytes") == 0
    in_service = ("UP", "DEGRADED")  # DEGRADED follows the measured rate: in service still
    assert sum(total(end, "kvlink_path_state", state=x) for x in in_service) == 2
    assert sum(total(end, "kvlink_paths", state=x) for x in in_service) == 2


def test_pull_counts_received_bytes_and_the_peer_its_notifications(make_agent):
    size = 8 * MiB
    puller = make_agent("puller", nics="loopback:2", metrics_port=0, hedge=False)
    owner = make_agent("owner", nics="loopback:2", metrics_port=0)
    owner.register(np.full(size, 3, np.uint8), remote_read=True, name="kv")
    dst = puller.register(np.zeros(size, np.uint8))
    puller.add_peer(owner.metadata())
    assert puller.pull("owner", "kv", dst, notify=b"req-1").wait(10).ok
    assert [n.tag for n in owner.notifications(5.0)] == [b"req-1"]
    s = scrape(puller)
    assert total(s, "kvlink_path_received_bytes_total", peer="owner") == size
    assert total(s, "kvlink_path_sent_bytes_total", peer="owner") == 0
    assert total(s, "kvlink_transfer_bytes_total", op="pull") == size
    assert total(scrape(owner), "kvlink_notifications_total", peer="puller") == 1


def test_a_cut_path_is_counted_with_its_reason(make_agent):
    tx = make_agent("tx", nics="loopback:2", metrics_port=0)
    rx = make_agent("rx", nics="loopback:2")
    rx.register(np.zeros(MiB, np.uint8), remote_write=True, name="kv")
    src = tx.register(np.ones(MiB, np.uint8))
    tx.add_peer(rx.metadata())
    assert tx.push("rx", src, "kv").wait(10).ok
    assert total(scrape(tx), "kvlink_path_state_changes_total", to_state="DOWN") == 0
    rx.close()  # every path to it is cut

    def down() -> Any:
        s = scrape(tx)
        return (
            s
            # from UP, or from DEGRADED when the loaded host slowed a path for a tick
            if total(s, "kvlink_path_state_changes_total", to_state="DOWN") >= 2
            else None
        )

    s = until(down, why="both paths' change to DOWN counted")
    reasons = {
        lv["reason"]
        for lv, v in s["kvlink_path_state_changes_total"]
        if lv["to_state"] == "DOWN" and v
    }
    assert any("closed" in r or "reset" in r or "lost" in r for r in reasons), reasons
    assert total(s, "kvlink_path_state", state="UP") == 0
    assert total(s, "kvlink_paths", state="UP") == 0


def test_failed_transfer_is_counted_by_outcome(make_agent, scripted_receiver):
    rx = scripted_receiver("rx", paths=1, region="kv", nbytes=8 * MiB)
    tx = make_agent("tx", metrics_port=0)
    src = tx.register(np.ones(8 * MiB, np.uint8))
    tx.add_peer(rx.metadata)
    h = tx.push("rx", src, "kv", timeout_s=5)
    assert rx.data_seen.wait(10)
    rx.kill()
    with pytest.raises(kvlink.ConnectionLostError):  # at its deadline, every path down
        h.wait(30)
    s = scrape(tx)
    assert total(s, "kvlink_transfers_total", outcome="ConnectionLostError") == 1
    assert total(s, "kvlink_transfers_total", outcome="ok") == 0
    assert total(s, "kvlink_transfer_failures_total", peer="rx") == 1


def test_host_registry_collects_two_agents(make_agent):
    a = make_agent("a")
    b = make_agent("b")
    reg = CollectorRegistry()
    reg.register(a.metrics())
    reg.register(b.metrics())
    assert a.metrics() is a.metrics()
    b.register(np.zeros(MiB, np.uint8), remote_write=True, name="kv")
    src = a.register(np.ones(MiB, np.uint8))
    a.add_peer(b.metadata())
    assert a.push("b", src, "kv").wait(10).ok
    text = generate_latest(reg).decode()
    assert 'kvlink_agent_up{agent="a"} 1.0' in text and 'kvlink_agent_up{agent="b"} 1.0' in text
    assert 'kvlink_transfer_bytes_total{agent="a",op="push",peer="b"} 1.048576e+06' in text
    b.close()
    assert 'kvlink_agent_up{agent="b"} 0.0' in generate_latest(reg).decode()


def test_busy_metrics_port_is_a_clear_error(make_agent):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(kvlink.ConfigError, match=f"metrics_port: cannot serve .*:{port}"):
            make_agent("m", metrics_port=port)
    # the failed agent left nothing behind: the name is free again
    make_agent("m", metrics_port=0)


def test_metrics_server_stops_at_close(make_agent):
    a = make_agent("a", metrics_port=0)
    host, port = a.metrics_address
    assert httpx.get(f"http://{host}:{port}/metrics", timeout=5).status_code == 200
    a.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{host}:{port}/metrics", timeout=2)


def test_kvlink_top_and_paths_read_the_endpoint(make_agent, capsys):
    import json

    from kvlink.cli.main import main

    tx = make_agent("tx", nics="loopback:2", metrics_port=0, hedge=False)
    rx = make_agent("rx", nics="loopback:2")
    rx.register(np.zeros(4 * MiB, np.uint8), remote_write=True, name="kv")
    src = tx.register(np.ones(4 * MiB, np.uint8))
    tx.add_peer(rx.metadata())
    assert tx.push("rx", src, "kv").wait(10).ok
    host, port = tx.metrics_address
    assert main(["paths", f"{host}:{port}", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["peer"], r["path"]) for r in rows] == [("rx", 0), ("rx", 1)]
    assert sum(r["sent_bytes"] for r in rows) == 4 * MiB
    assert all(r["state"] in ("UP", "DEGRADED") and r["errors"] == 0 for r in rows)
    rx.close()
    in_service = (kvlink.PathState.UP, kvlink.PathState.DEGRADED)
    until(lambda: all(p.state not in in_service for p in tx.paths()), why="paths down")
    assert main(["top", f"http://{host}:{port}/metrics", "--once", "--interval-ms", "10"]) == 0
    out = capsys.readouterr().out
    assert "kvlink top" in out and "rx" in out and "connection closed by the peer" in out
    assert main(["paths", f"{host}:{port}", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["errors"] for r in rows] == [1, 1]  # each path left service once
    tx.close()
    assert main(["paths", f"{host}:{port}"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_receiver_accounts_pushes_it_took_through_inbound(make_agent):
    size = 8 * MiB
    tx = make_agent("tx", nics="loopback:2")
    rx = make_agent("rx", nics="loopback:2", metrics_port=0)
    dst = np.zeros(size, np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = tx.register(np.full(size, 5, np.uint8))
    tx.add_peer(rx.metadata())
    h = tx.push("rx", src, "kv", notify=b"req-9")
    inbound = rx.inbound(b"req-9", timeout_s=10)
    inbound.wait(10)
    assert h.wait(10).ok and (dst == 5).all()
    s = scrape(rx)
    assert total(s, "kvlink_inbound_bytes_total", peer="tx") == size
    assert total(s, "kvlink_inbound_transfers_total", peer="tx", outcome="ok") == 1
    assert total(s, "kvlink_inbound_seconds_count") == 1
