"""Bad input: a specific exception naming the argument, never a crash, never a
write into memory that was not offered for it."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvlink
from kvlink.bench import WorkerError
from tests import wire_client as wc

MiB = 1 << 20


@pytest.fixture
def pair(make_agent, spawn_peer):
    """A local agent 'tx' connected to a peer process 'rx' exposing:
    'w' (1 MiB, remote_write, zeros), 'r' (1 MiB, remote_read, pattern seed 1),
    'none' (1 MiB, no remote rights, pattern seed 2)."""
    rx = spawn_peer("rx", nics="loopback:2")
    rx.call("alloc", key="w", nbytes=MiB, remote_write=True, name="w")
    rx.call("alloc", key="r", nbytes=MiB, seed=1, remote_read=True, name="r")
    rx.call("alloc", key="none", nbytes=MiB, seed=2, name="none")
    tx = make_agent("tx", nics="loopback:2")
    tx.add_peer(rx.metadata)
    return tx, rx


def unchanged(rx, key, before):
    assert rx.call("digest", key=key)["digest"] == before


def test_unregistered_buffer(pair):
    tx, rx = pair
    before = rx.call("digest", key="w")["digest"]
    with pytest.raises(kvlink.NotRegisteredError, match="src: this buffer"):
        tx.push("rx", src=np.ones(MiB, np.uint8), dst="w")
    with pytest.raises(kvlink.NotRegisteredError, match="dst: this buffer"):
        tx.pull("rx", src="r", dst=np.zeros(MiB, np.uint8))
    unchanged(rx, "w", before)


def test_segment_outside_region_local_side(pair):
    tx, rx = pair
    src = np.ones(MiB, np.uint8)
    r = tx.register(src)
    before = rx.call("digest", key="w")["digest"]
    with pytest.raises(kvlink.OutOfBoundsError, match=r"segments\[0\]\.src"):
        tx.push("rx", segments=[kvlink.Segment(r.id, MiB - 10, 1, 0, 100)])
    with pytest.raises(kvlink.OutOfBoundsError, match="src_offset"):
        tx.push("rx", src=src, dst="w", src_offset=2 * MiB)
    unchanged(rx, "w", before)


def test_segment_outside_region_remote_side(pair):
    tx, rx = pair
    src = np.ones(MiB, np.uint8)
    r = tx.register(src)
    w = next(x for x in tx.remote_regions("rx") if x.name == "w")
    before = rx.call("digest", key="w")["digest"]
    with pytest.raises(kvlink.OutOfBoundsError, match=r"segments\[1\]\.dst.*peer 'rx'"):
        tx.push(
            "rx",
            segments=[
                kvlink.Segment(r.id, 0, w.id, 0, 4096),  # fine
                kvlink.Segment(r.id, 0, w.id, MiB - 100, 4096),  # runs past the end
            ],
        )
    with pytest.raises(kvlink.UnknownRegionError, match="no region 999"):
        tx.push("rx", segments=[kvlink.Segment(r.id, 0, 999, 0, 10)])
    unchanged(rx, "w", before)  # not even the valid first segment was sent


def test_size_mismatch(pair):
    tx, _ = pair
    big = np.ones(2 * MiB, np.uint8)
    tx.register(big)
    with pytest.raises(kvlink.SizeMismatchError, match=r"dst .*has only 1048576"):
        tx.push("rx", src=big, dst="w")
    with pytest.raises(kvlink.SizeMismatchError, match="nbytes"):
        tx.push("rx", src=big[:100], dst="w", nbytes=200)


def test_pull_without_remote_read(pair):
    tx, _ = pair
    dst = np.zeros(MiB, np.uint8)
    tx.register(dst)
    # a region exposed to nobody is not even listed to peers
    with pytest.raises(kvlink.UnknownRegionError, match="no region 'none'"):
        tx.pull("rx", src="none", dst=dst)
    with pytest.raises(kvlink.RemoteAccessError, match="remote_read=True"):
        tx.pull("rx", src="w", dst=dst)  # writable is not readable
    assert not dst.any()


def test_push_without_remote_write(pair):
    tx, rx = pair
    src = np.ones(MiB, np.uint8)
    tx.register(src)
    before = {k: rx.call("digest", key=k)["digest"] for k in ("r", "none")}
    with pytest.raises(kvlink.RemoteAccessError, match="remote_write=True"):
        tx.push("rx", src=src, dst="r")
    with pytest.raises(kvlink.UnknownRegionError, match="no region 'none'"):
        tx.push("rx", src=src, dst="none")  # exposed to nobody: not listed
    for key in ("r", "none"):
        unchanged(rx, key, before[key])


def test_pull_into_read_only_memory(pair):
    tx, _ = pair
    ro = np.zeros(MiB, np.uint8)
    ro.flags.writeable = False
    tx.register(ro)
    with pytest.raises(kvlink.RemoteAccessError, match="read-only"):
        tx.pull("rx", src="r", dst=ro)
    assert not ro.any()


def test_unknown_peer(pair):
    tx, _ = pair
    src = np.ones(10, np.uint8)
    tx.register(src)
    with pytest.raises(kvlink.UnknownPeerError, match=r"no peer named 'nobody'.*add_peer"):
        tx.push("nobody", src=src, dst="w")


def test_duplicate_agent_name_in_process(make_agent):
    make_agent("same")
    with pytest.raises(kvlink.DuplicateNameError, match="already open in this process"):
        make_agent("same")


def test_duplicate_agent_name_across_peers(make_agent, spawn_peer):
    rx = spawn_peer("rx")
    me = make_agent("rx-twin")
    with pytest.raises(kvlink.DuplicateNameError, match="own name"):
        make_agent("rx").add_peer(rx.metadata)  # a local agent also named 'rx'
    first = spawn_peer("client")
    first.call("add_peer", metadata=rx.metadata.decode())
    second = spawn_peer("client")  # a different process with the same name
    with pytest.raises(WorkerError) as ei:
        second.call("add_peer", metadata=rx.metadata.decode())
    assert ei.value.error == "DuplicateNameError"
    assert "names must be unique" in ei.value.message
    me.add_peer(rx.metadata)  # the listener is still fine


def test_use_after_close(make_agent, spawn_peer):
    rx = spawn_peer("rx")
    a = make_agent("closing")
    buf = np.ones(MiB, np.uint8)
    a.register(buf)
    a.add_peer(rx.metadata)
    a.close()
    a.close()  # idempotent
    for call in (
        lambda: a.register(np.ones(4, np.uint8)),
        lambda: a.push("rx", src=buf, dst=1),
        lambda: a.add_peer(rx.metadata),
        lambda: a.paths(),
        lambda: a.notifications(),
        lambda: a.metadata(),
    ):
        with pytest.raises(kvlink.ClosedError, match="closed"):
            call()


def test_non_contiguous_array(make_agent):
    a = make_agent("nc")
    arr = np.ones((64, 64), np.uint8)
    with pytest.raises(kvlink.RegistrationError, match="not C-contiguous"):
        a.register(arr[:, ::2])
    with pytest.raises(kvlink.RegistrationError, match="exposes no memory"):
        a.register(object())
    with pytest.raises(kvlink.RegistrationError, match="read-only"):
        a.register(b"immutable bytes", remote_write=True)


def test_deregister_while_in_use_is_refused(make_agent, scripted_receiver):
    # The receiver withholds its ACKs until released, so the push is in use for certain
    # when deregister() is called, and over for certain when it is called again.
    rx = scripted_receiver("rx", paths=2, region="big", nbytes=64 * MiB)
    tx = make_agent("tx", nics="loopback:2")
    src = np.ones(64 * MiB, np.uint8)
    r = tx.register(src)
    tx.add_peer(rx.metadata)
    h = tx.push("rx", src=src, dst="big")
    with pytest.raises(kvlink.RegionBusyError, match="wait for them"):
        tx.deregister(r)
    assert not h.done
    assert [x.id for x in tx.regions()] == [r.id], "a refused deregister keeps the region"
    rx.release()
    assert h.wait(30).ok
    tx.deregister(r)
    assert tx.regions() == []


def _send_raw(port: int, data: bytes, linger_s: float = 0.5) -> bytes:
    """Sends raw bytes to an agent's listener; returns what came back before close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            return b""  # the agent hung up while we were still sending: fine
        s.settimeout(linger_s + 5)
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)


