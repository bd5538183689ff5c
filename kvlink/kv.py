"""Paged KV caches as transfer segments.

An engine keeps one tensor per layer, shaped ``[planes, num_blocks, ...]``
(``planes`` = 2 when K and V are separate halves, as in vLLM) or
``[num_blocks, ...]``.  A :class:`PagedLayout` describes where every block of
every layer sits inside registered regions; :func:`block_segments` turns
"blocks [3, 9, 12] of every layer over here go to blocks [0, 1, 2] over
there" into the segments a push or pull moves, merging runs of consecutive
blocks into one segment.

Example::

    src = kv.PagedLayout.from_tensors(prefill_agent, layers, planes=2)
    dst = kv.PagedLayout.from_dict(layout_dict_from_decode_side)
    segs = kv.block_segments(src, dst, [3, 9, 12], [0, 1, 2])
    prefill_agent.push("decode-0", segments=segs, notify=b"req-42")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import ArgumentTypeError, InvalidArgumentError
from ._memory import as_span
from ._segments import SEGMENT_DTYPE

__all__ = ["PagedLayout", "block_segments"]


@dataclass(frozen=True)
class PagedLayout:
    """Where each (layer, plane, block) of a paged KV cache lives.

    Block ``b`` of plane ``k`` of layer ``l`` is the ``block_bytes`` bytes at
    ``offsets[l] + k * plane_stride + b * block_bytes`` in region ``regions[l]``.

    Raises:
        InvalidArgumentError: inconsistent fields, naming the field.
    """

    regions: tuple[int, ...]
    offsets: tuple[int, ...]
    num_blocks: int
    block_bytes: int
    planes: int = 1
    plane_stride: int = 0  # 0 = num_blocks * block_bytes (planes packed back to back)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regions", tuple(int(r) for r in self.regions))
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        if not self.regions:
            raise InvalidArgumentError("regions: a layout needs at least one layer")
        if len(self.offsets) != len(self.regions):
            raise InvalidArgumentError(
                f"offsets: {len(self.offsets)} entries for {len(self.regions)} layers"
            )
        for name in ("num_blocks", "block_bytes", "planes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise InvalidArgumentError(f"{name}: expected a positive int, got {v!r}")
        if self.plane_stride == 0:
            object.__setattr__(self, "plane_stride", self.num_blocks * self.block_bytes)
        if self.planes > 1 and self.plane_stride < self.num_blocks * self.block_bytes:
            raise InvalidArgumentError(
                f"plane_stride: {self.plane_stride} bytes makes planes overlap "
                f"({self.num_blocks} blocks of {self.block_bytes} bytes)"
            )
        if any(o < 0 for o in self.offsets):
            raise InvalidArgumentError("offsets: must be non-negative")

    @property
    def num_layers(self) -> int:
        return len(self.regions)

    @property
    def layer_bytes(self) -> int:
        return (self.planes - 1) * self.plane_stride + self.num_blocks * self.block_bytes

    @classmethod
    def from_tensors(
        cls, agent: Any, layers: Sequence[Any] | Any, *, planes: int | None = None
    ) -> PagedLayout:
        """The layout of per-layer tensors registered with ``agent`` (each inside
        a registered region).  Dimension 0 is the plane axis when ``planes`` > 1,
        then the block axis.  ``layers`` is a sequence of tensors, or one array
        whose first axis is the layer axis (as ``list(array)`` would split it).

        ``planes`` may be left out unless dimension 0 of a layer of three or
        more dimensions is 2: such a shape is K and V planes (``planes=2``) or
        two blocks (``planes=1``), and kvlink does not guess which.

        Raises:
            InvalidArgumentError: no layers, layers of different shapes, a
                shape that does not start with ``[planes, num_blocks]``, or an
                ambiguous shape without ``planes``.
            NotRegisteredError: a layer lies outside every registered region.
        """
        if not hasattr(agent, "_locate"):
            raise ArgumentTypeError(
                f"agent: expected the kvlink.Agent the layers are registered with, got "
                f"{type(agent).__name__}"
            )
        if hasattr(layers, "shape"):  # one array holding every layer
            layers = list(layers)
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
            raise ArgumentTypeError(
                f"layers: expected a list of per-layer tensors or one array of them, got "
                f"{type(layers).__name__}"
            )
        if len(layers) == 0:
            raise InvalidArgumentError("layers: expected at least one layer tensor")
        shape0 = tuple(layers[0].shape)
        regions, offsets = [], []
        for i, t in enumerate(layers):
            if tuple(t.shape) != shape0:
                raise InvalidArgumentError(
                    f"layers[{i}]: shape {tuple(t.shape)} differs from layers[0] {shape0}"
                )
            rid, off, _ = agent._locate(t, f"layers[{i}]")
            regions.append(rid)
            offsets.append(off)
        if planes is None:
            if len(shape0) >= 3 and shape0[0] == 2:
                raise InvalidArgumentError(
                    f"planes: each layer has shape {shape0}: is dimension 0 the K and V "
                    "planes or two blocks? Pass planes=2 (K and V halves, as in vLLM) or "
                    "planes=1 (dimension 0 is the block axis)"
                )
            planes = 1
        if isinstance(planes, bool) or not isinstance(planes, int) or planes <= 0:
            raise InvalidArgumentError(f"planes: expected a positive int, got {planes!r}")
        min_dims = 2 if planes > 1 else 1
        if len(shape0) < min_dims or (planes > 1 and shape0[0] != planes):
            raise InvalidArgumentError(
                f"layers: shape {shape0} does not start with [planes={planes}, num_blocks]"
                if planes > 1
                else f"layers: shape {shape0} has no block axis"
            )
        num_blocks = int(shape0[1] if planes > 1 else shape0[0])
        nbytes = as_span(layers[0], "layers[0]").nbytes
        block_bytes = nbytes // (planes * num_blocks)
        return cls(tuple(regions), tuple(offsets), num_blocks, block_bytes, planes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description, to send to the peer with the metadata."""
        return {
            "regions": list(self.regions),
            "offsets": list(self.offsets),
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "planes": self.planes,
            "plane_stride": self.plane_stride,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PagedLayout:
        """Inverse of :meth:`to_dict`.

        Raises:
            ArgumentTypeError: ``d`` is not a dict.
            InvalidArgumentError: a missing or unknown key (named), or a bad value.
        """
        keys = ("regions", "offsets", "num_blocks", "block_bytes", "planes", "plane_stride")
        if not isinstance(d, dict):
            raise ArgumentTypeError(
                f"layout: expected a dict from PagedLayout.to_dict(), got {type(d).__name__}"
            )
        missing = [k for k in keys if k not in d]
        if missing:
            raise InvalidArgumentError(
                f"layout: missing key {missing[0]!r} (a layout has keys {', '.join(keys)}; "
                "send the peer PagedLayout.to_dict())"
            )
        unknown = sorted(set(d) - set(keys))
        if unknown:
            raise InvalidArgumentError(
                f"layout: unknown key {unknown[0]!r} (a layout has keys {', '.join(keys)})"
            )
        return cls(
            tuple(d["regions"]),
            tuple(d["offsets"]),
            d["num_blocks"],
            d["block_bytes"],
            d["planes"],
            d["plane_stride"],
        )


def _blocks(arg: str, blocks: Any, num_blocks: int) -> np.ndarray[Any, Any]:
    try:
        arr = np.asarray(blocks)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{arg}: expected a sequence of block ids ({exc})") from None
    if arr.ndim != 1:
        raise InvalidArgumentError(
            f"{arg}: expected a flat sequence of block ids, got shape {arr.shape}"
        )
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"{arg}: block ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= num_blocks))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(f"{arg}[{i}]: block {int(arr[i])} is outside [0, {num_blocks})")
    return arr


def block_segments(
    src: PagedLayout,
    dst: PagedLayout,
    src_blocks: Any,
    dst_blocks: Any,
    layers: Sequence[int] | None = None,
    *,
    piece: tuple[int, int, int] | None = None,
) -> np.ndarray[Any, Any]:
    """Segments moving ``src_blocks`` of ``src`` to ``dst_blocks`` of ``dst`` for
    every layer (or only ``layers``), layer-major, runs of consecutive blocks
    on both sides merged.

    ``piece`` = (src_offset, dst_offset, length) moves only ``length`` bytes of
    each block, from ``src_offset`` into the source block to ``dst_offset``
    into the destination block (a tensor-parallel rank's heads: the two
    layouts' blocks may then differ in size). Such pieces are not merged.

    Raises:
        InvalidArgumentError: layouts that disagree (layers, planes, block
            size), block lists of different lengths, block ids out of range,
            duplicate destination blocks, unknown layers or a piece outside a
            block; the message names the argument.
    """
    if src.num_layers != dst.num_layers:
        raise InvalidArgumentError(f"dst: {dst.num_layers} layers, but src has {src.num_layers}")
    if src.planes != dst.planes:
        raise InvalidArgumentError(f"dst: {dst.planes} planes, but src has {src.planes}")
    if piece is None:
        if src.block_bytes != dst.block_bytes:
            raise InvalidArgumentError(
                f"dst: blocks of {dst.block_bytes} bytes, but src blocks are {src.block_bytes}"
            )
        src_in, dst_in, piece_len = 0, 0, src.block_bytes
    else:
        src_in, dst_in, piece_len = (int(x) for x in piece)
        if (piece_len <= 0 or src_in < 0 or dst_in < 0 or src_in + piece_len > src.block_bytes
                or dst_in + piece_len > dst.block_bytes):
            raise InvalidArgumentError(
                f"piece: {piece_len} bytes at {src_in} / {dst_in} do not fit blocks of "
                f"{src.block_bytes} / {dst.block_bytes} bytes"
            )
    sb = _blocks("src_blocks", src_blocks, src.num_blocks)
    db = _blocks("dst_blocks", dst_blocks, dst.num_blocks)
    if sb.size != db.size:
        raise InvalidArgumentError(
            f"dst_blocks: {db.size} block ids for {sb.size} src_blocks; they pair one to one"
        )
    if sb.size == 0:
        raise InvalidArgumentError("src_blocks: no blocks to move")
    if np.unique(db).size != db.size:
        raise InvalidArgumentError("dst_blocks: a destination block is listed twice")
    if layers is None:
        layer_ids = np.arange(src.num_layers, dtype=np.int64)
    else:
        layer_ids = np.asarray(list(layers), dtype=np.int64)
        bad = np.flatnonzero((layer_ids < 0) | (layer_ids >= src.num_layers))
        if bad.size:
            raise InvalidArgumentError(
                f"layers[{int(bad[0])}]: layer {int(layer_ids[bad[0]])} is outside "
                f"[0, {src.num_layers})"
            )

    if piece_len == src.block_bytes == dst.block_bytes:
        # Runs of consecutive blocks on both sides: start positions and lengths.
        breaks = np.flatnonzero((np.diff(sb) != 1) | (np.diff(db) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((starts, [sb.size])))
    else:  # part of each block: one segment per block
        starts = np.arange(sb.size)
        lengths = np.ones(sb.size, dtype=np.int64)
    run_src = sb[starts] * src.block_bytes + src_in
    run_dst = db[starts] * dst.block_bytes + dst_in
    run_len = lengths * piece_len

    nruns, nplanes, nlayers = run_len.size, src.planes, layer_ids.size
    out = np.zeros(nlayers * nplanes * nruns, dtype=SEGMENT_DTYPE)
    lay = np.repeat(layer_ids, nplanes * nruns)
    plane = np.tile(np.repeat(np.arange(nplanes, dtype=np.int64), nruns), nlayers)
    run = np.tile(np.arange(nruns), nlayers * nplanes)
    s_reg = np.asarray(src.regions, dtype=np.uint64)
    d_reg = np.asarray(dst.regions, dtype=np.uint64)
    s_off = np.asarray(src.offsets, dtype=np.int64)
    d_off = np.asarray(dst.offsets, dtype=np.int64)
    out["src_region"] = s_reg[lay]
    out["dst_region"] = d_reg[lay]
    out["src_offset"] = s_off[lay] + plane * src.plane_stride + run_src[run]
    out["dst_offset"] = d_off[lay] + plane * dst.plane_stride + run_dst[run]
    out["len"] = run_len[run]
    out["layer"] = lay
    return out
