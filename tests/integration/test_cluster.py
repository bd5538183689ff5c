"""Discovery through a real etcd (docs/cluster.md): publication under a lease, look-up on
push / pull / prepare, lease expiry, etcd restarts (with and without its data), a restarted
peer picked up. Every test starts its own etcd server on free ports in a temp folder."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

import kvlink
from kvlink._discovery import make_record, parse_record
from tests.conftest import require_tool

SECRET = "cluster-secret-for-the-tests-0123456789"
MiB = 1 << 20
# short leases and refreshes keep the tests quick; every wait below is bounded
FAST = {"discovery_ttl_s": 2.0, "discovery_refresh_s": 0.1, "discovery_timeout_s": 1.0}


@pytest.fixture
def cluster(etcd: Any, make_agent: Callable[..., Any]) -> Callable[..., Any]:
    """Agents published in the test's etcd (prefix "t"), with the cluster secret."""

    def make(name: str, **cfg: Any) -> Any:
        opts: dict[str, Any] = {"discovery": etcd.url("t"), "secret": SECRET, **FAST}
        opts.update(cfg)
        return make_agent(name, **opts)

    return make


def etcd_call(etcd: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"http://{etcd.endpoint}/v3/{path}", json=body, timeout=5)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def etcd_get(etcd: Any, key: str) -> dict[str, Any] | None:
    kvs = etcd_call(etcd, "kv/range", {"key": base64.b64encode(key.encode()).decode()}).get("kvs")
    return kvs[0] if kvs else None


