"""A raw kvlink wire client for tests: builds frames byte by byte
(docs/wire-protocol.md) so tests can send what a real agent would not."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import socket
import struct
import threading

from kvlink._native import crc32c

MAGIC = 0x4B4C564B
VERSION = 5
HELLO, HELLO_ACK, DATA, ACK, READ_REQ, READ_RESP, NOTIFY = 1, 2, 3, 4, 5, 6, 7
REGIONS_REQ, REGIONS, PING, PONG, END, NOTIFY_ACK, ANNOUNCE = 8, 9, 10, 11, 12, 13, 14
CHALLENGE, AUTH = 15, 16
HELLO_AUTH = 1  # HELLO flag: the initiator holds a secret
MOVER_SHM, MOVER_UCX = 1, 2  # HELLO movers: the mover wanted on this data connection
HF_OOB = 1  # header flag: a mover places the payload; a cover stands in the stream
CONTROL, DATA_CONN = 0, 1
SUPERSEDED = 100  # wire-only ACK status: a newer copy owns the chunk


def crc(b: bytes) -> int:
    return crc32c(b)


def frame(ftype: int, body: bytes, payload_len: int = 0, flags: int = 0) -> bytes:
    hdr = struct.pack("<IBBHIIQ", MAGIC, VERSION, ftype, flags, len(body), crc(body), payload_len)
    return hdr + body


def session_token(name: str, instance: int) -> bytes:
    """The session token this client presents for (name, instance): the same on every
    connection it makes, so several of them join one session as a real agent's do."""
    return hashlib.sha256(f"{name}/{instance}".encode()).digest()[:16]


def hello(
    name: str,
    instance: int,
    kind: int = CONTROL,
    path: int = 0,
    nonce: bytes | None = None,
    token: bytes | None = None,
    flags: int = 0,
    movers: int = 0,
) -> bytes:
    """HELLO; with ``nonce`` (16 bytes) it asks for the challenge-response; ``flags``
    are added; ``movers``: the mover wanted (MOVER_SHM)."""
    raw = name.encode()
    flags |= HELLO_AUTH if nonce is not None else 0
    body = struct.pack("<QBHH", instance, kind, path, len(raw)) + raw
    tok = token if token is not None else session_token(name, instance)
    return frame(
        HELLO, body + bytes([flags]) + (nonce or bytes(16)) + tok + struct.pack("<I", movers)
    )


def _u8str(s: str) -> bytes:
    return bytes([len(s)]) + s.encode()


def auth_mac(
    secret: bytes,
    server: bool,
    server_name: str,
    server_instance: int,
    client_name: str,
    client_instance: int,
    kind: int,
    path: int,
    nonce_c: bytes,
    nonce_s: bytes,
) -> bytes:
    """A proof of the handshake (csrc/auth.c, docs/wire-protocol.md)."""
    label = b"kvlink/3 server\0" if server else b"kvlink/3 client\0"
    msg = (
        label
        + _u8str(server_name)
        + struct.pack("<Q", server_instance)
        + _u8str(client_name)
        + struct.pack("<Q", client_instance)
        + struct.pack("<BH", kind, path)
        + nonce_c
        + nonce_s
    )
    return hmac.new(secret, msg, hashlib.sha256).digest()


def authenticate(
    s: socket.socket,
    name: str,
    instance: int,
    secret: bytes,
    kind: int = CONTROL,
    path: int = 0,
    flags: int = 0,
    movers: int = 0,
) -> bytes:
    """The initiator's side of an authenticated handshake (HELLO ``flags`` and
    ``movers`` added); returns HELLO_ACK's body."""
    nonce_c = os.urandom(16)
    s.sendall(hello(name, instance, kind, path, nonce=nonce_c, flags=flags, movers=movers))
    t, body = recv_frame(s)
    if t != CHALLENGE:
        return body
    server_instance, nlen = struct.unpack_from("<QH", body)
    server_name = body[10 : 10 + nlen].decode()
    nonce_s = body[10 + nlen : 26 + nlen]
    mac = auth_mac(
        secret, False, server_name, server_instance, name, instance, kind, path, nonce_c, nonce_s
    )
    s.sendall(frame(AUTH, struct.pack("<I", 0) + mac))
    return recv_until(s, HELLO_ACK)


