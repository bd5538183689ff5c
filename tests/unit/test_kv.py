"""KV layouts to segments: checked by replaying the segments with numpy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlink
from kvlink import kv


def layout(num_layers=4, num_blocks=16, block_bytes=32, planes=2, region_base=1):
    layer_bytes = planes * num_blocks * block_bytes
    return kv.PagedLayout(
        regions=tuple(region_base + i for i in range(num_layers)),
        offsets=tuple(7 * i for i in range(num_layers)),  # odd offsets inside regions
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        planes=planes,
        plane_stride=num_blocks * block_bytes,
    ), layer_bytes


def replay(segs, src_mem, dst_mem):
    """Applies segments to dicts region -> bytearray, like a transfer would."""
    for s in segs:
        a, b, n = int(s["src_offset"]), int(s["dst_offset"]), int(s["len"])
        dst_mem[int(s["dst_region"])][b : b + n] = src_mem[int(s["src_region"])][a : a + n]


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_block_segments_move_exactly_the_requested_blocks(data):
    src, layer_bytes = layout(region_base=1)
    dst, _ = layout(region_base=100)
    n = data.draw(st.integers(1, 16))
    src_ids = data.draw(st.lists(st.integers(0, 15), min_size=n, max_size=n))
    dst_ids = data.draw(st.lists(st.integers(0, 15), min_size=n, max_size=n, unique=True))
    rng = np.random.default_rng(0)
    src_mem = {r: bytearray(rng.bytes(layer_bytes + 64)) for r in src.regions}
    dst_mem = {r: bytearray(layer_bytes + 64) for r in dst.regions}
    segs = kv.block_segments(src, dst, src_ids, dst_ids)
    replay(segs, src_mem, dst_mem)
    for li in range(4):
        s_buf = src_mem[src.regions[li]]
        d_buf = dst_mem[dst.regions[li]]
        for plane in range(2):
            for sb, db in zip(src_ids, dst_ids, strict=True):
                so = src.offsets[li] + plane * src.plane_stride + sb * 32
                do = dst.offsets[li] + plane * dst.plane_stride + db * 32
                assert d_buf[do : do + 32] == s_buf[so : so + 32]
    moved = int(segs["len"].sum())
    assert moved == 4 * 2 * n * 32
    assert list(segs["layer"]) == sorted(segs["layer"])


def test_consecutive_blocks_merge_into_one_segment():
    src, _ = layout(planes=1)
    dst, _ = layout(planes=1, region_base=50)
    segs = kv.block_segments(src, dst, [3, 4, 5, 9], [0, 1, 2, 3])
    assert len(segs) == 4 * 2  # per layer: run [3..5]->[0..2] and 9->3
    assert list(segs["len"][:2]) == [96, 32]


def test_from_tensors_matches_registered_memory(make_agent):
    a = make_agent("kvlayout")
    cache = np.zeros((3, 2, 8, 4, 16), np.float16)  # layers, K/V, blocks, heads, dim
    r = a.register(cache)
    lay = kv.PagedLayout.from_tensors(a, list(cache), planes=2)
    assert lay.regions == (r.id,) * 3
    assert lay.offsets == tuple(i * cache[0].nbytes for i in range(3))
    assert (lay.num_blocks, lay.block_bytes, lay.planes) == (8, 4 * 16 * 2, 2)
    assert kv.PagedLayout.from_dict(lay.to_dict()) == lay


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"src_blocks": [0, 1], "dst_blocks": [0]}, "dst_blocks: 1 block ids for 2"),
        ({"src_blocks": [0, 16], "dst_blocks": [0, 1]}, r"src_blocks\[1\]: block 16"),
        ({"src_blocks": [0, 1], "dst_blocks": [2, 2]}, "listed twice"),
        ({"src_blocks": [[0, 1]], "dst_blocks": [[0, 1]]}, "flat sequence"),
        ({"src_blocks": [0.5], "dst_blocks": [0]}, "integers"),
        ({"src_blocks": [], "dst_blocks": []}, "no blocks"),
        ({"src_blocks": [0], "dst_blocks": [0], "layers": [9]}, r"layers\[0\]: layer 9"),
    ],
)
def test_block_segments_rejects_bad_blocks(kwargs, match):
    src, _ = layout()
    dst, _ = layout(region_base=9)
    with pytest.raises(kvlink.InvalidArgumentError, match=match):
        kv.block_segments(src, dst, **kwargs)


def test_block_segments_rejects_mismatched_layouts():
    src, _ = layout()
    with pytest.raises(kvlink.InvalidArgumentError, match="dst: 3 layers, but src has 4"):
        kv.block_segments(src, layout(num_layers=3)[0], [0], [0])
    with pytest.raises(kvlink.InvalidArgumentError, match="dst: blocks of 64 bytes"):
        kv.block_segments(src, layout(block_bytes=64)[0], [0], [0])
    with pytest.raises(kvlink.InvalidArgumentError, match="dst: 1 planes"):
        kv.block_segments(src, layout(planes=1)[0], [0], [0])


def test_from_tensors_rejects_wrong_shapes(make_agent):
    a = make_agent("kvshape")
    cache = np.zeros((2, 2, 8, 16), np.uint8)
    a.register(cache)
    with pytest.raises(kvlink.InvalidArgumentError, match=r"layers\[1\]: shape"):
        kv.PagedLayout.from_tensors(a, [cache[0], cache[1, :, :4]])
    with pytest.raises(kvlink.InvalidArgumentError, match="planes=3"):
        kv.PagedLayout.from_tensors(a, list(cache), planes=3)
    with pytest.raises(kvlink.NotRegisteredError, match=r"layers\[0\]"):
        kv.PagedLayout.from_tensors(a, [np.zeros((2, 8, 16), np.uint8)], planes=2)
    with pytest.raises(kvlink.ArgumentTypeError, match=r"agent: expected the kvlink\.Agent"):
        kv.PagedLayout.from_tensors(None, list(cache), planes=2)
    with pytest.raises(kvlink.InvalidArgumentError, match="offsets: 1 entries for 2 layers"):
        kv.PagedLayout(regions=(1, 2), offsets=(0,), num_blocks=4, block_bytes=8)


def test_from_tensors_refuses_to_guess_planes(make_agent):
    a = make_agent("kv-planes")
    cache = np.zeros((3, 2, 8, 64), np.uint8)  # layers, K/V, blocks, bytes
    a.register(cache)
    with pytest.raises(kvlink.InvalidArgumentError, match=r"planes=2 .*planes=1"):
        kv.PagedLayout.from_tensors(a, list(cache))
    assert kv.PagedLayout.from_tensors(a, list(cache), planes=2).num_blocks == 8
    assert kv.PagedLayout.from_tensors(a, list(cache), planes=1).num_blocks == 2
    flat = np.zeros((3, 8, 64), np.uint8)  # no plane axis: nothing to guess
    a.register(flat)
    assert kv.PagedLayout.from_tensors(a, list(flat)).planes == 1


def test_from_tensors_takes_one_array_of_layers(make_agent):
    a = make_agent("kv-array")
    cache = np.zeros((3, 2, 8, 64), np.uint8)
    a.register(cache)
    assert kv.PagedLayout.from_tensors(a, cache, planes=2) == kv.PagedLayout.from_tensors(
        a, list(cache), planes=2
    )
    with pytest.raises(kvlink.InvalidArgumentError, match="layers: expected a list"):
        kv.PagedLayout.from_tensors(a, 5, planes=1)
    with pytest.raises(kvlink.InvalidArgumentError, match="at least one layer"):
        kv.PagedLayout.from_tensors(a, [], planes=1)


def test_layout_dict_names_the_missing_key():
    d, _ = layout()
    raw = d.to_dict()
    del raw["planes"]
    with pytest.raises(kvlink.InvalidArgumentError, match="missing key 'planes'"):
        kv.PagedLayout.from_dict(raw)
    with pytest.raises(kvlink.InvalidArgumentError, match="unknown key 'extra'"):
        kv.PagedLayout.from_dict({**d.to_dict(), "extra": 1})
    with pytest.raises(TypeError, match="layout: expected a dict"):
        kv.PagedLayout.from_dict([1, 2])
