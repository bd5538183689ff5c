"""The SGLang backend's side-channel frames, notification tags and page segments (no SGLang
needed: kvlink.integrations.sglang._messages and _pages import only numpy and kvlink)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kvlink import SEGMENT_DTYPE
from kvlink.integrations.sglang import _messages as m
from kvlink.integrations.sglang._pages import aux_segments, kv_segments, layer_order, page_runs


def registration(**changes: object) -> m.Registration:
    base = m.Registration(
        session="sglang-d-10.0.0.2-5000", endpoint="10.0.0.2", port=5000,
        metadata='{"kvlink": 1}', kv_regions=[1, 2, 3, 4], kv_item_lens=[512] * 4,
        kv_pages=[128] * 4, aux_regions=[5], aux_item_lens=[64], aux_slots=[8], tp_rank=0,
        attn_tp_size=1, is_mla=False, page_size=1)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_registration_round_trips() -> None:
    reg = registration()
    assert m.decode_registration(m.encode_registration(reg)) == reg


@pytest.mark.parametrize(("field", "value", "says"), [
    ("v", 2, "protocol version"),
    ("port", 0, "port"),
    ("port", "5000", "port"),
    ("session", "x" * 64, "session"),
    ("kv_regions", [1] * (m.MAX_BUFFERS + 1), "kv_regions"),
    ("kv_item_lens", [512, -1, 512, 512], r"kv_item_lens\[1\]"),
    ("kv_pages", [128] * 3, "differ in length"),
    ("aux_slots", [True], r"aux_slots\[0\]"),
    ("tp_rank", None, "tp_rank"),
])
def test_bad_registrations_name_the_field(field: str, value: object, says: str) -> None:
    d = json.loads(m.encode_registration(registration())[1])
    d[field] = value
    with pytest.raises(m.MessageError, match=says):
        m.decode_registration([m.REG_TAG, json.dumps(d).encode()])


@pytest.mark.parametrize("frames", [
    [m.REG_TAG],
    [b"OTHER", b"{}"],
    [m.REG_TAG, b"[1, 2]"],
    [m.REG_TAG, b"\xff\xfe"],
    [m.REG_TAG, b" " * (m.MAX_REG_BYTES + 1)],
])
def test_malformed_registration_frames(frames: list[bytes]) -> None:
    with pytest.raises(m.MessageError):
        m.decode_registration(frames)


def room(**changes: object) -> m.RoomInfo:
    base = m.RoomInfo(room=2**63 + 5, attempt=2**32 - 1, session="d", endpoint="10.0.0.2",
                      port=7,
                      dst_pages=np.array([3, 4, 9], np.int32), aux_index=2,
                      required_dst_info_num=1, is_dummy=False)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_room_round_trips() -> None:
    got = m.decode_room(m.encode_room(room()))
    assert got.room == 2**63 + 5 and got.dst_port == 7 and got.aux_index == 2
    assert got.attempt == 2**32 - 1
    assert got.dst_pages.tolist() == [3, 4, 9]
    dummy = m.decode_room(m.encode_room(room(is_dummy=True)))
    assert dummy.is_dummy and dummy.dst_pages.size == 0


@pytest.mark.parametrize(("index", "value", "says"), [
    (1, b"-3", "room"),
    (1, str(2**64).encode(), "room"),
    (2, str(2**32).encode(), "attempt"),
    (5, b"65536", "port"),
    (6, b"\x00" * 5, "int32"),
    (6, np.array([1, -1], "<i4").tobytes(), "negative"),
    (3, b"\xff", "UTF-8"),
    (3, b"", "session"),
    (8, b"0", "required_dst_info_num"),
    (7, b"1e3", "aux_index"),
])
def test_bad_rooms_name_the_field(index: int, value: bytes, says: str) -> None:
    frames = m.encode_room(room())
    frames[index] = value
    with pytest.raises(m.MessageError, match=says):
        m.decode_room(frames)


def test_room_page_count_is_bounded() -> None:
    frames = m.encode_room(room())
    frames[6] = b"\x00" * 4 * (m.MAX_PAGES + 1)
    with pytest.raises(m.MessageError, match="at most"):
        m.decode_room(frames)


def test_tags() -> None:
    assert m.parse_tag(m.chunk_tag(2**64 - 1, 2**32 - 1, 17, True)) == (
        2**64 - 1, 2**32 - 1, 17, True)
    assert m.parse_tag(m.chunk_tag(5, 0, 0, False)) == (5, 0, 0, False)
    for bad in (b"kvl/5/0/0", b"sgl/5/0", b"sgl/5/0/0/lastx", b"sgl/-5/0/0",
                f"sgl/{2**64}/0/0".encode(), f"sgl/1/0/{m.MAX_CHUNKS}".encode(),
                f"sgl/1/{2**32}/0".encode(), b""):
        with pytest.raises(m.MessageError):
            m.parse_tag(bad)


def test_page_runs_merge_pages_consecutive_on_both_sides() -> None:
    s, d, n = page_runs([4, 5, 6, 9, 10, 11], [0, 1, 2, 3, 8, 9])
    assert s.tolist() == [4, 9, 10] and d.tolist() == [0, 3, 8] and n.tolist() == [3, 1, 2]
    assert all(a.size == 0 for a in page_runs([], []))


def test_kv_segments_are_layer_major_and_exact() -> None:
    # MHA as SGLang lists it: K of layers 0..2, then V of layers 0..2
    layers = [0, 1, 2, 0, 1, 2]
    segs = kv_segments(src_regions=[11, 12, 13, 14, 15, 16], dst_regions=[1, 2, 3, 4, 5, 6],
                       item_lens=[100] * 6, layer_ids=layers, src_pages=[7, 8, 20],
                       dst_pages=[0, 1, 5])
    assert segs.dtype == SEGMENT_DTYPE
    assert segs["layer"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert segs["src_region"].tolist()[:4] == [11, 11, 14, 14]
    assert segs["dst_region"].tolist()[:4] == [1, 1, 4, 4]
    assert segs["src_offset"].tolist()[:2] == [700, 2000]
    assert segs["dst_offset"].tolist()[:2] == [0, 500]
    assert segs["len"].tolist()[:2] == [200, 100]
    assert layer_order([5, 3, 5, 3]) == ([1, 3, 0, 2], [1, 0, 1, 0])


def test_aux_segments() -> None:
    segs = aux_segments(src_regions=[9, 10], dst_regions=[1, 2], item_lens=[64, 16],
                        src_slot=3, dst_slot=5, layer=2)
    assert segs["src_offset"].tolist() == [192, 48]
    assert segs["dst_offset"].tolist() == [320, 80]
    assert segs["len"].tolist() == [64, 16] and set(segs["layer"].tolist()) == {2}


def test_agent_names_fit_kvlink() -> None:
    assert len(m.prefill_agent_name("255.255.255.255", 65535)) <= 63
    assert m.prefill_agent_name("10.0.0.1", 5) != m.decode_agent_name("10.0.0.1", 5)


def test_control_messages_are_signed_under_the_cluster_secret() -> None:
    key, other = m.control_key(b"s" * 32), m.control_key(b"t" * 32)
    frames = m.encode_room(room())
    signed = m.sign(frames, key)
    assert m.verify(signed, key) == frames
    with pytest.raises(m.AuthError, match="another cluster secret"):
        m.verify(signed, other)
    with pytest.raises(m.AuthError, match="not signed"):
        m.verify(m.sign(frames, None), key)
    with pytest.raises(m.AuthError, match="has none"):
        m.verify(signed, None)
    assert m.verify(m.sign(frames, None), None) == frames
    tampered = list(signed)
    tampered[6] = np.array([1, 2, 3], "<i4").tobytes()   # redirect the pages
    with pytest.raises(m.AuthError):
        m.verify(tampered, key)
    with pytest.raises(m.MessageError):
        m.verify([m.ROOM_TAG], key)