def test_garbage_and_truncated_frames_on_listener(make_agent, spawn_peer):
    rx = spawn_peer("rx", nics="loopback:1")
    rx.call("alloc", key="w", nbytes=MiB, remote_write=True, name="w")
    port = rx.addresses[0][1]
    magic = struct.pack("<I", 0x4B4C564B)
    hello_hdr = magic + bytes([wc.VERSION, 1]) + b"\0\0"
    attacks = [
        os.urandom(4096),  # garbage
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # another protocol
        hello_hdr[:7],  # truncated header
        hello_hdr + struct.pack("<IIQ", 50, 0, 0) + b"abc",  # body cut short
        hello_hdr + struct.pack("<IIQ", 1 << 30, 0, 0),  # absurd body length
        # DATA first
        magic + bytes([wc.VERSION, 3]) + b"\0\0" + struct.pack("<IIQ", 28, 0, 1 << 20),
        hello_hdr + struct.pack("<IIQ", 12, 0xDEADBEEF, 0) + b"x" * 12,  # bad body crc
    ]
    for data in attacks:
        back = _send_raw(port, data)
        assert back == b"", "the agent answers garbage by closing, not by talking"
    # another protocol version gets a HELLO_ACK saying so (HandshakeError on
    # that side), then the connection closes
    back = _send_raw(port, magic + bytes([9, 1]) + b"\0\0" + struct.pack("<IIQ", 0, 0, 0))
    assert back[:6] == magic + bytes([wc.VERSION, 2])  # our version, HELLO_ACK
    assert struct.unpack_from("<I", back, 24)[0] == kvlink.ErrorCode.HANDSHAKE
    assert b"wire protocol 9" in back
    tx = make_agent("tx", nics="loopback:1")
    src = np.arange(MiB, dtype=np.uint64).view(np.uint8)[:MiB].copy()
    tx.register(src)
    tx.add_peer(rx.metadata)
    tx.push("rx", src=src, dst="w").wait(10)
    assert rx.call("read", key="w", offset=0, nbytes=64)["hex"] == src[:64].tobytes().hex()