def notify(xfer: int, tag: bytes, op: int = 1) -> bytes:
    return frame(NOTIFY, struct.pack("<QII", xfer, op, len(tag)) + tag)


def announce(xfer: int, nbytes: int, n_chunks: int, tag: bytes = b"", timeout_ms: int = 0) -> bytes:
    """ANNOUNCE of a one-layer push; it must precede its DATA on each connection."""
    body = struct.pack("<QQIIII", xfer, nbytes, n_chunks, 1, timeout_ms, len(tag)) + tag
    return frame(ANNOUNCE, body + struct.pack("<II", 0, 0) * n_chunks)


def end(xfer: int, status: int = 0, msg: bytes = b"") -> bytes:
    """END: the push is over (status 0: done)."""
    return frame(END, struct.pack("<QIIIH", xfer, 0, 0, status, len(msg)) + msg)


def data(xfer: int, chunk: int, attempt: int, region: int, n: int, key: bytes) -> bytes:
    """A DATA header for one piece [0, n) of region, with the region's access key; the
    payload and trailer follow."""
    body = struct.pack("<QIII", xfer, chunk, attempt, 1) + struct.pack("<QQQ", region, 0, n)
    return frame(DATA, body + struct.pack("<IQ", 1, region) + key, n)


def cma_data(
    xfer: int, chunk: int, attempt: int, region: int, n: int, key: bytes, pid: int,
    ranges: list[tuple[int, int]],
) -> bytes:
    """A same-host DATA frame (header flag OOB) for piece [0, n) of region: the header,
    then the cover (u32 length + the descriptor: pid, source ranges (address, length) in
    process pid); the crc32c trailer follows."""
    body = struct.pack("<QIII", xfer, chunk, attempt, 1) + struct.pack("<QQQ", region, 0, n)
    desc = struct.pack("<II", pid, len(ranges)) + b"".join(
        struct.pack("<QQ", a, ln) for a, ln in ranges
    )
    cover = struct.pack("<I", len(desc)) + desc
    return frame(DATA, body + struct.pack("<IQ", 1, region) + key, n, HF_OOB) + cover


def key_of(metadata: bytes, region: int) -> bytes:
    """The access key of ``region`` from its owner's metadata."""
    return bytes.fromhex(json.loads(metadata)["keys"][str(region)])


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise ConnectionError("connection closed by the agent")
        out += got
    return out


def sstr(text: str) -> bytes:
    """A wire short string: u16 length, then the bytes."""
    raw = text.encode()
    return struct.pack("<H", len(raw)) + raw


def ack(xfer: int, chunk: int, attempt: int, status: int = 0) -> bytes:
    return frame(ACK, struct.pack("<QIII", xfer, chunk, attempt, status) + sstr(""))


def recv_frame(s: socket.socket) -> tuple[int, bytes]:
    """The next frame as (type, body); a payload, if any, is read and dropped."""
    _, _, t, _, blen, _, plen = struct.unpack("<IBBHIIQ", recv_exact(s, 24))
    body = recv_exact(s, blen)
    if plen:
        recv_exact(s, plen + 4)
    return t, body


def recv_until(s: socket.socket, ftype: int) -> bytes:
    """Body of the next frame of type ftype, skipping others (socket timeout applies)."""
    while True:
        t, body = recv_frame(s)
        if t == ftype:
            return body


def connect(
    addr: tuple[str, int],
    kind: int,
    path: int,
    name: str = "scripted-tx",
    instance: int = 77,
    flags: int = 0,
    movers: int = 0,
) -> socket.socket:
    """A connection that completed the handshake as agent `name` (HELLO ``flags``,
    ``movers``)."""
    s = socket.create_connection(addr, timeout=10)
    s.sendall(hello(name, instance, kind, path, flags=flags, movers=movers))
    t, body = recv_frame(s)
    assert t == HELLO_ACK and struct.unpack_from("<I", body)[0] == 0, body
    return s


def closed_by_peer(s: socket.socket, within_s: float) -> bool:
    """True once the agent has closed s (EOF or reset) within ``within_s``; frames it sent
    before are read and dropped."""
    s.settimeout(within_s)
    try:
        while s.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


