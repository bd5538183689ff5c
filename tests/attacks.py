"""Attacks by an admitted peer (issue 22): each floods one target agent at full speed until
stopped, as one peer (one name and session, with the cluster secret when the target has one),
so that a fairness fix can be measured (bench/fairness.py) and checked
(tests/integration/test_fairness.py).

    attack = make_attack("notify-flood", Target.from_metadata(md, secret))
    attack.start(); attack.ready.wait(10); ...; stats = attack.stop()

or in a process of its own (the attacker then competes for no GIL with the caller):

    with AttackProcess("notify-flood", md, secret) as attack:
        attack.wait_ready(10); ...; stats = attack.stop()

    python -m tests.attacks KIND --metadata-file F [--secret-hex H] [--params JSON]
        prints {"ready": ...} once the attack is at full pressure, then a stats line when
        stdin ends (or says "stop").

The attacks (ATTACKS; issue 22's list):

- ``announce-lockout``: 4 pushes of 65,536 chunks, kept alive by one 1-byte DATA each every
  0.3 s (into the last byte of a writable region; a push the target dropped is announced anew)
- ``announce-big``: 65,536-chunk ANNOUNCEs at 100 per second, no DATA, no key needed
- ``announce-flood``: 1-chunk ANNOUNCEs as fast as the target takes them
- ``notify-flood``: NOTIFYs with 4 KiB tags (every one a new transfer id), as fast as possible
- ``announce-tags``: rounds of 16,384 1-chunk ANNOUNCEs with 4 KiB tags, each round on a new
  connection that is closed at its end
- ``unread-answers``: READ_REQs of 8192 one-byte pieces of a readable region, on 4 data
  connections whose answers are never read
- ``trickle``: 100 data connections, each a DATA header announcing a 1 MiB body and all of it
  but 4 KiB, then one byte more every 4 s
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tests import wire_client as wc

KiB, MiB = 1 << 10, 1 << 20
MAX_TAG = 4096  # KVL_MAX_TAG
MAX_CHUNKS = 65536  # KVL_MAX_XFER_CHUNKS
MAX_PIECES = 8192  # KVL_MAX_PIECES
MAX_BODY = 1 << 20  # KVL_MAX_BODY: the largest body a header may announce after the handshake
RIGHT_READ, RIGHT_WRITE = 1, 2  # region table rights bits
HDR = struct.Struct("<IBBHIIQ")
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class RemoteRegion:
    """One entry of the target's region table, with its access key when the metadata has it."""

    id: int
    nbytes: int
    rights: int
    name: str
    key: bytes | None


@dataclass(frozen=True)
class Target:
    """The agent under attack, as its metadata describes it."""

    name: str
    addrs: tuple[tuple[str, int], ...]
    keys: dict[int, bytes]
    secret: bytes | None = None

    @classmethod
    def from_metadata(cls, metadata: bytes | str, secret: bytes | str | None = None) -> Target:
        md = json.loads(metadata)
        keys = {int(k): bytes.fromhex(v) for k, v in md.get("keys", {}).items()}
        raw = secret.encode() if isinstance(secret, str) else secret
        return cls(md["name"], tuple((h, int(p)) for h, p in md["addrs"]), keys, raw)


def region_table(hello_ack: bytes) -> list[tuple[int, int, int, str]]:
    """(id, size, rights, name) of each entry of a HELLO_ACK's region table
    (docs/wire-protocol.md, "HELLO_ACK (2) and REGIONS (9)")."""
    off = 12
    for _ in range(2):  # the listener's name, then the message
        (n,) = struct.unpack_from("<H", hello_ack, off)
        off += 2 + n
    (count,) = struct.unpack_from("<I", hello_ack, off)
    off += 4
    out = []
    for _ in range(count):
        rid, size, rights, _mem = struct.unpack_from("<QQII", hello_ack, off)
        name = hello_ack[off + 24 : off + 88].rstrip(b"\0").decode()
        (rkey,) = struct.unpack_from("<H", hello_ack, off + 88)
        off += 90 + rkey
        out.append((rid, size, rights, name))
    return out