@pytest.mark.timing
def test_stalled_half_frame_is_dropped_and_agent_serves(make_agent, spawn_peer):
    """A client that sends half a HELLO and then says nothing is cut off after
    the handshake timeout; meanwhile real transfers go on."""
    rx = spawn_peer("rx", nics="loopback:1", connect_timeout_s=0.5)
    rx.call("alloc", key="w", nbytes=MiB, remote_write=True, name="w")
    port = rx.addresses[0][1]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(struct.pack("<I", 0x4B4C564B))
        tx = make_agent("tx", nics="loopback:1")
        src = np.ones(MiB, np.uint8)
        tx.register(src)
        tx.add_peer(rx.metadata)
        tx.push("rx", src=src, dst="w").wait(10)
        s.settimeout(5)
        t0 = time.monotonic()
        assert s.recv(1) == b""
        assert time.monotonic() - t0 < 3


def test_frames_behind_a_refused_hello_are_not_processed(make_agent):
    # A HELLO with the listener's own name is refused (DUPLICATE_NAME); the
    # NOTIFY sent right behind it in the same segment used to be delivered
    # as coming from 'victim'.
    victim = make_agent("victim")
    s = socket.create_connection(victim.addresses[0], timeout=10)
    try:
        s.sendall(wc.hello("victim", 0xBAD) + wc.notify(43, b"forged"))
        body = wc.recv_until(s, wc.HELLO_ACK)
        assert struct.unpack_from("<I", body)[0] == kvlink.ErrorCode.DUPLICATE_NAME
        # closed; with our unread NOTIFY in its buffer the kernel may reset it
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(4096) == b"", "the refused connection is closed"
    finally:
        s.close()
    assert victim.notifications(timeout_s=0.5) == []


