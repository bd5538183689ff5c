"""SGLang's paged KV buffers as kvlink segments.

SGLang hands a transfer backend one flat buffer per KV entry (``KVArgs.kv_data_ptrs``: every
layer's K, then every layer's V, for MHA; one latent buffer per layer for MLA) and, per request
chunk, the page numbers to send. Page ``p`` of entry ``e`` is the ``item_lens[e]`` bytes at
``p * item_lens[e]``. One push carries every entry of a chunk, ordered layer by layer (kvlink's
per-layer completion wants each chunk's layers in order), with runs of pages consecutive on both
sides merged into one segment. Nothing here imports SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvlink import SEGMENT_DTYPE

IntArray = np.ndarray[Any, np.dtype[np.int64]]


def page_runs(src_pages: Any, dst_pages: Any) -> tuple[IntArray, IntArray, IntArray]:
    """(src starts, dst starts, lengths) of the runs where both page lists go up by one."""
    src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if src.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lens = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lens


def layer_order(layer_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """(entry indices sorted layer by layer, each entry's 0-based layer rank)."""
    distinct = sorted(set(layer_ids))
    rank = {layer: i for i, layer in enumerate(distinct)}
    order = sorted(range(len(layer_ids)), key=lambda e: (rank[layer_ids[e]], e))
    return order, [rank[layer] for layer in layer_ids]


def kv_segments(
    *,
    src_regions: Sequence[int],
    dst_regions: Sequence[int],
    item_lens: Sequence[int],
    layer_ids: Sequence[int],
    src_pages: Any,
    dst_pages: Any,
) -> np.ndarray[Any, Any]:
    """Segments moving pages ``src_pages[i]`` -> ``dst_pages[i]`` of every KV entry, layer-major.

    ``src_regions[e]`` / ``dst_regions[e]`` are the kvlink regions of entry ``e`` on each side
    (the destination's as the peer numbered them), ``item_lens[e]`` its page size in bytes.
    """
    s0, d0, n = page_runs(src_pages, dst_pages)
    order, ranks = layer_order(layer_ids)
    runs = n.size
    out = np.zeros(runs * len(order), dtype=SEGMENT_DTYPE)
    for i, e in enumerate(order):
        part = out[i * runs:(i + 1) * runs]
        item = int(item_lens[e])
        part["src_region"] = src_regions[e]
        part["dst_region"] = dst_regions[e]
        part["src_offset"] = s0 * item
        part["dst_offset"] = d0 * item
        part["len"] = n * item
        part["layer"] = ranks[e]
    return out


def aux_segments(
    *,
    src_regions: Sequence[int],
    dst_regions: Sequence[int],
    item_lens: Sequence[int],
    src_slot: int,
    dst_slot: int,
    layer: int,
) -> np.ndarray[Any, Any]:
    """Segments moving one request's slot of every aux (metadata) buffer, tagged ``layer``
    (the last KV layer, so that a push stays layer-major)."""
    out = np.zeros(len(src_regions), dtype=SEGMENT_DTYPE)
    for i, (src, dst, item) in enumerate(zip(src_regions, dst_regions, item_lens, strict=True)):
        out[i] = (src, src_slot * item, dst, dst_slot * item, item, layer, 0)
    return out
