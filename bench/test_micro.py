"""Micro-benchmarks: the chunk planner, crc32c and the cost of one more chunk.

Run (not part of ``make test``; pyproject's testpaths is tests/), about 15 s::

    .venv/bin/python -m pytest bench/test_micro.py --benchmark-only

Add ``--benchmark-json out.json`` to keep every figure, ``extra_info`` included.
The derived figures (crc32c GB/s, per-chunk overhead in microseconds) are also
printed after the table, under "kvlink micro-benchmark summary" (bench/conftest.py).

Groups:
  planner    kvl_plan_make on a 1 GiB segment and on a paged KV transfer of
             65,152 segments, and kv.block_segments building those segments.
  crc32c     kvl_crc32c on 4 KiB, 512 KiB (cached) and 64 MiB (DRAM) buffers.
  per-chunk  a 64 MiB push between two in-process agents over loopback:1 cut
             into 1, 16, 64 and 256 chunks, one row each; then
             test_per_chunk_overhead pushes the four interleaved and derives
             the per-chunk cost (t(N) - t(1)) / (N - 1) and (t(256) - t(16)) / 240
             as paired medians, in wall and in CPU time.

GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

import numpy as np
import pytest

import kvlink
from kvlink import kv
from kvlink._native import check, ffi, lib, make_plan

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
Array = np.ndarray[Any, Any]

MAX_PIECES = 8192  # KVL_MAX_PIECES in csrc/internal.h: what the engine passes
PATHS = 4

# The paged case: 32 layers x 2 planes (K, V) of 4096 blocks of 32 KiB; 2000
# scattered prefill blocks go to a fresh, contiguous run of decode blocks.
LAYERS, BLOCKS, BLOCK_BYTES, MOVED = 32, 4096, 32 * KiB, 2000


def _stats(benchmark: Any) -> Any | None:
    """The timing statistics of a finished benchmark (None under --benchmark-disable)."""
    meta = getattr(benchmark, "stats", None)
    return None if meta is None else meta.stats


def _plan_c(segs: Array, n_paths: int, chunk: int, min_chunk: int) -> None:
    """kvl_plan_make + kvl_plan_free, as the engine calls them at submit (no
    copying of the plan into numpy, which make_plan does for tests)."""
    plan = ffi.new("kvl_plan *")
    rc = lib.kvl_plan_make(
        ffi.cast("const kvl_segment *", segs.ctypes.data),
        len(segs),
        n_paths,
        chunk,
        min_chunk,
        MAX_PIECES,
        plan,
    )
    lib.kvl_plan_free(plan)
    check(rc)


def _paged_case() -> tuple[kv.PagedLayout, kv.PagedLayout, Array, Array]:
    """(src layout, dst layout, src block ids, dst block ids) of the paged case."""
    layer_bytes = 2 * BLOCKS * BLOCK_BYTES
    src = kv.PagedLayout(
        regions=(1,) * LAYERS,
        offsets=tuple(i * layer_bytes for i in range(LAYERS)),
        num_blocks=BLOCKS,
        block_bytes=BLOCK_BYTES,
        planes=2,
    )
    dst = kv.PagedLayout(
        regions=(7,) * LAYERS,
        offsets=tuple(i * layer_bytes for i in range(LAYERS)),
        num_blocks=BLOCKS,
        block_bytes=BLOCK_BYTES,
        planes=2,
    )
    rng = np.random.default_rng(0)  # fixed, so every run plans the same segments
    src_blocks = np.sort(rng.choice(BLOCKS, MOVED, replace=False))
    dst_blocks = np.arange(MOVED)
    return src, dst, src_blocks, dst_blocks


# ---- planner -------------------------------------------------------------


@pytest.mark.benchmark(group="planner", max_time=0.5)
def test_plan_1gib_one_segment(benchmark: Any, bench_report: list[str]) -> None:
    """kvl_plan_make for one 1 GiB segment over 4 paths (128 chunks of 8 MiB).

    The planner runs on the submitting thread before the first byte moves, so
    its time adds straight to time-to-first-byte of every push; this is the
    common case of a contiguous buffer and should be a few microseconds.
    """
    segs = np.zeros(1, dtype=kvlink.SEGMENT_DTYPE)
    segs["src_region"], segs["dst_region"], segs["len"] = 1, 1, GiB
    chunks, pieces, target, _ = make_plan(segs, PATHS, 64 * MiB, MiB, MAX_PIECES)
    assert len(chunks) == 128 and target == 8 * MiB

    benchmark(_plan_c, segs, PATHS, 64 * MiB, MiB)
    benchmark.extra_info.update(segments=1, chunks=len(chunks), pieces=len(pieces))
    st = _stats(benchmark)
    if st is not None:
        bench_report.append(f"planner, 1 GiB / 1 segment:        {st.median * 1e6:9.1f} us median")


@pytest.mark.benchmark(group="planner", max_time=0.5)
def test_plan_paged_kv(benchmark: Any, bench_report: list[str]) -> None:
    """kvl_plan_make for a paged KV transfer: 32 layers x 2 planes x 2000
    scattered 32 KiB blocks (3.9 GiB, 65,152 segments after merging runs) over
    4 paths.

    This is the shape a vLLM-style prefill -> decode handoff submits: tens of
    thousands of small segments.  The planner sorts them layer-major and packs
    them into chunks; it must stay well under a millisecond per 1000 blocks so
    it never shows next to the transfer itself (~1 s for 3.9 GiB at 4 GB/s).
    """
    src, dst, sb, db = _paged_case()
    segs = kv.block_segments(src, dst, sb, db)
    chunks, pieces, target, n_layers = make_plan(segs, PATHS, 64 * MiB, MiB, MAX_PIECES)
    assert n_layers == LAYERS and int(segs["len"].sum()) == LAYERS * 2 * MOVED * BLOCK_BYTES

    benchmark(_plan_c, segs, PATHS, 64 * MiB, MiB)
    benchmark.extra_info.update(
        segments=len(segs), chunks=len(chunks), pieces=len(pieces), chunk_target=target
    )
    st = _stats(benchmark)
    if st is not None:
        bench_report.append(
            f"planner, paged KV / {len(segs)} segments: {st.median * 1e6:9.1f} us median "
            f"({st.median * 1e9 / len(segs):.1f} ns per segment; {len(chunks)} chunks, "
            f"{len(pieces)} pieces)"
        )


@pytest.mark.benchmark(group="planner", max_time=0.5)
def test_block_segments_paged_kv(benchmark: Any, bench_report: list[str]) -> None:
    """kv.block_segments for the same paged case: 2000 block ids -> 65,152
    segments (numpy, vectorised).

    The caller pays this before kvl_plan_make on every KV handoff, so the two
    together are the host-side cost of turning a block table into a transfer.
    """
    src, dst, sb, db = _paged_case()
    segs = benchmark(kv.block_segments, src, dst, sb, db)
    assert len(segs) == LAYERS * 2 * (np.count_nonzero(np.diff(sb) != 1) + 1)
    benchmark.extra_info.update(blocks=MOVED, segments=len(segs))
    st = _stats(benchmark)
    if st is not None:
        bench_report.append(f"kv.block_segments, paged KV:      {st.median * 1e6:9.1f} us median")


# ---- crc32c --------------------------------------------------------------


@pytest.mark.benchmark(group="crc32c", max_time=0.5)
@pytest.mark.parametrize(
    "nbytes", [4 * KiB, 512 * KiB, 64 * MiB], ids=["4KiB", "512KiB-cached", "64MiB-dram"]
)
def test_crc32c(benchmark: Any, bench_report: list[str], nbytes: int) -> None:
    """kvl_crc32c throughput, called through cffi on one buffer over and over.

    Every payload byte is checksummed once on each side, so crc32c GB/s bounds
    what one engine thread can verify.  512 KiB is the engine's I/O batch
    (IO_BATCH in csrc/conn.c: the crc pass runs while it is still in L2);
    64 MiB is twice the L3 and streams from DRAM.  At 4 KiB the cffi call
    (a few hundred ns) dominates: that is the floor for a Python caller, not
    for the engine, which calls it from C.
    """
    assert lib.kvl_crc32c(0, b"123456789", 9) == 0xE3069283  # the Castagnoli check value
    buf = (np.arange(nbytes, dtype=np.uint32) * 2654435761).astype(np.uint8)
    ptr = ffi.from_buffer(buf)

    benchmark(lib.kvl_crc32c, 0, ptr, nbytes)
    hw = bool(lib.kvl_crc32c_hw())
    benchmark.extra_info.update(nbytes=nbytes, hw=hw)
    st = _stats(benchmark)
    if st is not None:
        bps = nbytes / st.median
        benchmark.extra_info["bytes_per_s"] = bps
        benchmark.extra_info["GB/s"] = round(bps / 1e9, 2)
        bench_report.append(
            f"crc32c {nbytes // KiB:>6} KiB: {bps / 1e9:6.2f} GB/s median "
            f"({'hardware' if hw else 'table'})"
        )


# ---- per-chunk overhead --------------------------------------------------

PUSH_BYTES = 64 * MiB
CHUNKS = {1: 64 * MiB, 16: 4 * MiB, 64: 1 * MiB, 256: 256 * KiB}  # chunks -> chunk_bytes


class Pair:
    """tx and rx agents over loopback:1 cutting pushes into ``chunk_bytes``
    chunks (chunk_bytes = min_chunk_bytes, so the planner cannot change the
    count), a 64 MiB registered source and a 64 MiB destination "kv" on rx."""

    def __init__(self, stack: ExitStack, chunk_bytes: int) -> None:
        cfg = kvlink.Config(nics="loopback:1", chunk_bytes=chunk_bytes, min_chunk_bytes=chunk_bytes)
        n = PUSH_BYTES // chunk_bytes
        self.tx = stack.enter_context(kvlink.Agent(f"tx-{n}", cfg))
        rx = stack.enter_context(kvlink.Agent(f"rx-{n}", cfg))
        self.src = (np.arange(PUSH_BYTES, dtype=np.uint32) * 2654435761).astype(np.uint8)
        self.dst = np.zeros(PUSH_BYTES, dtype=np.uint8)
        self.tx.register(self.src)
        rx.register(self.dst, remote_write=True, name="kv")
        self.peer = self.tx.add_peer(rx.metadata())
        self.chunks = n
        self.last: kvlink.Transfer | None = None

    def push(self) -> tuple[float, float]:
        """One push, waited for; (wall s, CPU s of this process, both agents' threads)."""
        c0, t0 = time.process_time(), time.perf_counter()
        self.last = self.tx.push(self.peer, src=self.src, dst="kv").wait(10)
        return time.perf_counter() - t0, time.process_time() - c0

    def check(self) -> None:
        """The last push moved every byte, in the expected number of chunks, first try."""
        assert self.last is not None
        info = self.last.info()
        assert info.state == kvlink.TransferState.DONE and info.retries == 0
        assert info.chunks_total == self.chunks
        assert np.array_equal(self.src, self.dst)


@pytest.mark.benchmark(group="per-chunk")
@pytest.mark.parametrize("n_chunks", list(CHUNKS), ids=[f"{n}chunks" for n in CHUNKS])
def test_push_64mib(benchmark: Any, bench_report: list[str], n_chunks: int) -> None:
    """One 64 MiB push over loopback:1 cut into 1, 16, 64 or 256 chunks
    (chunk_bytes 64 MiB, 4 MiB, 1 MiB, 256 KiB); 2 warm-up pushes, 20 timed.

    One row per chunk count, wall time, with the CPU per push (both agents)
    in extra_info.  The per-chunk cost is derived from these rows only in
    test_per_chunk_overhead, which interleaves the four: run one after the
    other, minutes apart in a noisy machine, the rows differ by more than
    255 chunks cost.
    """
    with ExitStack() as stack:
        pair = Pair(stack, CHUNKS[n_chunks])
        cpu: list[float] = []
        benchmark.pedantic(lambda: cpu.append(pair.push()[1]), rounds=20, warmup_rounds=2)
        pair.check()
    st = _stats(benchmark)
    if st is not None:  # None under --benchmark-disable (one push, no warm-up)
        cpu_ms = float(np.median(cpu[2:])) * 1e3
        benchmark.extra_info.update(chunks=n_chunks, chunk_bytes=CHUNKS[n_chunks], cpu_ms=cpu_ms)
        bench_report.append(
            f"push 64 MiB in {n_chunks:>3} chunks: {st.median * 1e3:6.2f} ms median "
            f"({PUSH_BYTES / st.median / 1e9:4.2f} GB/s), {st.min * 1e3:6.2f} ms min, "
            f"CPU {cpu_ms:5.2f} ms"
        )


@pytest.mark.benchmark(group="per-chunk")
def test_per_chunk_overhead(benchmark: Any, bench_report: list[str]) -> None:
    """What one more chunk costs: (t(N) - t(1)) / (N - 1), N = 16, 64, 256,
    and (t(256) - t(16)) / 240.

    Each chunk costs a header, a crc32c trailer, a receiver-side verify, an
    acknowledgement and scheduler work on both engines; the bytes are the same
    in every case.  This figure decides how small chunk_bytes and
    min_chunk_bytes can go (docs/BENCHMARKS.md, "Chunk size and the
    small-transfer floor").

    One round pushes 64 MiB once with each of the four chunk sizes (four
    agent pairs, kept open), in an order that rotates every round, so slow
    drift of the machine hits all four alike; the figure is the median over
    rounds of each round's own difference.  The table's row is one round
    (four pushes).  Wall time is what a caller sees; CPU time (both agents'
    threads, this process) is what the chunks cost the host, and is far less
    noisy on a shared machine.  30 rounds after 2 warm-up rounds.

    On loopback one 64 MiB chunk has been ~1 ms slower than 16 chunks of
    4 MiB, which biases the 1 -> N figures low (negative for N = 16);
    16 -> 256 is the cleaner marginal cost.
    """
    rounds, warmup = 30, 2
    with ExitStack() as stack:
        pairs = [Pair(stack, CHUNKS[n]) for n in CHUNKS]
        results: list[dict[int, tuple[float, float]]] = []

        def one_round() -> None:
            k = len(results) % len(pairs)
            order = pairs[k:] + pairs[:k]
            results.append({p.chunks: p.push() for p in order})

        benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=warmup)
        for p in pairs:
            p.check()

    if _stats(benchmark) is None:  # --benchmark-disable: one push each, nothing to derive
        return
    timed = results[warmup:]
    for a, b in ((1, 16), (1, 64), (1, 256), (16, 256)):
        wall = float(np.median([(r[b][0] - r[a][0]) / (b - a) for r in timed])) * 1e6
        cpu = float(np.median([(r[b][1] - r[a][1]) / (b - a) for r in timed])) * 1e6
        benchmark.extra_info[f"per_chunk_us_wall_{a}_{b}"] = round(wall, 2)
        benchmark.extra_info[f"per_chunk_us_cpu_{a}_{b}"] = round(cpu, 2)
        bench_report.append(
            f"per extra chunk, {a:>2} -> {b:>3} chunks (paired median of {len(timed)} rounds): "
            f"wall {wall:6.1f} us, CPU {cpu:6.1f} us"
        )
    for n in CHUNKS:
        wall_ms = float(np.median([r[n][0] for r in timed])) * 1e3
        cpu_ms = float(np.median([r[n][1] for r in timed])) * 1e3
        bench_report.append(
            f"  interleaved push in {n:>3} chunks: {wall_ms:6.2f} ms wall "
            f"({PUSH_BYTES / wall_ms / 1e6:4.2f} GB/s), CPU {cpu_ms:5.2f} ms (median)"
        )


