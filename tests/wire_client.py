"""A raw kvlink wire client for tests: builds frames byte by byte
(docs/wire-protocol.md) so tests can send what a real agent would not."""

from __future__ import annotations

import socket
import struct

from kvlink._native import crc32c

MAGIC = 0x4B4C564B
VERSION = 2
HELLO, HELLO_ACK, DATA, ACK, READ_REQ, READ_RESP, NOTIFY = 1, 2, 3, 4, 5, 6, 7
REGIONS_REQ, REGIONS, PING, PONG, END, NOTIFY_ACK, ANNOUNCE = 8, 9, 10, 11, 12, 13, 14
CONTROL, DATA_CONN = 0, 1
SUPERSEDED = 100  # wire-only ACK status: a newer copy owns the chunk


def crc(b: bytes) -> int:
    return crc32c(b)


def frame(ftype: int, body: bytes, payload_len: int = 0) -> bytes:
    hdr = struct.pack("<IBBHIIQ", MAGIC, VERSION, ftype, 0, len(body), crc(body), payload_len)
    return hdr + body


def hello(name: str, instance: int, kind: int = CONTROL, path: int = 0) -> bytes:
    raw = name.encode()
    return frame(HELLO, struct.pack("<QBHH", instance, kind, path, len(raw)) + raw)


def notify(xfer: int, tag: bytes, op: int = 1) -> bytes:
    return frame(NOTIFY, struct.pack("<QII", xfer, op, len(tag)) + tag)


def announce(xfer: int, nbytes: int, n_chunks: int, tag: bytes = b"", timeout_ms: int = 0) -> bytes:
    """ANNOUNCE of a one-layer push; it must precede its DATA on each connection."""
    body = struct.pack("<QQIIII", xfer, nbytes, n_chunks, 1, timeout_ms, len(tag)) + tag
    return frame(ANNOUNCE, body + struct.pack("<II", 0, 0) * n_chunks)


def end(xfer: int, status: int = 0, msg: bytes = b"") -> bytes:
    """END: the push is over (status 0: done)."""
    return frame(END, struct.pack("<QIIIH", xfer, 0, 0, status, len(msg)) + msg)


def data(xfer: int, chunk: int, attempt: int, region: int, n: int) -> bytes:
    """A DATA header for one piece [0, n) of region; the payload and trailer follow."""
    body = struct.pack("<QIII", xfer, chunk, attempt, 1) + struct.pack("<QQQ", region, 0, n)
    return frame(DATA, body, n)


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise ConnectionError("connection closed by the agent")
        out += got
    return out


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
    addr: tuple[str, int], kind: int, path: int, name: str = "scripted-tx", instance: int = 77
) -> socket.socket:
    """A connection that completed the handshake as agent `name`."""
    s = socket.create_connection(addr, timeout=10)
    s.sendall(hello(name, instance, kind, path))
    t, body = recv_frame(s)
    assert t == HELLO_ACK and struct.unpack_from("<I", body)[0] == 0, body
    return s
