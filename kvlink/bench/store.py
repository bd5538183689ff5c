"""``kvlink-bench store``: kvlink.store's tiers against the machine's own limits, in one run.

- disk write / read: ``size`` bytes of blocks moved from the host tier down to the disk tier
  (write-back of every block) and read back up (a prefetch of every block, each checked
  against its crc32c), against ``fio`` on the same directory (O_DIRECT, 1 MiB, iodepth 32,
  io_uring), run in between;
- host tier into an engine layout: a load of ``size`` bytes of blocks from the host tier into
  per-layer tensors (every block checked), against one ``memcpy`` of the same bytes;
- latency: a lookup of 64 keys and a load of one block and of 64 blocks from the host tier.

Rows are JSON objects as ``kvlink-bench table`` reads them (scenario, ratio, baseline, ...).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import _native

MiB = 1 << 20


def fio_gbps(directory: Path, size: int, rw: str) -> tuple[float, str]:
    """fio's throughput (GB/s) writing or reading ``size`` bytes in ``directory`` with O_DIRECT,
    1 MiB blocks, iodepth 32 on io_uring; and the command, for the record."""
    f = directory / "fio.dat"
    cmd = [
        "fio", "--name=kvlink-baseline", f"--filename={f}", f"--size={size}", "--bs=1M",
        "--iodepth=32", "--direct=1", "--ioengine=io_uring", f"--rw={rw}",
        "--output-format=json", "--group_reporting",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    job = json.loads(out.stdout)["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return side["bw_bytes"] / 1e9, " ".join(cmd[:1] + [c for c in cmd[1:] if "filename" not in c])


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(
    directory: str | None,
    size: int,
    block_bytes: int,
    layers: int,
    iters: int,
    progress: Callable[[str], None] = lambda s: None,
) -> Iterator[dict[str, Any]]:
    import kvlink
    from kvlink import kv
    from kvlink.store import PrefetchPolicy, Store, StoreConfig, block_keys
    from kvlink.store._format import slot_bytes

    if block_bytes % layers:
        raise ValueError(f"--block {block_bytes} is not a multiple of --layers {layers}")
    n = max(1, size // block_bytes)
    nbytes = n * block_bytes
    slot = slot_bytes(block_bytes)
    tmp = Path(tempfile.mkdtemp(prefix="kvlink-bench-store-", dir=directory))
    agent = kvlink.Agent("bench-store", kvlink.Config(nics=("127.0.0.1",)))
    try:
        # an engine's paged cache: one tensor per layer, [blocks, bytes of a layer's block]
        piece = block_bytes // layers
        engine = [np.zeros((n, piece), np.uint8) for _ in range(layers)]
        src = [
            np.random.default_rng(i).integers(0, 256, (n, piece), np.uint8) for i in range(layers)
        ]
        for i, t in enumerate(engine):
            agent.register(t, name=f"dst{i}")
        for i, t in enumerate(src):
            agent.register(t, name=f"src{i}")
        dst_layout = kv.PagedLayout.from_tensors(agent, engine)
        src_layout = kv.PagedLayout.from_tensors(agent, src)
        keys = block_keys("bench", list(range(n * 16)), 16)
        st = Store(
            agent,
            StoreConfig(
                block_bytes=block_bytes,
                host_bytes=(2 * n + 4) * slot,
                disk_path=str(tmp / "store"),
                disk_bytes=(n + 2) * slot,
                high_watermark=1.0,
                low_watermark=0.99,
                remote=False,
                io_depth=32,
            ),
        )  # fio's depth
        backend = st.stats().io_backend
        try:
            st.put(keys, src_layout, range(n))
            w_s: list[float] = []
            r_s: list[float] = []
            h_s: list[float] = []
            m_s: list[float] = []
            fw: list[float] = []
            fr: list[float] = []
            flat_src = np.concatenate([s.reshape(-1) for s in src])
            flat_dst = np.zeros_like(flat_src)
            flat_dst[:] = 1  # faulted in before it is timed
            for it in range(iters):
                progress(f"store: round {it + 1}/{iters}")
                # write-back of every block (the host copies stay: only the disk moves)
                w_s.append(_rewrite(st))
                # read back: drop the host copies, prefetch everything up again
                _drop_host(st)
                pf = st.prefetch(keys, policy=PrefetchPolicy.WAIT)
                r_s.append(_timed(pf.wait))
                pf.release()
                if pf.ready() != n:
                    raise RuntimeError(f"prefetch brought up {pf.ready()} of {n} blocks")
                # fio between the store's runs, on the same file system
                gb, fio_cmd = fio_gbps(tmp, nbytes, "write")
                fw.append(gb)
                gb, _ = fio_gbps(tmp, nbytes, "read")
                fr.append(gb)
                (tmp / "fio.dat").unlink(missing_ok=True)
                # host tier into the engine's layout, against one memcpy of as many bytes
                _put_all(st, keys, src_layout, n)
                ld = st.get(keys, dst_layout, range(n))
                h_s.append(_timed(ld.wait))
                if not ld.ok:
                    raise RuntimeError(f"load failed: {ld.reasons}")
                m_s.append(_timed(lambda: _memcpy(flat_dst, flat_src, st.config.copy_threads)))
            for layer in (0, layers - 1):
                if not np.array_equal(engine[layer], src[layer]):
                    raise RuntimeError(f"layer {layer} differs after the load")

            # each round's figure over the same round's baseline (this VM's memory and disk
            # speeds drift between rounds), then the median of those ratios
            def ratios(moved: int, ours: list[float], base_gbps: list[float]) -> list[float]:
                return [moved / t / 1e9 / b for t, b in zip(ours, base_gbps, strict=True)]

            memcpy_gbps = [nbytes / t / 1e9 for t in m_s]
            rows: list[tuple[str, list[float], float, float, str]] = [
                (
                    "Store disk tier write-back, 1 MiB blocks",
                    ratios(n * slot, w_s, fw),
                    n * slot / statistics.median(w_s) / 1e9,
                    statistics.median(fw),
                    "fio O_DIRECT 1 MiB iodepth 32 write, same directory, same round",
                ),
                (
                    "Store disk tier read-up (prefetch, crc32c checked), 1 MiB blocks",
                    ratios(n * slot, r_s, fr),
                    n * slot / statistics.median(r_s) / 1e9,
                    statistics.median(fr),
                    "fio O_DIRECT 1 MiB iodepth 32 read, same directory, same round",
                ),
                (
                    "Store host tier into an engine layout (crc32c checked)",
                    ratios(nbytes, h_s, memcpy_gbps),
                    nbytes / statistics.median(h_s) / 1e9,
                    statistics.median(memcpy_gbps),
                    f"memcpy of the same bytes, contiguous, on as many threads "
                    f"({st.config.copy_threads}), same round",
                ),
            ]
            for name, rs, gbps, base, what in rows:
                ratio = statistics.median(rs)
                yield {
                    "scenario": f"{name}, {nbytes >> 20} MiB, {layers} layers",
                    "section": "store", "ratio": round(ratio, 3),
                    "detail": f"{gbps:.2f} vs {base:.2f} GB/s (medians of {iters}; rounds "
                    + ", ".join(f"{r:.2f}" for r in rs) + f"; {backend})",
                    "baseline": what, "target": ">= 0.8", "met": ratio >= 0.8,
                    "gbps": round(gbps, 3), "limit_gbps": round(base, 3),
                }  # fmt: skip
            # latency: lookups and small loads from the host tier
            look = [_timed(lambda: st.lookup(keys[:64])) for _ in range(200)]
            one = []
            many = []
            for _ in range(50):
                one.append(_timed(lambda: st.get(keys[:1], dst_layout, [0]).wait()))
                many.append(_timed(lambda: st.get(keys[:64], dst_layout, range(min(64, n))).wait()))
            yield {"scenario": "Store latency, host tier", "section": "store",
                   "lookup_64_us": round(statistics.median(look) * 1e6, 1),
                   "load_1_block_us": round(statistics.median(one) * 1e6, 1),
                   "load_64_blocks_ms": round(statistics.median(many) * 1e3, 3),
                   "block_bytes": block_bytes, "fio": fio_cmd}  # fmt: skip
        finally:
            st.close()
    finally:
        agent.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _memcpy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], threads: int) -> None:
    """One memcpy of ``src`` into ``dst`` (the C core's, streaming), split over as many
    threads as the store copies with."""
    from concurrent.futures import ThreadPoolExecutor

    d, s, n = dst.__array_interface__["data"][0], src.__array_interface__["data"][0], src.size
    parts = [(i * n // threads, (i + 1) * n // threads) for i in range(threads)]
    with ThreadPoolExecutor(threads) as ex:
        for f in [ex.submit(_native.copy_batch, np.array([d + lo]), np.array([s + lo]),
                            np.array([hi - lo])) for lo, hi in parts]:  # fmt: skip
            f.result()


def _rewrite(st: Any) -> float:
    """Seconds to write every block of the host tier down again (forgetting the disk copies
    first, so every one is written)."""
    with st._mu:
        for e in st._index.values():
            if e.disk is not None:
                st.disk.free.append(e.disk)
                st._disk_lru.remove(e.key, evicted=False)
                e.disk = None
    return _timed(st._write_back_all)


def _drop_host(st: Any) -> None:
    with st._mu:
        for e in list(st._index.values()):
            if e.host is not None and e.disk is not None:
                st._drop_host(e, evicted=False)


def _put_all(st: Any, keys: list[bytes], layout: Any, n: int) -> None:
    st.delete(keys)
    st.put(keys, layout, range(n))