def until(what: Callable[[], Any], timeout_s: float = 10.0, why: str = "") -> Any:
    """Polls ``what`` until it is truthy; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s} s: {why}")
        time.sleep(0.05)


def pair(cluster: Callable[..., Any], rx_name: str = "decode-3") -> tuple[Any, Any, Any, Any]:
    tx = cluster("prefill-0")
    rx = cluster(rx_name)
    dst = np.zeros(4 * MiB, np.uint8)
    rx.register(dst, remote_write=True, remote_read=True, name="kv")
    src = np.random.default_rng(1).integers(0, 255, 4 * MiB, dtype=np.uint8)
    tx.register(src)
    return tx, rx, src, dst


@pytest.mark.timing
def test_publishes_under_a_lease_and_never_the_secret(cluster, etcd):
    a = cluster("decode-0")
    a.register(np.zeros(MiB, np.uint8), remote_write=True, name="kv")
    raw = etcd_get(etcd, "/t/agents/decode-0")
    assert raw is not None, "the agent is not published"
    lease = int(raw["lease"])
    assert lease == a.discovery.lease != 0
    ttl = etcd_call(etcd, "lease/timetolive", {"ID": str(lease)})
    assert 0 < int(ttl["TTL"]) <= 2
    # the record is re-published with the new region's key, sealed under the secret
    md = json.loads(a.metadata())
    want = {int(k): bytes.fromhex(v) for k, v in md["keys"].items()}

    def published_keys() -> bytes | None:
        v = base64.b64decode(etcd_get(etcd, "/t/agents/decode-0")["value"])
        rec = parse_record("decode-0", v, SECRET.encode(), "/t/")
        return v if rec.keys == want else None

    value = until(published_keys, why="re-publication after register()")
    assert parse_record("decode-0", value, b"another-secret-0123456789", "/t/").keys is None
    rec = json.loads(value)
    assert rec["name"] == "decode-0" and rec["instance"] == f"{a.instance_id:016x}"
    assert [tuple(x) for x in rec["addrs"]] == a.addresses
    assert "keys" not in rec and "sealed" in rec
    for key in md["keys"].values():
        assert key not in value.decode() and bytes.fromhex(key) not in value
    assert SECRET.encode() not in value and SECRET.encode().hex().encode() not in value
    # the keep-alive keeps it past its TTL
    time.sleep(3)
    assert etcd_get(etcd, "/t/agents/decode-0") is not None
    # close revokes the lease: the key goes at once and the thread stops
    thread = a.discovery._thread
    a.close()
    assert etcd_get(etcd, "/t/agents/decode-0") is None
    assert not thread.is_alive()


def test_push_pull_prepare_look_the_peer_up(cluster):
    tx, rx, src, dst = pair(cluster)
    assert [p.name for p in tx.peers() if p.connected] == []
    h = tx.push("decode-3", src, "kv")  # not added: found through etcd
    assert h.wait(10).ok
    assert np.array_equal(dst, src)
    got = {p.name: p for p in tx.peers()}
    assert got["decode-3"].connected and got["decode-3"].instance == rx.instance_id
    # pull and prepare to a peer not added yet
    back = np.zeros(4 * MiB, np.uint8)
    tx.register(back)
    other = cluster("decode-4")
    odst = np.arange(4 * MiB, dtype=np.uint64).astype(np.uint8)
    other.register(odst, remote_read=True, name="kv")
    assert tx.pull("decode-4", "kv", back).wait(10).ok
    assert np.array_equal(back, odst)
    third = cluster("decode-5")
    paths = tx.prepare("decode-5", nbytes=MiB)
    assert paths and all(p.peer == "decode-5" for p in paths)
    assert third.notifications(5.0)[0].op == kvlink.Op.PREPARE
    with pytest.raises(kvlink.UnknownPeerError, match=r"discovery \(etcd://.*\) lists no agent"):
        tx.push("nobody", src, "kv")


def test_region_registered_after_the_look_up_is_found(cluster):
    tx, rx, src, _ = pair(cluster)
    assert tx.push("decode-3", src, "kv").wait(10).ok
    late = np.zeros(4 * MiB, np.uint8)
    rx.register(late, remote_write=True, name="late")  # after tx read rx's record
    assert tx.push("decode-3", src, "late").wait(10).ok
    assert np.array_equal(late, src)


def test_without_a_secret_keys_are_not_published(etcd, make_agent):
    url = etcd.url("ns")
    tx = make_agent("tx", discovery=url, **FAST)
    rx = make_agent("rx", discovery=url, **FAST)
    rx.register(np.zeros(MiB, np.uint8), remote_write=True, name="kv")
    src = np.ones(MiB, np.uint8)
    tx.register(src)
    rec = json.loads(base64.b64decode(etcd_get(etcd, "/ns/agents/rx")["value"]))
    assert "sealed" not in rec and "keys" not in rec
    with pytest.raises(kvlink.RemoteAccessError, match="no cluster secret"):
        tx.push("rx", src, "kv")
    tx.add_peer(rx.metadata())  # keys by hand, as with static exchange
    assert tx.push("rx", src, "kv").wait(10).ok


def test_another_secret_cannot_open_the_keys(etcd, make_agent):
    url = etcd.url("t")
    rx = make_agent("rx", discovery=url, secret=SECRET, **FAST)
    rx.register(np.zeros(MiB, np.uint8), remote_write=True, name="kv")
    tx = make_agent("tx", discovery=url, secret="another-secret-0123456789abcdef", **FAST)
    src = tx.register(np.ones(MiB, np.uint8))
    rec = tx.discovery.lookup("rx")
    assert rec is not None and rec.keys is None
    with pytest.raises(kvlink.AuthenticationError):
        tx.push("rx", src, "kv")


def test_lease_expiry_removes_the_peer_and_fails_its_transfer(etcd, make_agent, scripted_receiver):
    # The receiver withholds its ACKs, so the push is in flight for certain when its lease ends.
    rx = scripted_receiver("rx", paths=2, region="kv", nbytes=16 * MiB)
    lease = int(etcd_call(etcd, "lease/grant", {"TTL": 30})["ID"])
    record = make_record("rx", rx.instance, rx.addresses, {}, None, "/t/")
    etcd_call(
        etcd,
        "kv/put",
        {
            "key": base64.b64encode(b"/t/agents/rx").decode(),
            "value": base64.b64encode(record).decode(),
            "lease": str(lease),
        },
    )
    tx = make_agent("tx", nics="loopback:2", discovery=etcd.url("t"), **FAST)
    src = np.ones(16 * MiB, np.uint8)
    tx.register(src)
    with pytest.raises(kvlink.RemoteAccessError, match="no cluster secret"):
        tx.push("rx", src, "kv")  # found and connected; no secret, so no key came with it
    tx.add_peer(rx.metadata)  # the key by hand; discovery still watches the peer
    h = tx.push("rx", src, "kv")
    assert rx.data_seen.wait(10), "the push sent no DATA"
    assert not h.done
    etcd_call(etcd, "lease/revoke", {"ID": str(lease)})  # as if it had expired
    with pytest.raises(
        kvlink.ConnectionLostError, match="discovery removed peer 'rx': its discovery lease expired"
    ):
        h.wait(10)
    until(lambda: not any(p.peer == "rx" for p in tx.paths()), why="rx's paths gone")
    assert "rx" not in [p.name for p in tx.peers()]


def test_etcd_restart_keeps_everyone_published(cluster, etcd):
    tx, rx, src, _dst = pair(cluster)
    assert tx.push("decode-3", src, "kv").wait(10).ok
    lease = rx.discovery.lease
    etcd.restart(down_s=0.5)  # with its data: the leases survive
    assert tx.push("decode-3", src, "kv").wait(10).ok
    until(lambda: etcd_get(etcd, "/t/agents/decode-3"), why="decode-3 listed after a restart")
    assert rx.discovery.lease == lease
    assert "decode-3" in [p.name for p in tx.peers() if p.connected]


def test_etcd_losing_its_data_is_repaired_by_re_publication(cluster, etcd):
    tx, rx, src, dst = pair(cluster)
    assert tx.push("decode-3", src, "kv").wait(10).ok
    etcd.restart(wipe=True)  # every key and lease gone
    until(
        lambda: etcd_get(etcd, "/t/agents/decode-3") and etcd_get(etcd, "/t/agents/prefill-0"),
        why="both agents published again",
    )
    assert rx.discovery.republished >= 1
    # a newcomer finds rx through the new etcd; tx kept rx (its key came back within the grace)
    late = cluster("late")
    late_src = late.register(np.full(4 * MiB, 7, np.uint8))
    assert late.push("decode-3", late_src, "kv").wait(10).ok
    assert (dst == 7).all()
    assert tx.push("decode-3", src, "kv").wait(10).ok
    assert np.array_equal(dst, src)
    # discovery's view converges within a refresh round (on a loaded host the key may come back
    # after the grace, and tx then finds rx again through the look-up its push made)
    until(
        lambda: "decode-3" in [p.name for p in tx.peers() if p.connected and p.discovered],
        why="decode-3 listed as connected through discovery",
    )


def test_restarted_peer_is_picked_up(cluster):
    tx, rx, src, _ = pair(cluster)
    assert tx.push("decode-3", src, "kv").wait(10).ok
    old = rx.instance_id
    rx.close()
    rx2 = cluster("decode-3")  # the same name, a new instance, new ports
    dst2 = np.zeros(4 * MiB, np.uint8)
    rx2.register(dst2, remote_write=True, name="kv")
    assert rx2.instance_id != old
    until(
        lambda: any(
            p.name == "decode-3" and p.instance == rx2.instance_id and p.connected
            for p in tx.peers()
        ),
        why="tx connected to the restarted decode-3",
    )
    assert tx.push("decode-3", src, "kv").wait(10).ok
    assert np.array_equal(dst2, src)


def test_many_threads_look_up_one_peer_once(cluster):
    tx, _rx, src, _dst = pair(cluster)
    errors: list[BaseException] = []

    def push() -> None:
        try:
            tx.push("decode-3", src, "kv", nbytes=MiB).wait(10)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=push) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert [p.name for p in tx.peers() if p.connected] == ["decode-3"]


def test_unreachable_etcd_does_not_stop_the_agent(make_agent, caplog):
    from kvlink.bench.ports import free_port

    url = f"etcd://127.0.0.1:{free_port()}/t"
    a = make_agent("a", discovery=url, **FAST)
    assert "cannot reach etcd" in caplog.text
    with pytest.raises(kvlink.DiscoveryError, match="cannot reach etcd"):
        a.push("b", np.zeros(8, np.uint8), "kv")


def test_malformed_records_are_refused(cluster, etcd):
    a = cluster("a")
    for name, value in [
        ("b", b"not json"),
        (
            "c",
            json.dumps(
                {"kvlink": 1, "name": "other", "instance": "0" * 16, "addrs": [["127.0.0.1", 1]]}
            ).encode(),
        ),
        (
            "d",
            json.dumps(
                {"kvlink": 1, "name": "d", "instance": "0" * 16, "addrs": [["127.0.0.1", 70000]]}
            ).encode(),
        ),
        ("e", b"x" * (70 * 1024)),
    ]:
        etcd_call(
            etcd,
            "kv/put",
            {
                "key": base64.b64encode(f"/t/agents/{name}".encode()).decode(),
                "value": base64.b64encode(value).decode(),
            },
        )
        with pytest.raises(kvlink.DiscoveryError, match=f"malformed record for '{name}'"):
            a.push(name, np.zeros(8, np.uint8), "kv")
    # a whole background round that began after the last record was written (the one
    # under way may have read etcd before it)
    done = a.discovery.rounds
    until(lambda: a.discovery.rounds >= done + 2, why="two discovery rounds")
    assert [p.name for p in a.peers()] == []  # none of them is listed


def test_every_metric_the_dashboard_and_docs_name_exists(cluster):
    """examples/grafana-kvlink.json and docs/cluster.md name only metrics an agent exports."""
    import re
    from pathlib import Path

    from prometheus_client import CollectorRegistry, generate_latest

    a = cluster("a")
    reg = CollectorRegistry()
    reg.register(a.metrics())
    exported = set(re.findall(r"^# TYPE (\S+) (\S+)", generate_latest(reg).decode(), re.M))
    names = set()
    for name, kind in exported:
        names.add(name)
        if kind == "counter":
            names.add(f"{name}_total")
        if kind == "histogram":
            names.update(f"{name}_{s}" for s in ("bucket", "count", "sum"))
    root = Path(__file__).resolve().parents[2]
    for doc in (root / "examples/grafana-kvlink.json", root / "docs/cluster.md"):
        used = set(re.findall(r"\bkvlink_[a-z_]+[a-z]", doc.read_text()))
        # kvlink_vllm_*: the vLLM connector's, served by vLLM (tests/vllm/test_metrics.py)
        used = {u for u in used if not u.startswith("kvlink_vllm")}
        assert used, doc
        assert used <= names, f"{doc.name} names metrics nobody exports: {sorted(used - names)}"


def test_etcd_authentication(etcd, make_agent, caplog):
    for path, body in [
        ("auth/role/add", {"name": "root"}),
        ("auth/user/add", {"name": "root", "password": "etcd-pw"}),
        ("auth/user/grant", {"user": "root", "role": "root"}),
        ("auth/enable", {}),
    ]:
        etcd_call(etcd, path, body)
    opts = {"discovery": etcd.url("t"), "secret": SECRET, **FAST}
    rx = make_agent("rx", discovery_user="root", discovery_password="etcd-pw", **opts)
    rx.register(np.zeros(MiB, np.uint8), remote_write=True, name="kv")
    tx = make_agent("tx", discovery_user="root", discovery_password="etcd-pw", **opts)
    src = tx.register(np.ones(MiB, np.uint8))
    assert tx.push("rx", src, "kv").wait(10).ok
    anon = make_agent("anon", **opts)  # no credentials: etcd refuses, the agent says why
    assert "refused" in caplog.text
    with pytest.raises(kvlink.DiscoveryError, match="refused"):
        anon.push("rx", np.zeros(8, np.uint8), "kv")
    wrong = make_agent("wrong", discovery_user="root", discovery_password="nope", **opts)
    with pytest.raises(kvlink.DiscoveryError, match=r"refused user 'root'.*discovery_password"):
        wrong.push("rx", np.zeros(8, np.uint8), "kv")


@pytest.mark.timing
def test_a_killed_peer_process_expires_and_a_new_one_is_found(cluster, etcd, spawn_peer):
    # A real agent in another process, killed (no close, no revoke): its lease runs out.
    opts = {"discovery": etcd.url("t"), "secret": SECRET, **FAST}
    rx = spawn_peer("rx", **opts)
    rx.call("alloc", key="kv", nbytes=MiB, remote_write=True, name="kv")
    tx = cluster("tx")
    src = tx.register(np.ones(MiB, np.uint8))
    assert tx.push("rx", src, "kv").wait(10).ok
    t_kill = time.monotonic()
    rx.kill()
    until(lambda: "rx" not in [p.name for p in tx.peers()], timeout_s=20,
          why="the dead peer removed once its lease expired")
    gone_after = time.monotonic() - t_kill
    assert gone_after >= FAST["discovery_ttl_s"] - 0.5, "removed before its lease could expire"
    with pytest.raises(kvlink.UnknownPeerError, match="lists no agent"):
        tx.push("rx", src, "kv")
    rx2 = spawn_peer("rx2", **opts)  # a new process publishing another name
    rx2.call("alloc", key="kv", nbytes=MiB, remote_write=True, name="kv")
    assert tx.push("rx2", src, "kv").wait(10).ok


def test_a_push_to_a_restarted_peer_finds_the_new_instance_itself(cluster):
    # refreshes far apart: the push, not the background round, must notice the restart
    slow = {"discovery_refresh_s": 5.0, "discovery_ttl_s": 20.0}
    tx = cluster("tx", **slow)
    rx = cluster("rx", **slow)
    rx.register(np.zeros(MiB, np.uint8), remote_write=True, name="kv")
    src = tx.register(np.ones(MiB, np.uint8))
    assert tx.push("rx", src, "kv").wait(10).ok
    rx.close()
    until(lambda: all(p.state not in (kvlink.PathState.UP, kvlink.PathState.DEGRADED)
                      for p in tx.paths() if p.peer == "rx"), why="old paths down")
    rx2 = cluster("rx", **slow)
    dst2 = np.zeros(MiB, np.uint8)
    rx2.register(dst2, remote_write=True, name="kv")
    assert tx.push("rx", src, "kv").wait(10).ok
    assert (dst2 == 1).all()


def _make_tls_files(folder: Any) -> tuple[str, str, str]:
    """A CA and a server certificate for 127.0.0.1 signed by it (PEM files in ``folder``)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvlink test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = (folder / "ca.pem", folder / "server.pem", folder / "server.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(paths[0]), str(paths[1]), str(paths[2])


def test_discovery_over_tls(make_agent, tmp_path):
    require_tool("etcd")
    from kvlink.bench.etcd import EtcdServer

    ca, cert, key = _make_tls_files(tmp_path)
    server = EtcdServer(tls=(ca, cert, key))
    try:
        opts = {"discovery": server.url("t"), "secret": SECRET, "discovery_ca_file": ca, **FAST}
        assert opts["discovery"].startswith("etcds://")
        rx = make_agent("rx", **opts)
        rx.register(np.zeros(MiB, np.uint8), remote_write=True, name="kv")
        tx = make_agent("tx", **opts)
        src = tx.register(np.ones(MiB, np.uint8))
        assert tx.push("rx", src, "kv").wait(10).ok
        # without the CA the certificate is not trusted: etcd cannot be reached
        untrusting = make_agent("untrusting", **{**opts, "discovery_ca_file": None})
        with pytest.raises(kvlink.DiscoveryError, match=r"cannot reach etcd.*(CERTIFICATE|certif)"):
            untrusting.push("rx", src, "kv")
    finally:
        server.close()


def test_relays_are_found_through_discovery_and_keep_the_key_sealed(cluster, etcd):
    relay = cluster("relay-9", nics="127.0.0.3", relay=True, accept_relayed=False)
    tx = cluster("prefill-0", nics="127.0.0.1")
    rx = cluster("decode-3", nics="127.0.0.2")
    dst = np.zeros(8 * MiB, np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = np.random.default_rng(2).integers(0, 255, 8 * MiB, dtype=np.uint8)
    tx.register(src)
    until(lambda: tx.relays() == ["relay-9"], why="the relay found through etcd")
    assert tx.push("decode-3", src, "kv").wait(10).ok  # looked up and added through etcd
    assert np.array_equal(dst, src)
    via = [p for p in tx.paths() if p.peer == "decode-3" and p.relay]
    assert [p.relay for p in via] == ["relay-9"]
    until(lambda: any(p.state.name == "UP" for p in tx.paths() if p.relay), why="relayed path up")
    # the end-to-end key is in the record only sealed under the cluster secret
    raw = base64.b64decode(etcd_get(etcd, "/t/agents/decode-3")["value"])
    rec = json.loads(raw)
    key_hex = json.loads(rx.metadata())["e2e"]
    assert "sealed_e2e" in rec and key_hex not in raw.decode()
    relay.close()
    until(lambda: tx.relays() == [], timeout_s=15, why="the stopped relay forgotten")
