"""kvlink.store: a KV block store with tiers (host memory, a local disk, other hosts).

Blocks are keyed by content (:func:`block_keys`: the engine's prefix-chained block
hash plus the model and layout identity), laid out page-first (every layer of a block
contiguous: one block is one I/O and one transfer) and checked against their crc32c
on every tier before they are served.  docs/store.md is the guide.

Example::

    store = kvlink.store.Store(agent, StoreConfig(block_bytes=..., host_bytes=8 << 30,
                                                  disk_path="/nvme/kvstore", disk_bytes=1 << 40))
    keys = kvlink.store.block_keys("llama-3-8b/bf16/paged32", tokens, block_tokens=32)
    store.put(keys, layout, block_ids)                  # after prefill
    hit = store.lookup(keys).hits                       # a later request
    load = store.get(keys[:hit], layout, new_block_ids)
    load.wait_layer(0)                                  # decode may start on layer 0
    load.wait(); recompute(load.failed)
"""

from ._store import (
    Load,
    Lookup,
    Prefetch,
    PrefetchPolicy,
    Store,
    StoreConfig,
    StoreError,
    StoreFullError,
    StoreStats,
    StoreTimeoutError,
    Tier,
    block_keys,
)

__all__ = [
    "Load",
    "Lookup",
    "Prefetch",
    "PrefetchPolicy",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreFullError",
    "StoreStats",
    "StoreTimeoutError",
    "Tier",
    "block_keys",
]