class Peer:
    """One admitted peer: every connection it opens presents one name and session token, and
    proves the target's secret when the target has one."""

    def __init__(self, target: Target, name: str = "attacker", instance: int | None = None):
        self.target = target
        self.name = name
        self.instance = instance if instance is not None else int.from_bytes(os.urandom(7), "big")

    def open(self, kind: int = wc.DATA_CONN, path: int = 0, timeout_s: float = 10.0,
             ) -> tuple[socket.socket, bytes]:  # fmt: skip
        """A connection past the handshake, and its HELLO_ACK body.

        Raises:
            ConnectionError: the target refused the handshake (the status is in the message),
                or the connection failed.
        """
        s = socket.create_connection(self.target.addrs[0], timeout=timeout_s)
        try:
            if self.target.secret is not None:
                body = wc.authenticate(s, self.name, self.instance, self.target.secret, kind, path)
            else:
                s.sendall(wc.hello(self.name, self.instance, kind, path))
                t, body = wc.recv_frame(s)
                if t != wc.HELLO_ACK:
                    raise ConnectionError(f"handshake: frame type {t} instead of HELLO_ACK")
            (status,) = struct.unpack_from("<I", body)
            if status:
                raise ConnectionError(f"handshake refused: status {status}")
        except BaseException:
            s.close()
            raise
        return s, body

    def regions(self) -> list[RemoteRegion]:
        """The target's region table, from a control connection's HELLO_ACK."""
        s, body = self.open(wc.CONTROL)
        s.close()
        return [RemoteRegion(rid, size, rights, name, self.target.keys.get(rid))
                for rid, size, rights, name in region_table(body)]  # fmt: skip

    def region(self, rights: int) -> RemoteRegion:
        """The region named "attack" with ``rights`` (a target that keeps the attacker's
        writes out of what its legitimate peers compare), else the largest one with them,
        whose key the metadata carries.

        Raises:
            LookupError: there is none.
        """
        fit = [r for r in self.regions() if r.rights & rights and r.key is not None]
        if not fit:
            raise LookupError(f"target {self.target.name!r} exposes no region with rights "
                              f"{rights} whose key its metadata carries")  # fmt: skip
        named = [r for r in fit if r.name == "attack"]
        return named[0] if named else max(fit, key=lambda r: r.nbytes)


def data_frame(xfer: int, chunk: int, attempt: int, region: RemoteRegion, offset: int,
               payload: bytes) -> bytes:  # fmt: skip
    """A whole DATA frame: one piece [offset, offset + len(payload)) of region, its key, the
    payload and its crc32c trailer."""
    assert region.key is not None
    body = struct.pack("<QIII", xfer, chunk, attempt, 1)
    body += struct.pack("<QQQ", region.id, offset, len(payload))
    body += struct.pack("<IQ", 1, region.id) + region.key
    return wc.frame(wc.DATA, body, len(payload)) + payload + struct.pack("<I", wc.crc(payload))


def read_req(xfer: int, region: RemoteRegion, n_pieces: int = MAX_PIECES) -> bytes:
    """A READ_REQ of ``n_pieces`` one-byte pieces of region at offsets 0, 2, 4, ... (wrapping):
    none adjacent, so the target cannot merge them into fewer iovecs."""
    assert region.key is not None
    body = struct.pack("<QIII", xfer, 0, 1, n_pieces)
    body += b"".join(struct.pack("<QQQ", region.id, 2 * i % region.nbytes, 1)
                     for i in range(n_pieces))  # fmt: skip
    body += struct.pack("<IQ", 1, region.id) + region.key
    return wc.frame(wc.READ_REQ, body)