def skip_exact(s: socket.socket, n: int) -> None:
    """Reads and drops n bytes (a payload) without holding them."""
    while n:
        got = s.recv(min(n, 1 << 20))
        if not got:
            raise ConnectionError("connection closed by the agent")
        n -= len(got)


class ScriptedReceiver:
    """A receiving agent played by the test, for pushes whose outcome must not depend on timing.

    It listens on 127.0.0.1..N (as ``nics="loopback:N"``), completes every handshake as agent
    ``name`` exposing one writable region ``region`` of ``nbytes``, reads every frame (payloads
    dropped), answers PING and NOTIFY, but withholds the ACK of every DATA until
    :meth:`release`: a push to it cannot finish before the test says so. :meth:`kill` drops
    every socket at once, as the death of a receiving process does.  With ``answer_regions``
    False it never answers REGIONS_REQ (``regions_asked`` is set by the first one).
    """

    def __init__(
        self, name: str, paths: int, region: str, nbytes: int, answer_regions: bool = True
    ) -> None:
        self.name = name
        self.answer_regions = answer_regions
        self.regions_asked = threading.Event()
        self.instance = 0x5C817ED0000001
        self.region = (1, nbytes, 2, region)  # id, size, rights (bit 1: remote_write), name
        self.key = os.urandom(16)  # its access key, handed out in the metadata
        self.data_seen = threading.Event()  # set by the first DATA frame
        self._lock = threading.Lock()  # guards everything below and every send
        self._released = False
        self._held: list[tuple[socket.socket, int, int, int]] = []  # (conn, xfer, chunk, attempt)
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.addresses: list[tuple[str, int]] = []
        for i in range(paths):
            srv = socket.create_server((f"127.0.0.{i + 1}", 0))
            self._socks.append(srv)
            self.addresses.append(srv.getsockname()[:2])
            self._start(self._accept, srv)

    @property
    def metadata(self) -> bytes:
        """What ``add_peer`` takes (docs/api.md)."""
        return json.dumps(
            {
                "kvlink": 1,
                "name": self.name,
                "instance": f"{self.instance:016x}",
                "addrs": [list(a) for a in self.addresses],
                "keys": {str(self.region[0]): self.key.hex()},
            }
        ).encode()

    def _start(self, target: object, sock: socket.socket) -> None:
        t = threading.Thread(target=target, args=(sock,), daemon=True)  # type: ignore[arg-type]
        self._threads.append(t)
        t.start()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:  # kill() or close()
                return
            with self._lock:
                self._socks.append(conn)
            self._start(self._serve, conn)

    def _send(self, conn: socket.socket, data: bytes) -> None:
        with self._lock:
            conn.sendall(data)

    def _table(self, control: bool) -> bytes:
        body = struct.pack("<IQ", 0, self.instance) + sstr(self.name) + sstr("")
        if not control:
            return body + struct.pack("<I", 0)
        rid, size, rights, name = self.region
        entry = struct.pack("<QQII", rid, size, rights, 0) + name.encode().ljust(64, b"\0")
        return body + struct.pack("<I", 1) + entry + struct.pack("<H", 0)

    def _serve(self, conn: socket.socket) -> None:
        try:
            t, body = recv_frame(conn)
            assert t == HELLO, t
            self._send(conn, frame(HELLO_ACK, self._table(control=body[8] == CONTROL)))
            while True:
                _, _, t, _, blen, _, plen = struct.unpack("<IBBHIIQ", recv_exact(conn, 24))
                body = recv_exact(conn, blen)
                if plen:
                    skip_exact(conn, plen + 4)
                if t == DATA:
                    xfer, chunk, attempt = struct.unpack_from("<QII", body)
                    self.data_seen.set()
                    with self._lock:
                        if not self._released:
                            self._held.append((conn, xfer, chunk, attempt))
                            continue
                    self._send(conn, ack(xfer, chunk, attempt))
                elif t == PING:
                    self._send(conn, frame(PONG, body))
                elif t == NOTIFY and struct.unpack_from("<Q", body)[0]:
                    self._send(conn, frame(NOTIFY_ACK, body[:8]))
                elif t == REGIONS_REQ:
                    self.regions_asked.set()
                    if self.answer_regions:
                        self._send(conn, frame(REGIONS, self._table(control=True)))
        except (OSError, ConnectionError):
            return  # kill(), close(), or the agent hung up

    def release(self) -> None:
        """ACK every DATA held so far (the newest copy of a chunk as placed, older ones as
        SUPERSEDED, as a real receiver does) and every DATA from now on."""
        with self._lock:
            self._released = True
            held, self._held = self._held, []
            newest: dict[tuple[int, int], int] = {}
            for _, xfer, chunk, attempt in held:
                newest[xfer, chunk] = max(attempt, newest.get((xfer, chunk), 0))
            for conn, xfer, chunk, attempt in held:
                status = 0 if attempt == newest[xfer, chunk] else SUPERSEDED
                with contextlib.suppress(OSError):
                    conn.sendall(ack(xfer, chunk, attempt, status))

    def kill(self) -> None:
        """Drop every listener and connection at once (RST, as a killed process's are)."""
        with self._lock:
            socks, self._socks = self._socks, []
            for s in socks:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
        for t in self._threads:
            t.join(5)

    close = kill


