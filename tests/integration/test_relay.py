"""Relayed paths (docs/relays.md): a third agent forwards a path's bytes, sealed end to end.

All on loopback: a on 127.0.0.1, b on 127.0.0.2, the relay on 127.0.0.3 (one /24, so the relay
reaches b).  A hand-written relay (HostileRelay) speaks the relay hop's protocol but does what a
relay should not: records or flips the bytes it forwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvlink
from kvlink import _relays
from tests.waits import wait_for, wait_paths

pytestmark = pytest.mark.tools("libcrypto")

MiB = 1 << 20
SECRET = "kvlink-relay-test-secret-0123456789"
OTHER = "another-secret-abcdefghijklmnopqrs"


def trio(make_agent: Any, relay_secret: str = SECRET, **cfg: Any) -> tuple[Any, Any, Any]:
    """Sender a, receiver b, relay r; a routes through r."""
    r = make_agent("r", nics="127.0.0.3", secret=relay_secret, relay=True, accept_relayed=False)
    b = make_agent("b", nics="127.0.0.2", secret=SECRET)
    a = make_agent("a", nics="127.0.0.1", secret=SECRET, **cfg)
    a.add_relay(r.metadata())
    return a, b, r


def relayed(agent: Any, peer: str) -> list[Any]:
    return [p for p in agent.paths() if p.peer == peer and p.relay]


def test_metadata_offers_sealed_ports_and_the_relay(make_agent):
    a, b, r = trio(make_agent)
    md = json.loads(r.metadata())
    assert md["relay"] and all(h == "127.0.0.3" for h, _ in md["relay"])
    mb = json.loads(b.metadata())
    assert len(bytes.fromhex(mb["e2e"])) == 32
    assert [h for h, _ in mb["sealed"]] == ["127.0.0.2"]
    assert "relay" not in mb  # b does not relay
    assert a.relays() == ["r"]


def test_push_and_pull_over_a_relay_are_byte_exact(make_agent):
    a, b, r = trio(make_agent, chunk_bytes=MiB, min_chunk_bytes=MiB)
    dst = np.zeros(64 * MiB, np.uint8)
    b.register(dst, name="kv", remote_write=True, remote_read=True)
    src = np.random.default_rng(7).integers(0, 256, 64 * MiB, dtype=np.uint8)
    a.register(src)
    a.add_peer(b.metadata())
    paths = wait_paths(a, "b", lambda ps: len(ps) == 2 and all(p.state.name == "UP" for p in ps))
    via = [p for p in paths if p.relay]
    assert len(via) == 1 and via[0].relay == "r" and via[0].relay_addr.startswith("127.0.0.3:")
    assert "sealed" in via[0].transport_note
    for _ in range(3):
        a.push("b", src=src, dst="kv").wait(timeout_s=60)
        assert np.array_equal(dst, src)
    back = np.zeros_like(src)
    a.register(back)
    a.pull("b", src="kv", dst=back).wait(timeout_s=60)
    assert np.array_equal(back, src)
    assert relayed(a, "b")[0].bytes_sent > 0, "no chunk went over the relayed path"
    assert relayed(a, "b")[0].bytes_recv > 0, "no pulled chunk came over the relayed path"
    stats = r.relay_stats()
    assert stats["relayed_total"] >= 1 and stats["relayed_bytes"] > 0


def test_a_relay_without_the_cluster_secret_forwards_nothing(make_agent, caplog):
    caplog.set_level(logging.WARNING, logger="kvlink")
    a, b, r = trio(make_agent, relay_secret=OTHER)
    a.add_peer(b.metadata())  # the direct path works
    via = wait_paths(a, "b", lambda ps: any(p.relay and p.last_error for p in ps))
    err = next(p for p in via if p.relay).last_error
    assert "relays only for holders of its cluster secret" in err, err
    assert r.relay_stats()["relayed_total"] == 0
    wait_for(lambda: "does not hold this cluster's secret" in caplog.text, 10, "relay's log")


def test_stale_end_to_end_key_is_refused_on_both_ends(make_agent, caplog):
    caplog.set_level(logging.WARNING, logger="kvlink")
    a, b, _ = trio(make_agent)
    md = json.loads(b.metadata())
    md["e2e"] = os.urandom(32).hex()  # e.g. metadata of b's previous life
    a.add_peer(md)
    via = wait_paths(a, "b", lambda ps: any(p.relay and p.last_error for p in ps))
    err = next(p for p in via if p.relay).last_error
    assert "did not prove it holds the end-to-end key" in err, err
    wait_for(lambda: "end-to-end key" in caplog.text, 10, "b's refusal in the log")


# ---- a relay that misbehaves ---------------------------------------------------------------


class HostileRelay:
    """Speaks the relay hop (relay.h) without checking anything, then forwards the bytes,
    recording them, and flips one byte of the a->b stream after ``flip_after`` bytes."""

    def __init__(self, flip_after: int | None = None) -> None:
        self.flip_after = flip_after
        self.seen = bytearray()
        self.flipped = 0
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.3", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = False
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def metadata(self) -> dict[str, Any]:
        return {"name": "evil", "relay": [["127.0.0.3", self.port]]}

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            t = threading.Thread(target=self._serve, args=(c,), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, c: socket.socket) -> None:
        self.socks.append(c)
        with contextlib.suppress(OSError):
            c.settimeout(10)
            c.sendall(b"KVR1" + os.urandom(16))
            head = _recv(c, 11)
            rest = _recv(c, head[10] + 32)
            ip = socket.inet_ntoa(head[4:8])
            port = struct.unpack(">H", head[8:10])[0]
            t = socket.create_connection((ip, port), timeout=5)
            self.socks.append(t)
            c.sendall(b"\0\0")
            del rest
            c.settimeout(None)
            t.settimeout(None)
            threading.Thread(target=self._pipe, args=(t, c, False), daemon=True).start()
            self._pipe(c, t, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, forward: bool) -> None:
        moved = 0
        with contextlib.suppress(OSError):
            while not self.stop:
                data = bytearray(src.recv(1 << 16))
                if not data:
                    break
                with self.lock:
                    if len(self.seen) < 256 * MiB:
                        self.seen += data
                    if forward and self.flip_after is not None and self.flipped == 0:
                        at = self.flip_after - moved
                        if 0 <= at < len(data):
                            data[at] ^= 0x40
                            self.flipped = 1
                moved += len(data)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.stop = True
        self.sock.close()
        for s in self.socks:
            s.close()


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            raise OSError("closed")
        buf += got
    return buf


@pytest.fixture
def hostile() -> Iterator[Any]:
    made: list[HostileRelay] = []

    def make(**kw: Any) -> HostileRelay:
        made.append(HostileRelay(**kw))
        return made[-1]

    yield make
    for h in made:
        h.close()


def test_the_relay_sees_no_payload_and_no_region_key(make_agent, hostile):
    evil = hostile()
    b = make_agent("receiver-bravo", nics="127.0.0.2", secret=SECRET)
    a = make_agent("a", nics="127.0.0.1", secret=SECRET, chunk_bytes=MiB, min_chunk_bytes=MiB)
    a.add_relay(evil.metadata())
    dst = np.zeros(16 * MiB, np.uint8)
    b.register(dst, name="kv", remote_write=True)
    marker = np.frombuffer(b"KVLINK-PLAINTEXT-MARKER-" * 3, np.uint8)
    src = np.resize(marker, 16 * MiB)
    a.register(src)
    md = json.loads(b.metadata())
    a.add_peer(md)
    wait_paths(a, b.name, lambda ps: any(p.relay and p.state.name == "UP" for p in ps))
    for _ in range(3):
        a.push(b.name, src=src, dst="kv").wait(timeout_s=60)
    assert np.array_equal(dst, src)
    assert relayed(a, b.name)[0].bytes_sent > 0, "no chunk went through the relay"
    seen = bytes(evil.seen)
    assert len(seen) > MiB
    assert b"KVLINK-PLAINTEXT-MARKER-" not in seen
    for key in md["keys"].values():
        assert bytes.fromhex(key) not in seen, "a region key crossed the relay in clear"
    assert b.name.encode() not in seen  # not even the handshake's names


def test_a_byte_the_relay_changes_ends_the_connection_never_the_data(make_agent, hostile, caplog):
    caplog.set_level(logging.WARNING, logger="kvlink")
    evil = hostile(flip_after=3 * MiB)
    b = make_agent("b", nics="127.0.0.2", secret=SECRET)
    a = make_agent("a", nics="127.0.0.1", secret=SECRET, chunk_bytes=MiB, min_chunk_bytes=MiB)
    a.add_relay(evil.metadata())
    dst = np.zeros(32 * MiB, np.uint8)
    b.register(dst, name="kv", remote_write=True)
    src = np.random.default_rng(3).integers(0, 256, 32 * MiB, dtype=np.uint8)
    a.register(src)
    a.add_peer(b.metadata())
    wait_paths(a, "b", lambda ps: any(p.relay and p.state.name == "UP" for p in ps))
    for _ in range(4):
        a.push("b", src=src, dst="kv").wait(timeout_s=60)
        assert np.array_equal(dst, src)
        if evil.flipped:
            break
    assert evil.flipped, "the relay never got to flip a byte"
    wait_for(lambda: "failed its end-to-end check" in caplog.text, 10, "b's log of the bad record")


def test_a_relay_killed_mid_transfer_costs_only_its_chunks(make_agent):
    a, b, r = trio(make_agent, chunk_bytes=2 * MiB, min_chunk_bytes=2 * MiB)
    dst = np.zeros(256 * MiB, np.uint8)
    b.register(dst, name="kv", remote_write=True)
    src = np.random.default_rng(5).integers(0, 256, 256 * MiB, dtype=np.uint8)
    a.register(src)
    a.add_peer(b.metadata())
    wait_paths(a, "b", lambda ps: any(p.relay and p.state.name == "UP" for p in ps))
    x = a.push("b", src=src, dst="kv", notify=b"relay-killed")
    wait_for(lambda: r.relay_stats()["relayed_bytes"] > 4 * MiB or x.done, 30, "relayed bytes")
    r.close()
    x.wait(timeout_s=60)
    assert np.array_equal(dst, src)
    got = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not got:
        got += [n for n in b.notifications(timeout_s=0.5) if n.tag == b"relay-killed"]
    time.sleep(1.5)  # a duplicate would come within the re-send interval (1 s)
    got += [n for n in b.notifications() if n.tag == b"relay-killed"]
    assert len(got) == 1


# ---- the relay hop's own checks ----------------------------------------------------------


def _ask(port: int, target: tuple[str, int], secret: str | None) -> tuple[int, str]:
    with socket.create_connection(("127.0.0.3", port), timeout=5) as s:
        hello = _recv(s, 20)
        assert hello[:4] == b"KVR1"
        body = b"KVRQ" + socket.inet_aton(target[0]) + struct.pack(">H", target[1])
        body += bytes([4]) + b"test"
        mac = (
            hmac.new(secret.encode(), b"kvlink relay request" + hello[4:] + body, hashlib.sha256)
            .digest()
            if secret
            else bytes(32)
        )
        s.sendall(body + mac)
        status, n = _recv(s, 2)
        return status, _recv(s, n).decode() if n else ""


def test_the_relay_forwards_only_for_members_and_only_to_its_networks(make_agent):
    r = make_agent("r", nics="127.0.0.3", secret=SECRET, relay=True, accept_relayed=False)
    port = json.loads(r.metadata())["relay"][0][1]
    listener = socket.create_server(("127.0.0.2", 0))
    with listener:
        ok = ("127.0.0.2", listener.getsockname()[1])
        status, msg = _ask(port, ok, OTHER)
        assert status == 1 and "cluster secret" in msg
        status, msg = _ask(port, ("127.0.1.9", 80), SECRET)
        assert status == 4 and "lends no NIC on the network of 127.0.1.9" in msg
        status, msg = _ask(port, ("127.0.0.3", port), SECRET)  # itself
        assert status == 4
        status, _ = _ask(port, ok, SECRET)
        assert status == 0
        # a member speaking anything but the sealed protocol gets nothing through: the
        # relay connected, but moves no byte that does not start with the hello's magic
        with socket.create_connection(("127.0.0.3", port), timeout=5) as s:
            hello = _recv(s, 20)
            body = b"KVRQ" + socket.inet_aton(ok[0]) + struct.pack(">H", ok[1]) + b"\x04test"
            mac = hmac.new(SECRET.encode(), b"kvlink relay request" + hello[4:] + body,
                           hashlib.sha256).digest()  # fmt: skip
            s.sendall(body + mac)
            assert _recv(s, 2) == b"\0\0"
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            listener.settimeout(5)
            conns = [listener.accept()[0] for _ in range(2)]  # the earlier OK's and this one
            for c in conns:
                with c:
                    c.settimeout(5)
                    with contextlib.suppress(ConnectionResetError):
                        assert c.recv(100) == b"", "the relay forwarded a non-kvlink stream"
    # garbage is closed unanswered; the relay goes on serving
    with socket.create_connection(("127.0.0.3", port), timeout=5) as s:
        _recv(s, 20)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        s.settimeout(5)
        with contextlib.suppress(ConnectionResetError):  # closed abortively: the same answer
            assert s.recv(10) == b""
    assert r.relay_stats()["refused"] >= 3


def test_silent_strangers_on_the_sealed_port_lock_no_relayed_path_out(make_agent):
    """40 silent connections from one address on the receiver's sealed port, held open (each
    key exchange may wait connect_timeout_s = 30 s for its first byte): the relayed path of a
    holder of the key still comes up, evicting the oldest silent exchange, long before any of
    them would time out (issue 38, item 1: before, 32 of them kept every relayed path out)."""
    r = make_agent("r", nics="127.0.0.3", secret=SECRET, relay=True, accept_relayed=False)
    b = make_agent("b", nics="127.0.0.2", secret=SECRET, connect_timeout_s=30.0)
    a = make_agent("a", nics="127.0.0.1", secret=SECRET, connect_timeout_s=30.0)
    a.add_relay(r.metadata())
    sealed = ("127.0.0.2", json.loads(b.metadata())["sealed"][0][1])
    silent = [socket.create_connection(sealed, timeout=5) for _ in range(40)]
    try:
        a.add_peer(b.metadata())
        wait_paths(a, "b", lambda ps: any(p.relay and p.state.name == "UP" for p in ps), 20)
        cut = 0
        for s in silent:  # the evicted ones were shut down, not left to their deadline
            s.settimeout(0.5)
            with contextlib.suppress(OSError):
                while s.recv(4096):
                    pass
                cut += 1
        assert cut >= 8, f"only {cut} of 40 silent exchanges were evicted"
    finally:
        for s in silent:
            s.close()


def test_the_relay_writes_nothing_to_a_service_that_does_not_greet_as_kvlink(make_agent):
    """A member opens a relayed connection to a line server (a Redis, memcached or SMTP
    neighbour) and sends the sealed magic followed by commands: the relay waits for the
    target's magic, which never comes, so the line server receives not one byte, and the
    relay cuts the pair after connect_timeout (issue 38, item 2: before, it forwarded
    everything after the client's magic)."""
    r = make_agent("r", nics="127.0.0.3", secret=SECRET, relay=True, accept_relayed=False,
                   connect_timeout_s=1.0)
    port = json.loads(r.metadata())["relay"][0][1]
    listener = socket.create_server(("127.0.0.2", 0))
    got: list[bytes] = []

    def line_server() -> None:
        with contextlib.suppress(OSError):
            c, _ = listener.accept()
            with c:
                c.settimeout(10)
                while data := c.recv(4096):
                    got.append(data)

    server = threading.Thread(target=line_server, daemon=True)
    server.start()
    with listener, socket.create_connection(("127.0.0.3", port), timeout=5) as s:
        hello = _recv(s, 20)
        target = ("127.0.0.2", listener.getsockname()[1])
        body = b"KVRQ" + socket.inet_aton(target[0]) + struct.pack(">H", target[1]) + b"\x04test"
        mac = hmac.new(SECRET.encode(), b"kvlink relay request" + hello[4:] + body,
                       hashlib.sha256).digest()  # fmt: skip
        s.sendall(body + mac)
        assert _recv(s, 2) == b"\0\0", "the relay did not connect to the line server"
        s.sendall(b"KVE1\r\nFLUSHALL\r\nSET owned 1\r\n")
        s.settimeout(10)
        with contextlib.suppress(ConnectionResetError):  # cut abortively: the same answer
            assert s.recv(100) == b"", "the relay answered for a target that never greeted"
        server.join(timeout=10)
    assert got == [], f"the relay wrote a member's bytes to a non-kvlink service: {got}"


# ---- planning routes (pure) --------------------------------------------------------------


def test_routes_on_the_three_host_testbed():
    a = ["198.18.0.1", "198.18.1.1", "198.18.2.1"]  # a-b, a-b, a-r
    lent = [("198.18.2.2", 9000), ("198.18.3.1", 9001), ("198.18.4.1", 9002)]
    relay = {"name": "r", "relay": lent}
    peer = {
        "name": "b",
        "addrs": [("198.18.0.2", 1), ("198.18.1.2", 1), ("198.18.3.2", 1), ("198.18.4.2", 1)],
        "sealed": [("198.18.0.2", 2), ("198.18.1.2", 2), ("198.18.3.2", 2), ("198.18.4.2", 2)],
        "e2e": b"k" * 32,
    }
    hosts, routes = _relays.plan_routes(a, peer, [relay], "a")
    assert hosts == peer["addrs"] + peer["sealed"]
    direct = [(r.local, hosts[r.remote][0]) for r in routes if not r.via]
    via = [(r.local, hosts[r.remote], r.via, r.via_port) for r in routes if r.via]
    # a's relay NIC has no direct path (its link leads to r only)
    assert direct == [(0, "198.18.0.2"), (1, "198.18.1.2")]
    assert via == [
        (2, ("198.18.3.2", 2), "198.18.2.2", 9000),
        (2, ("198.18.4.2", 2), "198.18.2.2", 9000),
    ]
    # the other way (decode's two r-b NICs lead to the relay, prefill's a-r address is the
    # only one the relay reaches): a relayed path per r-b NIC, and no dead direct path from them
    b = ["198.18.0.2", "198.18.1.2", "198.18.3.2", "198.18.4.2"]
    prefill = {"name": "a", "addrs": [(h, 1) for h in a], "sealed": [(h, 2) for h in a],
               "e2e": b"k" * 32}  # fmt: skip
    hosts, routes = _relays.plan_routes(b, prefill, [relay], "b")
    assert [(r.local, hosts[r.remote][0]) for r in routes if not r.via] == [
        (0, "198.18.0.1"), (1, "198.18.1.1")]  # fmt: skip
    assert [(r.local, hosts[r.remote], r.via) for r in routes if r.via] == [
        (2, ("198.18.2.1", 2), "198.18.3.1"), (3, ("198.18.2.1", 2), "198.18.4.1")]  # fmt: skip
    # without the peer's end-to-end key nothing is relayed
    _, plain = _relays.plan_routes(a, {**peer, "e2e": None}, [relay], "a")
    assert not any(r.via for r in plain)


def test_a_relay_without_a_secret_stays_on_loopback(make_agent):
    from kvlink import _nics

    real = [a for a in _nics.resolve("auto") if not a.startswith("127.")]
    if not real:
        pytest.skip("this host has no non-loopback IPv4 address to try")
    with pytest.raises(kvlink.KvlinkError, match=r"would relay on .* without a cluster secret"):
        make_agent("r-open", nics="127.0.0.3", relay=True, relay_nics=real[0])


def test_bad_relay_metadata_is_refused_saying_why(make_agent, tmp_path):
    a = make_agent("a", nics="127.0.0.1", secret=SECRET)
    with pytest.raises(kvlink.InvalidArgumentError, match="does not relay"):
        a.add_relay(a.metadata())
    with pytest.raises(kvlink.InvalidArgumentError, match="cannot read relay metadata file"):
        a.add_relay(str(tmp_path / "missing.json"))
    with pytest.raises(kvlink.InvalidArgumentError, match="'relay' must be a list"):
        a.add_relay({"name": "x", "relay": [["127.0.0.3", 0]]})
    with pytest.raises(kvlink.ConfigError, match="relay_yield_mbps"):
        kvlink.Config(relay_yield_mbps=-1)


def test_garbage_and_silence_on_the_relay_and_sealed_ports(make_agent):
    """A hostile client of the two new ports: random bytes, half requests, silent sockets,
    a flood past the pending bound.  Both ports shed them within their deadline and keep
    serving: a relayed push works during and after."""
    a, b, r = trio(make_agent, chunk_bytes=MiB, min_chunk_bytes=MiB, connect_timeout_s=1.0)
    relay_port = json.loads(r.metadata())["relay"][0][1]
    sealed_port = json.loads(b.metadata())["sealed"][0][1]
    rng = np.random.default_rng(11)
    held: list[socket.socket] = []
    for i in range(150):
        port = relay_port if i % 2 else sealed_port
        host = "127.0.0.3" if i % 2 else "127.0.0.2"
        try:
            s = socket.create_connection((host, port), timeout=2)
        except OSError:
            continue  # shed at accept: what a flood should get
        kind = i % 5
        with contextlib.suppress(OSError):
            if kind == 0:
                s.sendall(rng.integers(0, 256, int(rng.integers(1, 4096)), np.uint8).tobytes())
            elif kind == 1:
                s.sendall(b"KVRQ" + bytes(7))  # a request cut short
            elif kind == 2:
                s.sendall(b"KVE1" + rng.integers(0, 256, 60, np.uint8).tobytes())
            elif kind == 3:
                s.sendall(b"KVRQ" + bytes(6) + b"\xff" + bytes(40))  # name length 255
        held.append(s)  # kind 4: silent
    dst = np.zeros(16 * MiB, np.uint8)
    b.register(dst, name="kv", remote_write=True)
    src = np.random.default_rng(12).integers(0, 256, 16 * MiB, dtype=np.uint8)
    a.register(src)
    a.add_peer(b.metadata())
    wait_paths(a, "b", lambda ps: any(p.relay and p.state.name == "UP" for p in ps), 20)
    a.push("b", src=src, dst="kv").wait(timeout_s=60)
    assert np.array_equal(dst, src)
    # every held connection is closed by its port within the handshake deadline (1 s) + slack
    deadline = time.monotonic() + 10
    for s in held:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            while s.recv(4096):
                pass
        except (ConnectionResetError, OSError) as exc:
            assert not isinstance(exc, TimeoutError), "a port kept a hostile socket open"
        s.close()
    assert time.monotonic() < deadline
    assert r.relay_stats()["refused"] > 0
    # and both still serve
    dst[:] = 0
    a.push("b", src=src, dst="kv").wait(timeout_s=60)
    assert np.array_equal(dst, src)