def _announce_template(n_chunks: int, tag: bytes) -> tuple[bytes, int]:
    """An ANNOUNCE body for xfer 0 of a one-layer push of n_chunks one-byte chunks, and the
    offset of its xfer field (0): callers patch the id in."""
    body = struct.pack("<QQIIII", 0, n_chunks, n_chunks, 1, 0, len(tag)) + tag
    return body + bytes(8 * n_chunks), 0


def _with_xfer(template: bytes, xfer: int) -> bytes:
    body = struct.pack("<Q", xfer) + template[8:]
    return wc.frame(wc.ANNOUNCE, body)


class FrameCounter:
    """Reads everything the target sends on a connection and drops it, counting frames by
    type and the last ACK status per transfer: the attacker keeps reading its answers, so the
    target's "does not read its answers" cut does not end the attack."""

    def __init__(self, s: socket.socket, stop: threading.Event,
                 on_ack: Callable[[int, int], None] | None = None) -> None:  # fmt: skip
        self.s = s
        self.stop = stop
        self.on_ack = on_ack
        self.by_type: dict[int, int] = {}
        self.closed = threading.Event()  # the target closed (or reset) the connection
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        buf = bytearray()
        try:
            while not self.stop.is_set():
                r, _, _ = select.select([self.s], [], [], 0.2)
                if not r:
                    continue
                got = self.s.recv(1 << 20)
                if not got:
                    break
                buf += got
                self._parse(buf)
        except (OSError, ValueError):  # reset, or closed under us by the sender's side
            pass
        self.closed.set()

    def _parse(self, buf: bytearray) -> None:
        off = 0
        while len(buf) - off >= HDR.size:
            _, _, t, _, blen, _, plen = HDR.unpack_from(buf, off)
            size = HDR.size + blen + (plen + 4 if plen else 0)
            if len(buf) - off < size:
                break
            self.by_type[t] = self.by_type.get(t, 0) + 1
            if t == wc.ACK and self.on_ack is not None:
                xfer, _, _, status = struct.unpack_from("<QIII", buf, off + HDR.size)
                self.on_ack(xfer, status)
            off += size
        del buf[:off]


