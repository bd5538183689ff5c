"""kvlink.store puts: 512 blocks of 1 MiB (32 layers of 32 KiB) from an engine layout into
the host tier, each block copied and checksummed; five rounds, GB/s per round and median.

    .venv/bin/python bench/store_put.py

Run it on two trees (A/B) in the same minutes: this VM's memory speed drifts between runs.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvlink
from kvlink import kv
from kvlink.store import Store, StoreConfig, block_keys
from kvlink.store._format import slot_bytes


def main() -> int:
    layers, n, piece = 32, 512, 32768
    block = layers * piece
    a = kvlink.Agent("bench-put", kvlink.Config(nics=("127.0.0.1",)))
    src = [np.random.default_rng(i).integers(0, 256, (n, piece), np.uint8) for i in range(layers)]
    for i, t in enumerate(src):
        a.register(t, name=f"s{i}")
    layout = kv.PagedLayout.from_tensors(a, src)
    cfg = StoreConfig(block_bytes=block, host_bytes=(4 * n + 8) * slot_bytes(block), remote=False,
                      high_watermark=1.0, low_watermark=0.99)  # fmt: skip
    st = Store(a, cfg)
    rates = []
    for r in range(5):
        keys = block_keys(f"round{r}", list(range(n * 16)), 16)
        t = time.perf_counter()
        st.put(keys, layout, range(n))
        rates.append(n * block / (time.perf_counter() - t) / 1e9)
        st.delete(keys)
    rounds = ", ".join(f"{x:.2f}" for x in rates)
    print(f"put {statistics.median(rates):.2f} GB/s (rounds {rounds})")
    st.close()
    a.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