# ---- the receiver's handle: polling cost --------------------------------------------------


@pytest.fixture(scope="module")
def inbound_handles() -> Any:
    """300 finished pushes (4 layers of 64 KiB each) and their receiver-side handles."""
    with ExitStack() as stack:
        rx = stack.enter_context(kvlink.Agent("micro-inbound-rx", nics="loopback:1"))
        tx = stack.enter_context(kvlink.Agent("micro-inbound-tx", nics="loopback:1"))
        dst = np.zeros(4 * 64 * KiB, np.uint8)
        src = np.ones_like(dst)
        rid = rx.register(dst, remote_write=True).id
        sid = tx.register(src).id
        tx.add_peer(rx.metadata())
        segs = [kvlink.Segment(sid, i * 64 * KiB, rid, i * 64 * KiB, 64 * KiB, i) for i in range(4)]
        handles = []
        for i in range(300):
            tx.push(rx.name, segments=segs, notify=b"r%d" % i).wait(timeout_s=10)
            handles.append(rx.inbound(b"r%d" % i, timeout_s=10))
        yield handles


@pytest.mark.benchmark(group="inbound")
def test_inbound_poll_300_handles(
    benchmark: Any, inbound_handles: Any, bench_report: list[str]
) -> None:
    """One engine step's worth of polling: ``done`` and ``layers_done()`` of 300
    inbound pushes, as a serving engine would check them every step."""

    def poll() -> int:
        return sum(h.layers_done() for h in inbound_handles if h.done)

    assert benchmark(poll) == 4 * len(inbound_handles)
    stats = _stats(benchmark)
    if stats is not None:
        us = stats.median * 1e6
        benchmark.extra_info["poll_300_handles_us"] = round(us, 1)
        bench_report.append(
            f"inbound: done + layers_done() of 300 handles: {us:6.1f} us "
            f"({us / 300 * 1e3:5.0f} ns per handle, median)"
        )