class Attack:
    """An attack by one admitted peer, run by threads of this process until :meth:`stop`.

    ``ready`` is set once the attack is at full pressure (what that means is the subclass's
    docstring); ``stats`` counts what it did. Subclasses implement :meth:`_run`, which
    returns when ``self._stop`` is set and closes every connection it opened: after
    :meth:`stop` the peer has left.
    """

    kind: ClassVar[str]

    def __init__(self, target: Target, name: str = "attacker", **params: Any) -> None:
        self.peer = Peer(target, name)
        self.params = params
        self.ready = threading.Event()
        self.stats: dict[str, Any] = {"kind": self.kind, "frames": 0, "bytes": 0,
                                      "reconnects": 0, "errors": []}  # fmt: skip
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards stats from several threads
        self._threads: list[threading.Thread] = []
        self._socks: dict[socket.socket, int] = {}  # connection -> the thread that opened it
        self._xfer = 0

    def next_xfer(self) -> int:
        with self._lock:
            self._xfer += 1
            return self._xfer

    def count(self, frames: int, nbytes: int) -> None:
        with self._lock:
            self.stats["frames"] += frames
            self.stats["bytes"] += nbytes

    def error(self, what: str) -> None:
        with self._lock:
            self.stats["reconnects"] += 1
            if len(self.stats["errors"]) < 5:
                self.stats["errors"].append(what[:200])

    def open(self, kind: int = wc.DATA_CONN, path: int = 0) -> socket.socket:
        s, _ = self.peer.open(kind, path)
        with self._lock:
            self._socks[s] = threading.get_ident()
        return s

    def close(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.pop(s, None)
        with contextlib.suppress(OSError):
            s.close()

    def spawn(self, fn: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(target=self._guard, args=(fn, *args), daemon=True)
        self._threads.append(t)
        t.start()

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        while not self._stop.is_set():
            try:
                fn(*args)
                return
            except (OSError, ConnectionError, AssertionError, LookupError) as exc:
                with self._lock:
                    mine = [s for s, t in self._socks.items() if t == threading.get_ident()]
                for s in mine:  # what the failed round opened goes with it
                    self.close(s)
                if self._stop.is_set():
                    return
                self.error(f"{type(exc).__name__}: {exc}")
                self._stop.wait(0.05)  # then again, on a new connection

    def start(self) -> Attack:
        self.spawn(self._run)
        return self

    def stop(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Stops every thread and closes every connection (the peer leaves); the stats."""
        self._stop.set()
        with self._lock:
            socks = list(self._socks)
        for s in socks:  # unblocks a sendall that waits for the target to read
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for s in socks:
            self.close(s)
        self.stats["alive_threads"] = sum(t.is_alive() for t in self._threads)
        return self.stats

    def _send(self, s: socket.socket, data: bytes, frames: int) -> bool:
        """sendall that gives up (False) once the attack is stopped; the socket has a
        timeout, so a target that stops reading only makes it wait."""
        view = memoryview(data)
        while view:
            if self._stop.is_set():
                return False
            try:
                n = s.send(view)
            except TimeoutError:
                continue
            view = view[n:]
        self.count(frames, len(data))
        return True

    def _run(self) -> None:
        raise NotImplementedError


class AnnounceLockout(Attack):
    """Four pushes of 65,536 chunks (the whole MAX_LIVE_CHUNKS today), each kept "active" by
    a 1-byte DATA into its chunk 0 every 0.3 s (the byte lands once, at the last byte of the
    largest writable region). A push the target dropped (its DATA answered PROTOCOL: not
    announced) is replaced by a newly announced one. Ready: every push had a DATA answered
    OK."""

    kind = "announce-lockout"

    def _run(self) -> None:
        pushes = int(self.params.get("pushes", 4))
        chunks = int(self.params.get("chunks", MAX_CHUNKS))
        every_s = float(self.params.get("every_s", 0.3))
        region = self.peer.region(RIGHT_WRITE)
        template, _ = _announce_template(chunks, b"")
        s = self.open()
        status: dict[int, int] = {}

        def on_ack(xfer: int, st: int) -> None:
            status[xfer] = st

        reader = FrameCounter(s, self._stop, on_ack)
        slots = [self.next_xfer() for _ in range(pushes)]
        for x in slots:
            self._send(s, _with_xfer(template, x), 1)
        payload = b"\x5a"
        while not self._stop.is_set() and not reader.closed.is_set():
            for i, x in enumerate(slots):
                if status.get(x, 0) != 0:  # refused, dropped or ended by the target
                    slots[i] = x = self.next_xfer()  # announce anew
                    self.stats["reannounced"] = self.stats.get("reannounced", 0) + 1
                    self._send(s, _with_xfer(template, x), 1)
                self._send(s, data_frame(x, 0, 1, region, region.nbytes - 1, payload), 1)
            if all(status.get(x) == 0 for x in slots):
                self.ready.set()
            self._stop.wait(every_s)
        self.stats["acks"] = reader.by_type.get(wc.ACK, 0)
        self.stats["last_status"] = sorted(set(status.values()))
        if reader.closed.is_set() and not self._stop.is_set():
            raise ConnectionError("the target closed the connection")


class AnnounceBig(Attack):
    """65,536-chunk ANNOUNCEs (512 KiB each) at ``rate`` per second (100), each a new push,
    never followed by DATA: no key is needed. Ready after one second of it."""

    kind = "announce-big"

    def _run(self) -> None:
        rate = float(self.params.get("rate", 100.0))
        chunks = int(self.params.get("chunks", MAX_CHUNKS))
        template, _ = _announce_template(chunks, b"")
        s = self.open()
        reader = FrameCounter(s, self._stop)
        t0 = time.monotonic()
        sent = 0
        while not self._stop.is_set() and not reader.closed.is_set():
            due = t0 + sent / rate
            if (wait := due - time.monotonic()) > 0:
                self._stop.wait(wait)
                continue
            self._send(s, _with_xfer(template, self.next_xfer()), 1)
            sent += 1
            if time.monotonic() - t0 >= 1.0:
                self.ready.set()
        if reader.closed.is_set() and not self._stop.is_set():
            raise ConnectionError("the target closed the connection")


class AnnounceFlood(Attack):
    """1-chunk ANNOUNCEs, each a new push, in batches of 256, as fast as the target reads
    them, on ``conns`` (1) data connections. Ready after one second of it."""

    kind = "announce-flood"

    def _run(self) -> None:
        t0 = time.monotonic()
        for path in range(int(self.params.get("conns", 1))):
            self.spawn(self._flood, path, t0)

    def _flood(self, path: int, t0: float) -> None:
        template, _ = _announce_template(1, b"")
        tail = template[8:]
        s = self.open(wc.DATA_CONN, path)
        reader = FrameCounter(s, self._stop)
        batch = 256
        while not self._stop.is_set() and not reader.closed.is_set():
            with self._lock:
                first = self._xfer + 1
                self._xfer += batch
            out = b"".join(wc.frame(wc.ANNOUNCE, struct.pack("<Q", x) + tail)
                           for x in range(first, first + batch))  # fmt: skip
            self._send(s, out, batch)
            if time.monotonic() - t0 >= 1.0:
                self.ready.set()
        if reader.closed.is_set() and not self._stop.is_set():
            raise ConnectionError("the target closed the connection")


class NotifyFlood(Attack):
    """NOTIFYs of a push (op 1) with ``tag_bytes`` (4096) tags, every one a new transfer id
    (so none is a re-sent copy), as fast as possible, their NOTIFY_ACKs read. Ready once
    ``ready_acks`` (66,000: more than the target's 65,536-entry queue) were answered."""

    kind = "notify-flood"

    def _run(self) -> None:
        tag_len = int(self.params.get("tag_bytes", MAX_TAG))
        ready_acks = int(self.params.get("ready_acks", 66000))
        s = self.open()
        reader = FrameCounter(s, self._stop)
        base = os.urandom(tag_len)
        batch = 16
        while not self._stop.is_set() and not reader.closed.is_set():
            with self._lock:
                first = self._xfer + 1
                self._xfer += batch
            out = b"".join(wc.notify(x, struct.pack("<Q", x) + base[8:])
                           for x in range(first, first + batch))  # fmt: skip
            self._send(s, out, batch)
            if reader.by_type.get(wc.NOTIFY_ACK, 0) >= ready_acks:
                self.ready.set()
        self.stats["notify_acks"] = reader.by_type.get(wc.NOTIFY_ACK, 0)
        if reader.closed.is_set() and not self._stop.is_set():
            raise ConnectionError("the target closed the connection")


class AnnounceTags(Attack):
    """Rounds of ``per_round`` (16,384: the target's entry limit) 1-chunk ANNOUNCEs with
    ``tag_bytes`` (4096) tags, each round on a new data connection that is closed once the
    round is sent (and ``gap_s``, 0.2 s, later the next begins). Ready after the first round."""

    kind = "announce-tags"

    def _run(self) -> None:
        per_round = int(self.params.get("per_round", 16384))
        tag_len = int(self.params.get("tag_bytes", MAX_TAG))
        gap_s = float(self.params.get("gap_s", 0.2))
        base = os.urandom(tag_len)
        tail_tmpl, _ = _announce_template(1, base)
        rounds = 0
        while not self._stop.is_set():
            s = self.open()
            reader = FrameCounter(s, self._stop)
            sent = 0
            while sent < per_round and not self._stop.is_set():
                n = min(64, per_round - sent)
                with self._lock:
                    first = self._xfer + 1
                    self._xfer += n
                # distinct tags: the push's id in the tag's first bytes
                out = b"".join(
                    wc.frame(wc.ANNOUNCE, struct.pack("<Q", x) + tail_tmpl[8:32]
                             + struct.pack("<Q", x) + tail_tmpl[40:])
                    for x in range(first, first + n)
                )  # fmt: skip
                if not self._send(s, out, n):
                    break
                sent += n
            # the target has read the round once it answers (errors aside, ANNOUNCE has no
            # answer: a PING's PONG after it says the frames before it were taken)
            self._send(s, wc.frame(wc.PING, struct.pack("<Q", rounds)), 1)
            deadline = time.monotonic() + 30
            while (not reader.by_type.get(wc.PONG) and not reader.closed.is_set()
                   and not self._stop.is_set() and time.monotonic() < deadline):  # fmt: skip
                self._stop.wait(0.01)
            self.close(s)
            rounds += 1
            self.stats["rounds"] = rounds
            self.ready.set()
            self._stop.wait(gap_s)


class UnreadAnswers(Attack):
    """READ_REQs of 8192 one-byte pieces of the largest readable region, on ``conns`` (4)
    data connections, as fast as the target reads them; the answers are never read. A
    connection the target cuts is opened anew. Ready once every connection's send has
    blocked (the target stopped reading it) or after 3 s."""

    kind = "unread-answers"

    def _run(self) -> None:
        region = self.peer.region(RIGHT_READ)
        conns = int(self.params.get("conns", 4))
        self._blocked: set[int] = set()
        t0 = time.monotonic()
        for path in range(conns):
            self.spawn(self._flood, region, path, conns, t0)

    def _flood(self, region: RemoteRegion, path: int, conns: int, t0: float) -> None:
        req = read_req(path + 1, region, int(self.params.get("pieces", MAX_PIECES)))
        batch = req * 4
        s = self.open(wc.DATA_CONN, path)
        s.settimeout(0.2)
        while not self._stop.is_set():
            view = memoryview(batch)
            while view and not self._stop.is_set():
                try:
                    view = view[s.send(view) :]
                except TimeoutError:
                    with self._lock:
                        self._blocked.add(path)
                if len(self._blocked) >= conns or time.monotonic() - t0 > 3:
                    self.ready.set()
            self.count(4, len(batch))
        self.close(s)


class Trickle(Attack):
    """``conns`` (100) data connections, each sending a DATA header that announces a
    ``body_bytes`` (1 MiB) body and ``prefix`` bytes of it at once, then one byte of it every
    ``every_s`` (4 s), under the target's 6 x connect_timeout_s cut for silence. The default
    prefix is all of the body but its last 4096 bytes: today the target allocates the whole
    body at the header, but only pages written count in its RSS, so a trickle of a body it
    has mostly received is what it really holds (``prefix=0`` is the bare header). A
    connection the target cuts is opened anew. Ready once every connection sent its prefix."""

    kind = "trickle"

    def _run(self) -> None:
        conns = int(self.params.get("conns", 100))
        body = int(self.params.get("body_bytes", MAX_BODY))
        prefix = int(self.params.get("prefix", body - 4096))
        every_s = float(self.params.get("every_s", 4.0))
        hdr = HDR.pack(wc.MAGIC, wc.VERSION, wc.DATA, 0, body, 0, 0)
        live: list[tuple[socket.socket, int]] = []  # (socket, body bytes sent)
        self.stats["cut"] = 0
        while not self._stop.is_set():
            while len(live) < conns and not self._stop.is_set():
                s = self.open(wc.DATA_CONN, len(live) % 64)
                s.sendall(hdr + bytes(prefix))
                live.append((s, prefix))
                self.count(1, len(hdr) + prefix)
            self.ready.set()
            self._stop.wait(every_s)
            keep = []
            for s, sent in live:
                try:
                    if sent < body - 1:  # never finish the frame: one byte short
                        s.sendall(b"\0")
                        sent += 1
                    keep.append((s, sent))
                except OSError:
                    self.stats["cut"] += 1
                    self.close(s)
            live = keep


_ALL = (AnnounceLockout, AnnounceBig, AnnounceFlood, NotifyFlood, AnnounceTags, UnreadAnswers)
ATTACKS: dict[str, type[Attack]] = {a.kind: a for a in (*_ALL, Trickle)}


def make_attack(kind: str, target: Target, name: str = "attacker", **params: Any) -> Attack:
    """The attack ``kind`` (a key of ATTACKS) on target, not started yet.

    Raises:
        KeyError: no such attack.
    """
    return ATTACKS[kind](target, name, **params)


@dataclass
class AttackProcess:
    """An attack run by ``python -m tests.attacks`` in a child process: its own interpreter,
    so it floods at full speed whatever this process does. :meth:`stop` ends it (the peer
    leaves: its connections close with the process) and answers its stats."""

    kind: str
    metadata: bytes | str
    secret: bytes | str | None = None
    name: str = "attacker"
    params: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise KeyError(f"{self.kind!r}: no such attack; one of {', '.join(ATTACKS)}")
        md = self.metadata.decode() if isinstance(self.metadata, bytes) else self.metadata
        sec = self.secret.encode() if isinstance(self.secret, str) else self.secret
        argv = [sys.executable, "-m", "tests.attacks", self.kind, "--metadata", md,
                "--name", self.name, "--params", json.dumps(self.params)]  # fmt: skip
        if sec is not None:
            argv += ["--secret-hex", sec.hex()]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))  # fmt: skip
        self.p = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.pid = self.p.pid
        self._lines: list[dict[str, Any]] = []
        self._got = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        with self.p.stdout:
            for line in self.p.stdout:
                with self._got:
                    self._lines.append(json.loads(line))
                    self._got.notify_all()
        with self._got:
            self._lines.append({"eof": True})
            self._got.notify_all()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the attack said it was at full pressure within timeout_s.

        Raises:
            RuntimeError: the attack process ended first.
        """
        with self._got:
            self._got.wait_for(lambda: bool(self._lines), timeout_s)
            if self._lines and "eof" in self._lines[-1]:
                raise RuntimeError(f"attack {self.kind} ended early (exit {self.p.wait(5)})")
            return any(line.get("ready") for line in self._lines)

    def stop(self, timeout_s: float = 15.0) -> dict[str, Any]:
        """Ends the attack; its stats (empty if the process gave none)."""
        if self.stats is not None:
            return self.stats
        with contextlib.suppress(OSError, ValueError):
            assert self.p.stdin is not None
            self.p.stdin.write("stop\n")
            self.p.stdin.close()
        try:
            self.p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(5)
        with self._got:
            self._got.wait_for(lambda: any("eof" in x for x in self._lines), 5)
            self.stats = next((x["stats"] for x in self._lines if "stats" in x), {})
        return self.stats

    def __enter__(self) -> AttackProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=sorted(ATTACKS))
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--metadata", help="the target's metadata (JSON)")
    src.add_argument("--metadata-file", help="a file holding the target's metadata")
    ap.add_argument("--secret-hex", help="the cluster secret, hex")
    ap.add_argument("--name", default="attacker", help="the peer name the attacker presents")
    ap.add_argument("--params", default="{}", help="the attack's parameters, a JSON object")
    ap.add_argument("--duration-s", type=float, help="stop after this long (else at stdin's end)")
    args = ap.parse_args(argv)
    md = args.metadata if args.metadata else Path(args.metadata_file).read_text()
    secret = bytes.fromhex(args.secret_hex) if args.secret_hex else None
    attack = make_attack(args.kind, Target.from_metadata(md, secret), args.name,
                         **json.loads(args.params)).start()  # fmt: skip

    def say_ready() -> None:
        while not attack.ready.wait(0.1):
            if attack._stop.is_set():
                return
        print(json.dumps({"ready": True}), flush=True)

    threading.Thread(target=say_ready, daemon=True).start()
    if args.duration_s is not None:
        time.sleep(args.duration_s)
    else:
        sys.stdin.readline()  # "stop", or the end of stdin
    print(json.dumps({"stats": attack.stop()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