@pytest.mark.parametrize("right", ["remote_read", "remote_write"])
@pytest.mark.parametrize("value", ["no", "yes", 1, 0, None])
def test_rights_must_be_real_booleans(make_agent, right, value):
    a = make_agent("rights")
    buf = np.zeros(4096, np.uint8)
    with pytest.raises(kvlink.ArgumentTypeError, match=f"{right}: expected True or False") as ei:
        a.register(buf, **{right: value})
    assert isinstance(ei.value, TypeError)
    assert a.regions() == []  # nothing was registered


def test_remote_regions_refresh_must_be_a_boolean(pair):
    tx, _ = pair
    with pytest.raises(kvlink.ArgumentTypeError, match="refresh: expected True or False"):
        tx.remote_regions("rx", refresh="yes")


@pytest.mark.parametrize("bad", [-1, -0.001, float("nan")])
def test_negative_timeouts_are_refused(pair, bad):
    tx, _ = pair
    src = np.ones(4096, np.uint8)
    tx.register(src)
    h = tx.push("rx", src=src, dst="w")
    for call in (
        lambda: tx.push("rx", src=src, dst="w", timeout_s=bad),
        lambda: h.wait(timeout_s=bad),
        lambda: h.wait_layer(0, timeout_s=bad),
        lambda: next(h.chunks(timeout_s=bad)),
        lambda: tx.prepare("rx", timeout_s=bad),
        lambda: tx.notifications(timeout_s=bad),
        lambda: tx.inbound(timeout_s=bad),
    ):
        with pytest.raises(kvlink.InvalidArgumentError, match=r"timeout_s: .* is not a duration"):
            call()
    h.wait(timeout_s=10)


def test_timeouts_must_be_numbers(pair):
    tx, _ = pair
    src = np.ones(4096, np.uint8)
    tx.register(src)
    h = tx.push("rx", src=src, dst="w")
    for call in (
        lambda: h.wait(timeout_s="5"),
        lambda: tx.push("rx", src=src, dst="w", timeout_s="5"),
        lambda: tx.prepare("rx", timeout_s=None),
        lambda: tx.notifications(timeout_s="1"),
        lambda: tx.inbound(timeout_s=True),
    ):
        with pytest.raises(kvlink.ArgumentTypeError, match="timeout_s: expected seconds") as ei:
            call()
        assert isinstance(ei.value, TypeError)
    h.wait(timeout_s=10)


def test_prepare_layout_must_be_a_layout_or_dict(pair):
    tx, _ = pair
    with pytest.raises(kvlink.ArgumentTypeError, match=r"layout: expected a kvlink\.kv"):
        tx.prepare("rx", layout=object())
    with pytest.raises(kvlink.ArgumentTypeError, match="layout: the dict is not JSON-able"):
        tx.prepare("rx", layout={"x": object()})


def test_deregister_takes_a_region_or_its_id(make_agent):
    a = make_agent("dereg")
    buf = np.zeros(4096, np.uint8)
    r = a.register(buf, name="kv")
    for bad in ("kv", buf, 1.0, True):
        with pytest.raises(kvlink.ArgumentTypeError, match="region: expected the Region"):
            a.deregister(bad)
    other = make_agent("dereg-other")
    r_other = other.register(np.zeros(4096, np.uint8))
    with pytest.raises(kvlink.UnknownRegionError, match="not registered with agent 'dereg'"):
        a.deregister(r_other)
    a.deregister(r)
    with pytest.raises(kvlink.UnknownRegionError):
        a.deregister(r)
    with pytest.raises(kvlink.UnknownRegionError):
        a.deregister(r.id)


