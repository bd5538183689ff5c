"""The one-sided duplicate-copy rules without UCX: two agents of this process with
transport="fault" run every data path over the fault-injecting mover
(csrc/transport/fault/fault.c: one-sided puts that are memcpy's, completing
asynchronously), whose writes Config.fault_mover makes go wrong: dropped (reported
done, nothing written), corrupted (a byte flipped), duplicated (written twice),
delayed, and late (due long after the sender's stream gave up waiting, so the path is
cut and the mover must cancel the write, never land it).  Over real sockets on
loopback: every transfer completes byte-exact or fails with a clear error within its
timeout, never reports complete with a wrong byte, and no write lands in a destination
after its transfer completed."""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest

import kvlink
from kvlink.bench import measure

MiB = 1 << 20
CHUNK = 64 << 10  # small chunks: many writes per transfer, so the rates bite
N = 3 * MiB + 11  # not a multiple of the chunk: the last write is short
LATE_MS = 1500  # > connect_timeout_s (the stream's cancel wait), < the transfer timeout
TIMEOUT_S = 60.0

# every test twice: I/O on the engine thread, and on two I/O threads (conftest.py)
pytestmark = [pytest.mark.usefixtures("io_threads_mode"), pytest.mark.timeout(300)]

FREED = re.compile(
    r"fault mover: (initiator|listener) end freed after (\d+) writes: (\d+) dropped, "
    r"(\d+) corrupted, (\d+) duplicated, (\d+) delayed, (\d+) late"
)
KINDS = ("dropped", "corrupted", "duplicated", "delayed", "late")


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def wait_for(cond, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def pair(make_agent, spec: str = "", paths: int = 3):
    cfg = dict(
        nics=f"loopback:{paths}",
        transport="fault",
        fault_mover=spec,
        chunk_bytes=CHUNK,
        min_chunk_bytes=CHUNK,
        connect_timeout_s=0.5,
        max_attempts=16,  # a dropped or corrupted write costs an attempt
    )
    rx = make_agent("rx", **cfg)
    tx = make_agent("tx", **cfg)
    return rx, tx


def injected(caplog) -> dict[str, int]:
    """The faults the mover's ends say they injected (each logs its counts when freed)."""
    out = dict.fromkeys(("writes", *KINDS), 0)
    for m in FREED.finditer(caplog.text):
        out["writes"] += int(m.group(2))
        for k, v in zip(KINDS, m.groups()[2:], strict=True):
            out[k] += int(v)
    return out


def settle_faults(tx, caplog) -> dict[str, int]:
    """Ends every path (both sides' mover ends log what they injected) and returns the
    totals."""
    before = len(FREED.findall(caplog.text))
    tx.remove_peer("rx")
    assert wait_for(lambda: len(FREED.findall(caplog.text)) > before), caplog.text[-2000:]
    time.sleep(0.5)  # the other ends' records (each side's engine frees its own)
    return injected(caplog)


def test_no_faults_push_and_pull_byte_exact(make_agent, caplog):
    caplog.set_level(logging.INFO, logger="kvlink")
    rx, tx = pair(make_agent)
    dst = np.zeros(N, np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    remote = pattern(N, 2)
    rx.register(remote, remote_read=True, name="r")
    src = pattern(N, 1)
    tx.register(src)
    local = np.zeros(N, np.uint8)
    tx.register(local)  # before add_peer: named in every path's offer (pull destinations)
    tx.add_peer(rx.metadata())
    paths = tx.paths()
    assert [p.transport for p in paths] == ["fault"] * 3, [p.transport_note for p in paths]
    assert all("no faults" in p.transport_note for p in paths), paths
    tx.push("rx", src=src, dst="kv").wait(timeout_s=TIMEOUT_S)
    assert np.array_equal(src, dst)
    paths = tx.paths()
    # every byte by put, exactly once (no retry, no in-stream payload)
    assert sum(p.bytes_put for p in paths) == N, [p.bytes_put for p in paths]
    assert sum(p.bytes_sent for p in paths) == N
    tx.pull("rx", src="r", dst=local).wait(timeout_s=TIMEOUT_S)
    assert np.array_equal(local, remote)
    paths = tx.paths()
    assert sum(p.bytes_recv for p in paths) == N
    assert sum(p.bytes_put for p in paths) == 2 * N, [p.bytes_put for p in paths]
    assert "retry:" not in caplog.text
    counts = settle_faults(tx, caplog)
    assert counts["writes"] >= 2 * N // CHUNK, counts
    assert sum(counts[k] for k in KINDS) == 0, counts


FAULTS = {
    "drop": "drop=0.2,seed=1",
    "corrupt": "corrupt=0.2,seed=2",
    "dup": "dup=0.5,dup_ms=3,seed=3",
    "delay": "delay=0.5,delay_ms=15,seed=4",
    "late": f"late=0.03,late_ms={LATE_MS},seed=5",
    "all": f"drop=0.1,corrupt=0.05,dup=0.2,delay=0.3,delay_ms=10,late=0.02,late_ms={LATE_MS},"
    "seed=6",
}
# which count of injected() each spec must make non-zero
WANTED = {
    "drop": ("dropped",),
    "corrupt": ("corrupted",),
    "dup": ("duplicated",),
    "delay": ("delayed",),
    "late": ("late",),
    "all": ("dropped", "corrupted", "duplicated", "delayed", "late"),
}


@pytest.mark.parametrize("kind", list(FAULTS))
def test_faulty_writes_never_complete_wrong(make_agent, caplog, kind):
    """Many pushes and pulls, each of ~50 chunks, over writes going wrong as the spec
    says: each completes byte-exact or fails with a clear error within its timeout;
    after one completed its source is overwritten, and its destination (one per
    transfer) must not change any more, checked again once every late write was due
    (none of its writes lands late); dropped and corrupted writes are refused by the
    receiver's crc32c and retried; late writes make paths reconnect and later
    transfers still complete."""
    caplog.set_level(logging.INFO, logger="kvlink")
    rounds = 4
    rx, tx = pair(make_agent, FAULTS[kind])
    dsts = [np.zeros(N, np.uint8) for _ in range(rounds)]
    for i, d in enumerate(dsts):
        rx.register(d, remote_write=True, name=f"kv{i}")
    remote = np.zeros(N, np.uint8)
    rx.register(remote, remote_read=True, name="r")
    src = np.zeros(N, np.uint8)
    tx.register(src)
    locals_ = [np.zeros(N, np.uint8) for _ in range(rounds)]
    for d in locals_:
        tx.register(d)
    tx.add_peer(rx.metadata())
    assert all(p.transport == "fault" for p in tx.paths()), tx.paths()
    done = failed = 0
    last_ok = False
    finished: list[tuple[str, np.ndarray, np.ndarray]] = []  # (what, destination, snapshot)
    for i in range(rounds):
        for op in ("push", "pull"):
            a, b = (src, dsts[i]) if op == "push" else (remote, locals_[i])
            a[:] = pattern(N, 100 * i + (op == "pull"))
            t0 = time.monotonic()
            try:
                if op == "push":
                    t = tx.push("rx", src=src, dst=f"kv{i}", timeout_s=TIMEOUT_S)
                else:
                    t = tx.pull("rx", src="r", dst=locals_[i], timeout_s=TIMEOUT_S)
                t.wait(timeout_s=TIMEOUT_S)
            except kvlink.TransferError as exc:
                # a clear error, in time; never a hang
                assert str(exc) and time.monotonic() - t0 < TIMEOUT_S + 10, exc
                failed += 1
                last_ok = False
                continue
            assert np.array_equal(a, b), f"{op} {i} reported complete with wrong bytes"
            done += 1
            last_ok = True
            # a write of this transfer landing from now on would copy other contents
            finished.append((f"{op} {i}", b, b.copy()))
            a[:] = pattern(N, 1000 + 100 * i + (op == "pull"))
    # every write posted was due by now (late ones LATE_MS after their post)
    time.sleep(LATE_MS / 1000 + 0.5)
    for what, b, snap in finished:
        assert np.array_equal(snap, b), f"{what}: a write landed after it completed"
    retries = caplog.text.count("retry: chunk")
    crc_retries = len(re.findall(r"retry: chunk .*crc32c mismatch", caplog.text))
    reconnects = sum(p.reconnects for p in tx.paths())
    if kind in ("late", "all"):
        assert reconnects > 0, tx.paths()
        assert last_ok, "the transfers after the paths reconnected must complete"
        assert done >= 2 * rounds - 2, (done, failed)
    else:
        assert failed == 0 and done == 2 * rounds, (done, failed)
        assert reconnects == 0, tx.paths()
    if kind in ("drop", "corrupt", "all"):
        assert crc_retries > 0, retries  # refused by the receiver's crc, then retried
    if kind in ("dup", "delay"):
        assert crc_retries == 0, caplog.text[-2000:]  # slow or twice, but right
    paths = tx.paths()
    assert all(p.transport == "fault" for p in paths)
    # the core reads the mover's KVL_MV_NO_HEDGE, not its name: no copy of a chunk
    # goes onto or off these paths while another is in flight
    assert sum(p.hedges for p in paths) == 0, [p.hedges for p in paths]
    counts = settle_faults(tx, caplog)
    for k in WANTED[kind]:
        assert counts[k] > 0, (k, counts)
    others = set(KINDS) - set(WANTED[kind])
    assert all(counts[k] == 0 for k in others), counts


def test_late_write_after_cancel_fails_the_path_first(make_agent, caplog):
    """Every write late: the stream's cancel (a stalled path's chunks go elsewhere)
    waits connect_timeout_s for the writes, gives up, and fails the connection; the
    mover's free cancels the write before the memory is let go of, so the push fails
    with a clear error (every path cut, over and over) and no byte of it lands, even
    after its write was due."""
    caplog.set_level(logging.INFO, logger="kvlink")
    rx, tx = pair(make_agent, f"late=1,late_ms={LATE_MS}", paths=2)
    dst = np.zeros(N, np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = pattern(N, 9)
    tx.register(src)
    tx.add_peer(rx.metadata())
    t0 = time.monotonic()
    with pytest.raises(kvlink.TransferError) as info:
        tx.push("rx", src=src, dst="kv", timeout_s=4.0).wait(timeout_s=TIMEOUT_S)
    assert time.monotonic() - t0 < 4.0 + 10
    assert str(info.value)
    time.sleep(LATE_MS / 1000 + 0.5)  # every write was due by now
    assert not dst.any(), "a late write landed after its copy was cancelled"
    assert "the writes of a cancelled copy did not complete" in caplog.text
    assert sum(p.reconnects for p in tx.paths()) > 0


def test_offer_from_an_agent_without_fault_is_refused(make_agent):
    """A listener that does not run transport='fault' refuses the offer, saying why:
    that path runs in-stream on the same connection and still moves every byte."""
    rx = make_agent("rx", nics="loopback:2", transport="auto")
    tx = make_agent(
        "tx", nics="loopback:2", transport="fault", chunk_bytes=CHUNK, min_chunk_bytes=CHUNK
    )
    dst = np.zeros(N, np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = pattern(N, 4)
    tx.register(src)
    tx.add_peer(rx.metadata())
    for p in tx.paths():
        assert p.transport == "tcp", p
        assert "refused the fault mover" in p.transport_note, p.transport_note
        assert "transport='fault'" in p.transport_note, p.transport_note
    tx.push("rx", src=src, dst="kv").wait(timeout_s=TIMEOUT_S)
    assert np.array_equal(src, dst)
    assert sum(p.bytes_put for p in tx.paths()) == 0


def test_region_registered_after_setup_goes_by_put(make_agent):
    """A region registered after the paths' set-up is announced in MOVER_KEYS: the
    initiator's notes count it, and a push into it goes by put."""
    rx, tx = pair(make_agent, paths=2)
    rx.register(np.zeros(CHUNK, np.uint8), remote_write=True, name="early")
    tx.add_peer(rx.metadata())
    assert all(" 1 peer regions" in p.transport_note for p in tx.paths()), tx.paths()
    late = np.zeros(N, np.uint8)
    rx.register(late, remote_write=True, name="late")
    assert wait_for(lambda: all(" 2 peer regions" in p.transport_note for p in tx.paths())), [
        p.transport_note for p in tx.paths()
    ]
    src = pattern(N, 5)
    tx.register(src)
    tx.add_peer(rx.metadata())  # the new region's access key
    tx.push("rx", src=src, dst="late").wait(timeout_s=TIMEOUT_S)
    assert np.array_equal(src, late)
    assert sum(p.bytes_put for p in tx.paths()) == N


def test_fault_mover_config_is_checked():
    with pytest.raises(kvlink.ConfigError, match=r"fault_mover: .*transport='fault'"):
        kvlink.Config(nics="loopback:1", fault_mover="drop=0.1")
    with pytest.raises(kvlink.ConfigError, match=r"fault_mover: 'dorp=0\.1'.*did you mean 'drop'"):
        kvlink.Config(nics="loopback:1", transport="fault", fault_mover="dorp=0.1")
    with pytest.raises(kvlink.ConfigError, match="fault_mover: drop=2 is a rate"):
        kvlink.Config(nics="loopback:1", transport="fault", fault_mover="drop=2")
    with pytest.raises(kvlink.ConfigError, match=r"fault_mover: delay_ms=1\.5 must be whole"):
        kvlink.Config(nics="loopback:1", transport="fault", fault_mover="delay_ms=1.5")
    c = kvlink.Config(nics="loopback:1", transport="FAULT", fault_mover="drop=0.1, seed=3")
    assert c.transport == "fault"


def test_receiver_that_gives_up_fences_writes_still_posted(make_agent, caplog):
    """The bug this mover found in the receive side: a push whose END never comes
    (its sender is stuck waiting out a late write: the stream's cancel waits up to
    connect_timeout_s) fails at the receiver at its deadline (+2 s), and the
    application may reuse the memory from then on; but the sender's write was still
    posted, and landed in it a second later.  The receiver now fences every one-sided
    path from that sender before its handle reports the failure (the receiver destroys
    its end: docs/ucx.md), so the write is refused and nothing lands."""
    caplog.set_level(logging.INFO, logger="kvlink")
    late_ms = 3500  # after the receiver gives up (0.5 s + 2 s), within the sender's wait
    cfg = dict(
        nics="loopback:1",
        transport="fault",
        chunk_bytes=CHUNK,
        min_chunk_bytes=CHUNK,
        connect_timeout_s=4.0,
    )
    rx = make_agent("rx", **cfg)
    tx = make_agent("tx", fault_mover=f"late=1,late_ms={late_ms}", **cfg)
    dst = np.zeros(CHUNK, np.uint8)
    rx.register(dst, remote_write=True, name="kv")
    src = np.full(CHUNK, 7, np.uint8)
    tx.register(src)
    tx.add_peer(rx.metadata())
    t0 = time.monotonic()
    push = tx.push("rx", src=src, dst="kv", timeout_s=0.5)
    inbound = rx.inbound(timeout_s=5.0)
    with pytest.raises(kvlink.TransferError, match="passed its deadline"):
        inbound.wait(timeout_s=20.0)
    assert not dst.any()
    # from here the receiver's application owns dst again: nothing may land in it
    time.sleep(max(0.0, t0 + late_ms / 1000 + 1.0 - time.monotonic()))
    assert not dst.any(), "the sender's posted write landed after the receiver gave up"
    assert "was revoked here" in caplog.text
    with pytest.raises(kvlink.TransferError):
        push.wait(timeout_s=20.0)


def test_offer_from_another_process_is_refused(make_agent, spawn_peer):
    """A listener in another process refuses the offer, naming the pids: the fault
    mover's puts are memcpy's within one process.  The paths run in-stream and the
    push still lands, byte-exact."""
    rx = spawn_peer("rx", nics="loopback:2", transport="fault")
    rx.call("alloc", key="w", nbytes=N, remote_write=True, name="w")
    tx = make_agent(
        "tx", nics="loopback:2", transport="fault", chunk_bytes=CHUNK, min_chunk_bytes=CHUNK
    )
    tx.add_peer(rx.metadata)
    for p in tx.paths():
        assert p.transport == "tcp", p
        assert "only within one process" in p.transport_note, p.transport_note
    src = pattern(N, 8)
    tx.register(src)
    tx.push("rx", src=src, dst="w").wait(timeout_s=TIMEOUT_S)
    assert rx.call("digest", key="w")["digest"] == measure.digest(src)
    assert sum(p.bytes_put for p in tx.paths()) == 0
