"""Authenticated peers: with a cluster secret every connection proves that
both ends hold it before anything it carries is trusted (docs/security.md)."""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import time

import numpy as np
import pytest

import kvlink
from tests import wire_client as wc

MiB = 1 << 20
SECRET = "kvlink-test-secret-0123456789"
OTHER = "another-secret-abcdefghijklmn"


def test_agents_with_one_secret_push_and_pull(make_agent):
    rx = make_agent("rx", nics="loopback:2", secret=SECRET)
    tx = make_agent("tx", nics="loopback:2", secret=SECRET)
    dst = np.zeros(4 * MiB, np.uint8)
    rx.register(dst, name="kv", remote_write=True, remote_read=True)
    src = np.arange(4 * MiB, dtype=np.uint32).astype(np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata())
    tx.push("rx", src=src, dst="kv").wait(timeout_s=30)
    assert np.array_equal(dst, src)
    back = np.zeros_like(src)
    tx.register(back)
    tx.pull("rx", src="kv", dst=back).wait(timeout_s=30)
    assert np.array_equal(back, src)
    assert len(tx.paths()) == 2


@pytest.mark.parametrize(
    ("rx_secret", "tx_secret", "says"),
    [
        (SECRET, OTHER, "different"),  # both prove something; neither is believed
        (SECRET, None, "requires authentication"),
        (None, SECRET, "no secret"),
    ],
)
def test_a_wrong_or_missing_secret_is_refused_on_both_sides(
    make_agent, caplog, rx_secret, tx_secret, says
):
    caplog.set_level(logging.WARNING, logger="kvlink")
    rx = make_agent("rx", secret=rx_secret)
    tx = make_agent("tx", secret=tx_secret)
    rx.register(np.zeros(MiB, np.uint8), name="kv", remote_write=True)
    with pytest.raises(kvlink.AuthenticationError, match=says):
        tx.add_peer(rx.metadata())
    assert tx.paths() == []
    with pytest.raises(kvlink.UnknownPeerError):
        tx.push("rx", src=np.zeros(MiB, np.uint8), dst="kv")


def test_the_reason_of_a_refusal_is_whole_with_the_longest_names(make_agent):
    """Two 63-byte names (vLLM's are "vllm-<uuid>", 41): the reason was cut at 256 bytes,
    mid-sentence, on its way out of the connecting thread."""
    rx = make_agent("r" * 63, secret=SECRET)
    tx = make_agent("t" * 63, secret=OTHER)
    with pytest.raises(kvlink.AuthenticationError) as info:
        tx.add_peer(rx.metadata())
    assert str(info.value).endswith("or something else answers there"), str(info.value)


def test_listener_logs_who_it_refused(make_agent, caplog):
    caplog.set_level(logging.WARNING, logger="kvlink")
    rx = make_agent("rx", secret=SECRET)
    tx = make_agent("tx", secret=OTHER)
    with pytest.raises(kvlink.AuthenticationError):
        tx.add_peer(rx.metadata())

    def logged() -> bool:
        msgs = [r.getMessage() for r in caplog.records]
        return any("claiming to be 'tx'" in m and "different cluster secrets" in m for m in msgs)

    # tx gives up as soon as it cannot verify rx, perhaps before rx has read tx's answer: the
    # record comes when rx's engine gets to it (a loaded host: later), through the log drain
    deadline = time.monotonic() + 10
    while not logged() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert logged(), caplog.text


def _listener(agent: kvlink.Agent) -> socket.socket:
    host, port = agent.addresses[0]
    s = socket.create_connection((host, port), timeout=5)
    return s


def test_nothing_behind_an_unauthenticated_hello_is_processed(make_agent):
    """A HELLO without the challenge-response is answered AUTH and the NOTIFY
    queued right behind it is never delivered."""
    rx = make_agent("rx", secret=SECRET)
    with _listener(rx) as s:
        s.sendall(wc.hello("mallory", 1) + wc.notify(1, b"forged"))
        t, body = wc.recv_frame(s)
        assert t == wc.HELLO_ACK
        assert struct.unpack_from("<I", body)[0] == kvlink.ErrorCode.AUTH
    assert rx.notifications(timeout_s=0.5) == []