def test_overlapping_destinations_in_one_push_are_refused(pair):
    tx, rx = pair
    src = np.ones(MiB, np.uint8)
    r = tx.register(src)
    w = next(x for x in tx.remote_regions("rx") if x.name == "w")
    before = rx.call("digest", key="w")["digest"]
    segs = [
        kvlink.Segment(r.id, 0, w.id, 0, 4096),
        kvlink.Segment(r.id, 8192, w.id, 65536, 4096),
        kvlink.Segment(r.id, 4096, w.id, 2048, 4096),  # overlaps the first
    ]
    with pytest.raises(
        kvlink.InvalidArgumentError,
        match=rf"segments\[0\] \(dst region {w.id}, bytes \[0, 4096\)\) and segments\[2\] "
        rf"\(dst region {w.id}, bytes \[2048, 6144\)\) overlap",
    ):
        tx.push("rx", segments=segs)
    unchanged(rx, "w", before)
    # touching ranges and overlapping sources are fine
    tx.push(
        "rx",
        segments=[
            kvlink.Segment(r.id, 0, w.id, 0, 4096),
            kvlink.Segment(r.id, 0, w.id, 4096, 4096),
        ],
    ).wait(timeout_s=10)


def test_closed_agent_refuses_observation_and_with(make_agent):
    a = make_agent("closed-obs")
    a.register(np.zeros(4096, np.uint8))
    a.close()
    with pytest.raises(kvlink.ClosedError, match="closed"):
        a.regions()
    with pytest.raises(kvlink.ClosedError, match="closed"), a:
        pass


def test_region_table_under_concurrent_register_push_deregister(pair):
    """Threads register and deregister their own buffers while others push from
    theirs: every push finds its region, none sees a table changing under it."""
    tx, _ = pair
    errors: list[BaseException] = []
    stop = time.monotonic() + 3

    def churn() -> None:
        try:
            while time.monotonic() < stop:
                bufs = [np.zeros(4096, np.uint8) for _ in range(20)]
                regions = [tx.register(b) for b in bufs]
                tx.regions()
                for r in regions:
                    tx.deregister(r)
        except BaseException as exc:
            errors.append(exc)

    def pusher() -> None:
        try:
            src = np.ones(64 * 1024, np.uint8)
            r = tx.register(src)
            while time.monotonic() < stop:
                tx.push("rx", src=src[1024:2048], dst="w").wait(timeout_s=10)
            tx.deregister(r)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=f) for f in (churn, churn, pusher, pusher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert tx.regions() == []


def test_bench_cli_refuses_a_non_boolean_setting():
    """kvlink-bench reads the library's config, so it refuses KVLINK_HEDGE=maybe too."""
    env = {**os.environ, "KVLINK_HEDGE": "maybe"}
    out = subprocess.run(
        [sys.executable, "-m", "kvlink.cli.bench", "loopback", "--quick", "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "KVLINK_HEDGE: 'maybe' is not a boolean" in out.stderr


def test_arguments_of_the_wrong_type_raise_argument_type_error(make_agent):
    """A value of the wrong type is an ArgumentTypeError (also an InvalidArgumentError and a
    TypeError); a value of the right type out of range is an InvalidArgumentError."""
    with pytest.raises(kvlink.ArgumentTypeError, match="name"):
        kvlink.Agent(123)  # type: ignore[arg-type]
    a = make_agent("types-a")
    b = make_agent("types-b")
    dst = np.zeros(4096, np.uint8)
    b.register(dst, remote_write=True, name="kv")
    src = np.ones(4096, np.uint8)
    a.register(src)
    with pytest.raises(kvlink.ArgumentTypeError, match="metadata"):
        a.add_peer(123)  # type: ignore[arg-type]
    a.add_peer(b.metadata())
    with pytest.raises(kvlink.ArgumentTypeError, match="nbytes"):
        a.push("types-b", src=src, dst="kv", nbytes="10")  # type: ignore[arg-type]
    with pytest.raises(kvlink.InvalidArgumentError, match="nbytes") as ei:
        a.push("types-b", src=src, dst="kv", nbytes=0)
    assert not isinstance(ei.value, kvlink.ArgumentTypeError)
    h = a.push("types-b", src=src, dst="kv")
    h.wait(timeout_s=10)
    with pytest.raises(kvlink.ArgumentTypeError, match="layer"):
        h.wait_layer("0")  # type: ignore[arg-type]
    with pytest.raises(kvlink.ArgumentTypeError, match="peer"):
        a.remove_peer(5)  # type: ignore[arg-type]