class _FrontProxy:
    """Listens in front of every address of an agent's metadata and pipes each connection
    to the agent; what the agent sends back goes through the subclass's ``_answers(up,
    down)``.  ``metadata()`` is the agent's, pointing at the proxy.  Subclasses set their
    own state before calling ``__init__`` (it starts accepting)."""

    def __init__(self, metadata: bytes) -> None:
        self.meta = json.loads(metadata)
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []  # the listening sockets
        self._conns: list[socket.socket] = []  # the proxied connections (both ends)
        addrs = []
        for host, port in self.meta["addrs"]:
            srv = socket.create_server((host, 0))
            self._socks.append(srv)
            addrs.append([host, srv.getsockname()[1]])
            threading.Thread(target=self._accept, args=(srv, (host, port)), daemon=True).start()
        self.meta["addrs"] = addrs

    def metadata(self) -> bytes:
        return json.dumps(self.meta).encode()

    def _accept(self, srv: socket.socket, target: tuple[str, int]) -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            to = self._upstream(target)
            try:
                if to is None:
                    raise OSError("the link is down")
                u = socket.create_connection(to)
            except OSError:  # the agent is gone (or the link is down): so is this connection
                with contextlib.suppress(OSError):
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()
                continue
            with self._lock:
                self._conns += [c, u]
            threading.Thread(target=self._pipe, args=(c, u), daemon=True).start()
            threading.Thread(target=self._answers, args=(u, c), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def _upstream(self, target: tuple[str, int]) -> tuple[str, int] | None:
        """Where a connection accepted for ``target`` goes (None: reset it)."""
        return target

    def _answers(self, up: socket.socket, down: socket.socket) -> None:
        raise NotImplementedError


class AckHoldingProxy(_FrontProxy):
    """A man in the middle for every address of an agent's metadata that withholds the
    agent's ACK frames until :meth:`release` (everything else goes through unchanged, in
    order): a push through it is announced and sent but cannot finish before the test says
    so.  ``metadata()`` is the agent's, pointing at the proxy."""

    def __init__(self, metadata: bytes) -> None:
        self._released = False  # under _lock, as _held
        self._held: list[tuple[socket.socket, bytes]] = []  # (towards the initiator, frame)
        super().__init__(metadata)

    def _answers(self, up: socket.socket, down: socket.socket) -> None:
        """Listener -> initiator, frame by frame, ACKs held back."""
        try:
            while True:
                hdr = recv_exact(up, 24)
                _, _, t, _, blen, _, plen = struct.unpack("<IBBHIIQ", hdr)
                raw = hdr + recv_exact(up, blen) + (recv_exact(up, plen + 4) if plen else b"")
                with self._lock:
                    if t == ACK and not self._released:
                        self._held.append((down, raw))
                        continue
                    down.sendall(raw)
        except (OSError, ConnectionError):
            with contextlib.suppress(OSError):
                down.shutdown(socket.SHUT_WR)

    def release(self) -> None:
        """Sends every ACK held so far, and every one from now on."""
        with self._lock:
            self._released = True
            held, self._held = self._held, []
            for down, raw in held:
                with contextlib.suppress(OSError):
                    down.sendall(raw)

    def close(self) -> None:
        with self._lock:
            socks, self._socks, self._conns = self._socks + self._conns, [], []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


MOVER_OFFER, MOVER_ACCEPT, MOVER_KEYS, MOVER_REFUSE = 17, 18, 19, 20


def ucx_setup_decode(body: bytes) -> tuple[bytes, list[list]]:
    """The UCX mover's part of a MOVER_OFFER / MOVER_ACCEPT body, after its kind byte
    (docs/wire-protocol.md): the worker address and the keys as [region, base, size, key
    bytes]."""
    (alen,) = struct.unpack_from("<H", body)
    addr = body[2 : 2 + alen]
    off = 2 + alen
    (n,) = struct.unpack_from("<I", body, off)
    off += 4
    keys = []
    for _ in range(n):
        region, base, size, klen = struct.unpack_from("<QQQH", body, off)
        off += 26
        keys.append([region, base, size, body[off : off + klen]])
        off += klen
    return addr, keys


def ucx_setup_encode(addr: bytes, keys: list[list]) -> bytes:
    out = struct.pack("<H", len(addr)) + addr + struct.pack("<I", len(keys))
    for region, base, size, key in keys:
        out += struct.pack("<QQQH", region, base, size, len(key)) + key
    return out


class RewritingProxy(_FrontProxy):
    """A man in the middle for every address of an agent's metadata: bytes go through
    unchanged, except that the UCX part of the first MOVER_ACCEPT on each connection (its
    body after the kind byte) is handed
    to ``rewrite(body) -> body`` (its crc32c recomputed), as a peer that answers with bad
    keys would.  Frames after the handshake carry no MAC, so this is what a broken or
    hostile listener can send.  ``metadata()`` is the agent's, pointing at the proxy."""

    def __init__(self, metadata: bytes, rewrite) -> None:  # type: ignore[no-untyped-def]
        self.rewrite = rewrite
        self.accepts_rewritten = 0
        super().__init__(metadata)

    def _answers(self, up: socket.socket, down: socket.socket) -> None:
        """Listener -> initiator: frame by frame until the UCX answer, then raw."""
        try:
            while True:
                hdr = recv_exact(up, 24)
                magic, ver, t, flags, blen, _, plen = struct.unpack("<IBBHIIQ", hdr)
                body = recv_exact(up, blen)
                if t == MOVER_ACCEPT:
                    body = body[:1] + self.rewrite(body[1:])
                    hdr = struct.pack("<IBBHIIQ", magic, ver, t, flags, len(body), crc(body), plen)
                    with self._lock:
                        self.accepts_rewritten += 1
                down.sendall(hdr + body)
                if t in (MOVER_ACCEPT, MOVER_REFUSE) or plen:
                    break
        except (OSError, ConnectionError):
            return
        self._pipe(up, down)

    def cut(self) -> None:
        """Reset every proxied connection at once (a path dying); new ones are still
        accepted, so the agent's paths reconnect through the proxy."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()

    def close(self) -> None:
        self.cut()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()


class LinkProxy(RewritingProxy):
    """Every link to an agent, through a proxy that can take them all down at once:
    :meth:`down` resets every proxied connection and every new one until :meth:`up`
    (a reconnect fails, as over a cut link), :meth:`retarget` sends new connections to
    another agent's addresses (the same name restarted behind the old addresses)."""

    def __init__(self, metadata: bytes) -> None:
        self._down = False  # under _lock, as _to
        self._to: dict[tuple[str, int], tuple[str, int]] = {}
        self._agent_addrs = [(h, p) for h, p in json.loads(metadata)["addrs"]]
        super().__init__(metadata, lambda body: body)

    def _upstream(self, target: tuple[str, int]) -> tuple[str, int] | None:
        with self._lock:
            return None if self._down else self._to.get(target, target)

    def down(self) -> None:
        with self._lock:
            self._down = True
        self.cut()

    def up(self) -> None:
        with self._lock:
            self._down = False

    def retarget(self, metadata: bytes) -> None:
        """New connections go to the agent of ``metadata``, address by address."""
        new = json.loads(metadata)["addrs"]
        with self._lock:
            self._to = {
                old: (h, p) for old, (h, p) in zip(self._agent_addrs, new, strict=True)
            }