def test_a_forged_proof_is_refused(make_agent):
    rx = make_agent("rx", secret=SECRET)
    with _listener(rx) as s:
        s.sendall(wc.hello("mallory", 1, nonce=bytes(16)))
        t, _ = wc.recv_frame(s)
        assert t == wc.CHALLENGE
        s.sendall(wc.frame(wc.AUTH, struct.pack("<I", 0) + bytes(32)) + wc.notify(1, b"forged"))
        t, body = wc.recv_frame(s)
        assert t == wc.HELLO_ACK
        assert struct.unpack_from("<I", body)[0] == kvlink.ErrorCode.AUTH
    assert rx.notifications(timeout_s=0.5) == []


def test_the_documented_proof_is_accepted(make_agent):
    """docs/wire-protocol.md's recipe, computed independently in Python."""
    rx = make_agent("rx", secret=SECRET)
    with _listener(rx) as s:
        ack = wc.authenticate(s, "client", 77, SECRET.encode())
        assert struct.unpack_from("<I", ack)[0] == 0
        s.sendall(wc.notify(5, b"hello"))
        got = rx.notifications(timeout_s=5)
    assert [(n.peer, n.tag) for n in got] == [("client", b"hello")]


def test_without_a_secret_only_loopback_is_served(make_agent, caplog):
    caplog.set_level(logging.WARNING, logger="kvlink")
    with pytest.raises(kvlink.InvalidArgumentError, match="allow_unauthenticated"):
        kvlink.Agent("open", kvlink.Config(nics=["0.0.0.0"]))  # every interface
    # an address this host lacks is reported as that, not as a missing secret
    with pytest.raises(kvlink.KvlinkError, match=r"cannot listen on 198\.18\.255\.254"):
        kvlink.Agent("absent", kvlink.Config(nics=["198.18.255.254"]))
    a = make_agent("trusted", nics=["0.0.0.0"], allow_unauthenticated=True)
    a.close()
    assert any("without authentication" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("secret", ["short", b"x" * 257, 12345])
def test_secret_size_and_type_are_checked(secret):
    with pytest.raises(kvlink.ConfigError, match="secret"):
        kvlink.Config(secret=secret)


def test_secret_from_the_environment(make_agent, monkeypatch, tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    monkeypatch.setenv("KVLINK_SECRET_FILE", str(path))
    rx = make_agent("rx")
    monkeypatch.delenv("KVLINK_SECRET_FILE")
    monkeypatch.setenv("KVLINK_SECRET", SECRET)
    tx = make_agent("tx")
    tx.add_peer(rx.metadata())  # both hold the secret: the handshake passes
    monkeypatch.delenv("KVLINK_SECRET")
    plain = make_agent("plain")
    with pytest.raises(kvlink.AuthenticationError):
        plain.add_peer(rx.metadata())
    assert "secret" not in repr(kvlink.Config(secret=SECRET)).replace("secret=", "")
    assert SECRET not in repr(kvlink.Config(secret=SECRET))


def test_a_listener_must_answer_as_the_instance_it_proved(make_agent):
    """The HELLO_ACK is not itself proven: a listener (or something between) that proves one
    instance in CHALLENGE and answers as another is refused."""
    import json
    import threading

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def listener() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(10)
            _, body = wc.recv_frame(conn)  # HELLO
            inst, kind, path, nlen = struct.unpack_from("<QBHH", body)
            name = body[13 : 13 + nlen].decode()
            nonce_c = body[14 + nlen : 30 + nlen]
            nonce_s = bytes(range(16))
            mac = wc.auth_mac(SECRET.encode(), True, "fake", 111, name, inst, kind, path,
                              nonce_c, nonce_s)  # fmt: skip
            conn.sendall(wc.frame(wc.CHALLENGE, struct.pack("<Q", 111) + wc.sstr("fake")
                                  + nonce_s + mac))  # fmt: skip
            wc.recv_frame(conn)  # AUTH
            ack = struct.pack("<IQ", 0, 222) + wc.sstr("fake") + wc.sstr("") + struct.pack("<I", 0)
            conn.sendall(wc.frame(wc.HELLO_ACK, ack))
            with contextlib.suppress(OSError):
                conn.recv(1)

    t = threading.Thread(target=listener, daemon=True)
    t.start()
    tx = make_agent("tx", secret=SECRET)
    md = json.dumps({"kvlink": 1, "name": "fake", "instance": "0" * 16,
                     "addrs": [["127.0.0.1", port]]})  # fmt: skip
    with pytest.raises(kvlink.HandshakeError, match="proved instance"):
        tx.add_peer(md)
    srv.close()
    t.join(timeout=10)
