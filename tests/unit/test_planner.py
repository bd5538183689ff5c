"""The C chunk planner, checked through its Python binding with hypothesis."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlink
from kvlink._native import make_plan

KiB, MiB = 1 << 10, 1 << 20


def segs_from(lengths, layers):
    arr = np.zeros(len(lengths), dtype=kvlink.SEGMENT_DTYPE)
    arr["len"] = lengths
    arr["layer"] = layers
    arr["src_offset"] = np.cumsum([0, *lengths[:-1]])
    return arr


segment_lists = st.lists(
    st.tuples(st.integers(1, 8 * MiB), st.integers(0, 40)), min_size=1, max_size=60
)


@settings(max_examples=300, deadline=None)
@given(
    segment_lists,
    st.integers(1, 8),
    st.integers(4 * KiB, 64 * MiB),
    st.integers(1, 64 * MiB),
    st.integers(1, 64),
)
def test_plan_covers_every_byte_once_in_layer_major_order(
    segs, n_paths, chunk_bytes, min_chunk, max_pieces
):
    lengths = [s[0] for s in segs]
    layers = [s[1] for s in segs]
    arr = segs_from(lengths, layers)
    chunks, pieces, target, n_layers = make_plan(arr, n_paths, chunk_bytes, min_chunk, max_pieces)

    assert n_layers == max(layers) + 1
    assert target <= chunk_bytes
    # every byte of every segment covered exactly once, in order
    covered = {i: 0 for i in range(len(segs))}
    for seg, off, length in pieces:
        assert off == covered[seg], "pieces of a segment are contiguous and in order"
        assert length > 0
        covered[seg] += length
    assert covered == dict(enumerate(lengths))
    # chunk bounds and piece accounting
    assert chunks[:, 1].sum() == len(pieces)
    for first, n, lf, ll, nbytes in chunks:
        assert 1 <= n <= max_pieces
        assert nbytes <= chunk_bytes
        own = pieces[first : first + n]
        assert own[:, 2].sum() == nbytes
        own_layers = [layers[s] for s in own[:, 0]]
        assert (lf, ll) == (min(own_layers), max(own_layers))
    # layer-major and stable inside a layer
    order = [int(s) for s in pieces[:, 0]]
    seen = list(dict.fromkeys(order))
    assert seen == sorted(range(len(segs)), key=lambda i: (layers[i], i))


PER_PATH = 32  # KVL_CHUNKS_PER_PATH in csrc/internal.h


@pytest.mark.parametrize("total,paths", [(256 * MiB, 4), (1 << 30, 4), (2 << 30, 4), (8 << 30, 2)])
def test_transfers_spread_over_paths(total, paths):
    chunks, _, target, _ = make_plan(segs_from([total], [0]), paths, 64 * MiB, MiB, 8192)
    assert target == min(64 * MiB, total // (PER_PATH * paths))
    assert len(chunks) == total // target


def test_first_layer_is_split_over_all_paths():
    # 32 layers of 32 MiB over 4 paths: layer 0 goes out as 4 chunks of 8 MiB
    chunks, _, target, _ = make_plan(
        segs_from([32 * MiB] * 32, list(range(32))), 4, 64 * MiB, MiB, 8192
    )
    assert target == 8 * MiB
    assert [c[2] for c in chunks[:4]] == [0, 0, 0, 0]


def test_floor_holds_for_tiny_transfers():
    chunks, _, target, _ = make_plan(segs_from([3 * MiB], [0]), 8, 64 * MiB, MiB, 8192)
    assert target == MiB and len(chunks) == 3


@pytest.mark.parametrize(
    "lengths,paths,chunk,match",
    [
        ([0], 1, MiB, r"segments\[0\]: length is 0"),
        ([10], 0, MiB, "n_paths"),
        ([10], 1, 0, "chunk_bytes"),
    ],
)
def test_planner_rejects_bad_input(lengths, paths, chunk, match):
    with pytest.raises(kvlink.InvalidArgumentError, match=match):
        make_plan(segs_from(lengths, [0] * len(lengths)), paths, chunk, 1, 16)