# ---- the handshake: what authentication costs -------------------------------------------


@pytest.mark.benchmark(group="handshake")
def test_handshake_with_and_without_secret(benchmark: Any, bench_report: list[str]) -> None:
    """``add_peer`` of a loopback:4 peer (a control connection and 4 data paths, connected
    at once) between agents without a secret and between agents sharing one (the
    HMAC-SHA256 challenge-response adds a round trip per connection).  Rounds alternate the
    two pairs, so the machine's drift hits both alike; each round removes the peer again.
    The figure is the ratio of the medians (docs/BENCHMARKS.md, security)."""
    rounds, warmup = 40, 3
    secret = "micro-benchmark-secret-0123456789"
    with ExitStack() as stack:
        pairs = {}
        for auth in (False, True):
            cfg = kvlink.Config(nics="loopback:4", secret=secret if auth else None)
            rx = stack.enter_context(kvlink.Agent(f"micro-hs-rx-{auth:d}", cfg))
            tx = stack.enter_context(kvlink.Agent(f"micro-hs-tx-{auth:d}", cfg))
            pairs[auth] = (tx, rx.name, rx.metadata())
        times: dict[bool, list[float]] = {False: [], True: []}

        def one_round() -> None:
            for auth in (len(times[True]) % 2 == 0, len(times[True]) % 2 == 1):
                tx, name, md = pairs[auth]
                t0 = time.perf_counter()
                tx.add_peer(md)
                times[auth].append(time.perf_counter() - t0)
                tx.remove_peer(name)
            time.sleep(0.02)  # the removed connections close before the next round

        benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=warmup)
    plain = float(np.median(times[False][warmup:])) * 1e3
    authed = float(np.median(times[True][warmup:])) * 1e3
    benchmark.extra_info.update(
        add_peer_ms_plain=round(plain, 3), add_peer_ms_secret=round(authed, 3)
    )
    bench_report.append(
        f"add_peer, loopback:4 (5 connections), median of {rounds} alternating rounds: "
        f"no secret {plain:.2f} ms, with a secret {authed:.2f} ms ({authed / plain:.2f}x)"
    )
