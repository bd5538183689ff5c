"""What travels between the instances and the proxy: cards, kv_transfer_params, offers.

Plain Python (no vLLM import): the formats are checked, documented (docs/vllm.md) and tested
without an engine. Every parser raises :class:`ParamsError` naming the field it refused, so a
proxy author sees what to fix.

- A **card** says how to reach one instance's worker: its kvlink metadata (addresses, instance id,
  the access keys of its KV regions) and the :class:`kvlink.kv.PagedLayout` of its KV cache.
- **Pull** (NixlConnector's proxy contract): prefill's response carries ``kv_transfer_params``
  with ``remote_block_ids`` and ``kvlink = {card, tag, lease_s}``; the proxy passes them unchanged
  to decode, whose worker pulls the blocks and notifies ``tag`` so prefill frees them at once.
- **Push**: the proxy makes a transfer id and gives decode ``kvlink_push = {transfer_id, prefill:
  card}`` and prefill ``kvlink_push = {transfer_id, decode: card}``. Decode's worker sends its
  destination blocks to prefill as an *offer* (a kvlink PREPARE announcement); prefill's worker
  pushes every layer to them as soon as that layer is computed, one push per layer tagged
  :func:`layer_tag`. When prefill does not push (it gave the push up before the offer came, or
  it does not serve push mode), it answers the offer with a **fallback**: a PREPARE announcement
  back to decode with where its held blocks are, and decode pulls them as in pull mode.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from kvlink import kv

#: version of the card / params format; a mismatch is refused with both versions named
#: (2: cards carry their tensor-parallel shard, params may carry one card per rank)
VERSION = 2
#: at most this many ranks (cards) per instance in params: a peer cannot make us build more
MAX_RANKS = 64
#: at most this many KV cache groups (vLLM's hybrid allocator: one per attention kind)
MAX_GROUPS = 16
#: at most this many block ids in one offer or fallback (a peer's runs expand to this)
MAX_BLOCKS = 1 << 22
#: the KV cache groups of a card that does not say (one group of full-attention layers)
FULL_ONLY = ("full",)
#: key of the offer inside a PREPARE announcement's "layout"
OFFER_KEY = "kvlink_offer"
#: key of prefill's answer to an offer it will not push to ("pull these instead")
FALLBACK_KEY = "kvlink_fallback"
_TID_WHERE = "kv_transfer_params['kvlink_push']['transfer_id']"
_TRANSFER_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_INSTANCE = re.compile(r"^[0-9a-f]{16}$")
_BOOTSTRAP = re.compile(r"^https?://[A-Za-z0-9.:\[\]-]{1,255}:[0-9]{1,5}$")
#: path of a prefill's bootstrap server (vllm-router's push flow) that serves its cards
CARDS_PATH = "/kvlink/cards"


class ParamsError(ValueError):
    """kv_transfer_params (or a card, or an offer) that the connector cannot use."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which part of the model's KV one worker holds (tensor parallelism).

    ``kv_heads`` is the model's number of KV heads; rank ``rank`` of ``size`` holds
    :meth:`heads` of them, in order along the head axis of each block. ``head_bytes`` is one
    head's bytes inside a block when the head axis is the block's outermost (vLLM's CPU layout
    ``[blocks, heads, block_size, 2 * head_dim]``), so a range of heads is one contiguous piece
    of every block; 0 when heads are interleaved with tokens (then only whole blocks move,
    i.e. both sides must hold the same heads). ``replicated``: every rank holds the same KV
    (MLA's latent cache), so any one rank's copy serves.
    """

    rank: int = 0
    size: int = 1
    kv_heads: int = 0
    head_bytes: int = 0
    replicated: bool = False

    def heads(self) -> range:
        """The model's KV heads this rank holds (vLLM's split: a contiguous range per rank,
        or one head shared by size // kv_heads ranks when there are fewer heads than ranks)."""
        if self.replicated or self.kv_heads <= 0:
            return range(0)
        if self.kv_heads >= self.size:
            per = self.kv_heads // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        h = self.rank * self.kv_heads // self.size
        return range(h, h + 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Shard:
        """Raises: ParamsError naming ``where`` and the field."""
        if not isinstance(d, dict):
            raise ParamsError(f"{where}: expected a JSON object")
        for key, limit in (("rank", MAX_RANKS - 1), ("size", MAX_RANKS), ("kv_heads", 1 << 16),
                           ("head_bytes", 1 << 40)):
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= limit:
                raise ParamsError(f"{where}[{key!r}]: expected an int in [0, {limit}]")
        if not isinstance(d.get("replicated"), bool):
            raise ParamsError(f"{where}['replicated']: expected a bool")
        if not 0 <= d["rank"] < d["size"]:
            raise ParamsError(f"{where}: rank {d['rank']} outside a size of {d['size']}")
        if d["kv_heads"] and d["kv_heads"] % d["size"] and d["size"] % d["kv_heads"]:
            raise ParamsError(
                f"{where}: {d['kv_heads']} KV heads do not split over {d['size']} ranks"
            )
        return cls(d["rank"], d["size"], d["kv_heads"], d["head_bytes"], d["replicated"])


@dataclasses.dataclass(frozen=True)
class Card:
    """How to reach one worker's KV cache.

    ``metadata`` is the agent's kvlink metadata (static exchange), or None when the worker is
    published through discovery: the peer then finds it by ``agent`` name in etcd, and
    ``instance`` (the agent's instance id, hex) tells a restarted worker of the same name apart.
    """

    agent: str
    metadata: str | None
    layout: kv.PagedLayout
    block_size: int
    instance: str | None = None
    shard: Shard = Shard()
    # the engine's KV cache groups that move, in vLLM's order (:func:`group_name`): block
    # lists travel as one list per group, and both sides must have the same groups
    groups: tuple[str, ...] = FULL_ONLY

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"v": VERSION, "agent": self.agent}
        if self.metadata is not None:
            d["metadata"] = self.metadata
        if self.instance is not None:
            d["instance"] = self.instance
        d["layout"] = self.layout.to_dict()
        d["block_size"] = self.block_size
        d["tp"] = self.shard.to_dict()
        if self.groups != FULL_ONLY:
            d["groups"] = list(self.groups)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Card:
        """Raises: ParamsError naming ``where`` and the field."""
        if not isinstance(d, dict):
            raise ParamsError(f"{where}: expected a card (a JSON object), got {type(d).__name__}")
        if d.get("v") != VERSION:
            raise ParamsError(
                f"{where}['v']: card version {d.get('v')!r}, this connector speaks {VERSION}"
                " (the two instances run different kvlink versions)"
            )
        for key, typ in (("agent", str), ("layout", dict), ("block_size", int)):
            if not isinstance(d.get(key), typ):
                raise ParamsError(f"{where}[{key!r}]: missing or not a {typ.__name__}")
        for key in ("metadata", "instance"):
            if d.get(key) is not None and not isinstance(d[key], str):
                raise ParamsError(f"{where}[{key!r}]: not a str")
        if d.get("metadata") is None and not _INSTANCE.match(d.get("instance") or ""):
            raise ParamsError(
                f"{where}: neither 'metadata' (static exchange) nor an 'instance' of 16 hex "
                "digits (discovery)"
            )
        try:
            layout = kv.PagedLayout.from_dict(d["layout"])
        except (ValueError, TypeError, KeyError) as exc:
            raise ParamsError(f"{where}['layout']: {exc}") from exc
        shard = Shard.from_dict(d.get("tp"), f"{where}['tp']")
        groups = d.get("groups", list(FULL_ONLY))
        if (not isinstance(groups, list) or not 1 <= len(groups) <= MAX_GROUPS
                or not all(isinstance(g, str) and 0 < len(g) <= 64 for g in groups)):
            raise ParamsError(
                f"{where}['groups']: expected a list of 1..{MAX_GROUPS} KV cache group names"
            )
        return cls(d["agent"], d.get("metadata"), layout, d["block_size"], d.get("instance"),
                   shard, tuple(groups))


def group_name(kind: str, sliding_window: int | None, num_layers: int) -> str:
    """A KV cache group as cards name it: its attention kind ("full", or "sliding" with its
    window in tokens) and how many layers it has, e.g. ``sliding64x2``."""
    return f"{kind}{sliding_window or ''}x{num_layers}"


def cards_to_wire(cards: list[Card]) -> dict[str, Any] | list[dict[str, Any]]:
    """An instance's cards as params carry them: one card for a one-worker engine, the list
    of its ranks' cards (rank order) with tensor parallelism. Proxies pass either unchanged."""
    return cards[0].to_dict() if len(cards) == 1 else [c.to_dict() for c in cards]


def cards_from_wire(value: Any, where: str) -> list[Card]:
    """Inverse of :func:`cards_to_wire`: every rank's card, checked to be ranks 0..size-1 of
    one engine.

    Raises:
        ParamsError: naming ``where`` and what is wrong.
    """
    items = value if isinstance(value, list) else [value]
    if not 1 <= len(items) <= MAX_RANKS:
        raise ParamsError(f"{where}: expected a card or a list of 1..{MAX_RANKS} cards")
    cards = [Card.from_dict(c, f"{where}[{i}]" if isinstance(value, list) else where)
             for i, c in enumerate(items)]
    for i, c in enumerate(cards):
        if c.shard.rank != i or c.shard.size != len(cards):
            raise ParamsError(
                f"{where}: card {i} is rank {c.shard.rank} of {c.shard.size}, but {len(cards)} "
                "cards came (one per rank, in rank order)"
            )
        if (c.shard.kv_heads, c.shard.replicated, c.block_size, c.groups) != (
            cards[0].shard.kv_heads, cards[0].shard.replicated, cards[0].block_size,
            cards[0].groups,
        ):
            raise ParamsError(f"{where}: the ranks' cards disagree on the model's KV")
    return cards


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one decode rank reads from one prefill rank: in every block, ``length`` bytes at
    ``src_offset`` of prefill's block go to ``dst_offset`` of decode's."""

    src_rank: int
    dst_rank: int
    src_offset: int
    dst_offset: int
    length: int

    @property
    def whole(self) -> bool:
        return self.src_offset == 0 and self.dst_offset == 0


def pieces(prefill: list[Card], decode: list[Card]) -> list[Piece]:
    """Every (prefill rank -> decode rank) piece of a request's blocks, the same list on every
    rank of both sides: each decode rank gets each of its heads from exactly one prefill rank
    (NixlConnector's mapping: with more prefill ranks a decode rank reads from several, with
    fewer several decode ranks read from one; with replicated heads the reads are spread over
    the ranks holding them). Replicated KV (MLA) is read once per decode rank, from prefill
    rank ``d % size``.

    Raises:
        ParamsError: the two sides hold different models' KV, or heads would have to be cut
            out of a layout that interleaves them (head_bytes 0).
    """
    if prefill[0].groups != decode[0].groups:
        raise ParamsError(
            f"prefill's KV cache groups {list(prefill[0].groups)} differ from decode's "
            f"{list(decode[0].groups)}: not the same model, or vLLM's hybrid KV cache manager "
            "is on for one side only (--disable-hybrid-kv-cache-manager on both, or on neither)"
        )
    p0, d0 = prefill[0].shard, decode[0].shard
    tp_p, tp_d = len(prefill), len(decode)
    if p0.replicated != d0.replicated:
        raise ParamsError("prefill and decode disagree on whether the KV is replicated (MLA)")
    if p0.replicated or (tp_p == tp_d and p0.kv_heads == d0.kv_heads):
        # The same split on both sides: rank d reads its whole blocks from rank d % tp_p.
        out = []
        for d in range(tp_d):
            src, dst = prefill[d % tp_p], decode[d]
            if src.layout.block_bytes != dst.layout.block_bytes:
                raise ParamsError(
                    f"prefill rank {d % tp_p} has blocks of {src.layout.block_bytes} bytes, "
                    f"decode rank {d} of {dst.layout.block_bytes}: not the same model or dtype"
                )
            out.append(Piece(d % tp_p, d, 0, 0, src.layout.block_bytes))
        return out
    if p0.kv_heads != d0.kv_heads or p0.kv_heads <= 0:
        raise ParamsError(
            f"prefill holds {p0.kv_heads} KV heads, decode {d0.kv_heads}: not the same model"
        )
    out = []
    holders: dict[int, list[int]] = {}
    for c in prefill:
        for h in c.shard.heads():
            holders.setdefault(h, []).append(c.shard.rank)
    for dcard in decode:
        dh = dcard.shard.heads()
        # Runs of consecutive heads coming from one prefill rank become one piece.
        for i, h in enumerate(dh):
            ranks = holders[h]
            p = ranks[dcard.shard.rank % len(ranks)]
            pcard = prefill[p]
            hb = pcard.shard.head_bytes
            if hb <= 0 or dcard.shard.head_bytes != hb:
                raise ParamsError(
                    f"prefill TP {tp_p} and decode TP {tp_d} need heads cut out of blocks, "
                    "but this KV layout interleaves heads with tokens (head_bytes "
                    f"{hb} / {dcard.shard.head_bytes}); run both sides with the same TP"
                )
            src_off = (h - pcard.shard.heads().start) * hb
            prev = out[-1] if out else None
            if (prev is not None and prev.dst_rank == dcard.shard.rank and prev.src_rank == p
                    and prev.src_offset + prev.length == src_off
                    and prev.dst_offset + prev.length == i * hb):
                out[-1] = dataclasses.replace(prev, length=prev.length + hb)
            else:
                out.append(Piece(p, dcard.shard.rank, src_off, i * hb, hb))
    return out


def instance_of(card: Card) -> int | None:
    """The kvlink instance id a card was made by (None when its metadata does not say): a
    transfer to its agent moves bytes only while the agent is still that instance, so the
    blocks a card names are never read from or written into a restarted worker."""
    if card.instance is not None:
        return int(card.instance, 16)
    try:
        md = json.loads(card.metadata or "")
        return int(md["instance"], 16)
    except (ValueError, KeyError, TypeError):
        return None


def _block_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_BLOCKS or not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value
    ):
        raise ParamsError(f"{where}: expected a list of block ids (ints >= 0)")
    return value


#: a request's block ids, one list per KV cache group (index i of every list: the block of
#: tokens i * block_size ..; 0 is vLLM's null block, a position that group does not keep)
GroupBlocks = list[list[int]]


def blocks_to_wire(groups: GroupBlocks) -> list[int] | list[list[int]]:
    """Block ids as ``remote_block_ids`` carries them: one flat list for one group (what
    NixlConnector's proxies expect), one list per group otherwise."""
    return list(groups[0]) if len(groups) == 1 else [list(g) for g in groups]


def blocks_from_wire(value: Any, where: str) -> GroupBlocks:
    """Inverse of :func:`blocks_to_wire`. Raises: ParamsError naming ``where``."""
    if isinstance(value, list) and value and all(isinstance(g, list) for g in value):
        if len(value) > MAX_GROUPS:
            raise ParamsError(f"{where}: more than {MAX_GROUPS} KV cache groups")
        return [_block_list(g, f"{where}[{i}]") for i, g in enumerate(value)]
    return [_block_list(value, where)]


def _number(d: dict[str, Any], key: str, where: str) -> float:
    """A finite number (NaN or inf would never expire: what holds on it would never be freed)."""
    value = d.get(key)
    if (
        isinstance(value, bool) or not isinstance(value, (int, float))
        or not math.isfinite(value)
    ):
        raise ParamsError(f"{where}[{key!r}]: missing or not a finite number")
    return float(value)


def _pull_lease(d: dict[str, Any], where: str) -> tuple[str, float, float]:
    """(tag, expires, max_pull_s) of a pull answer: prefill's params or its fallback."""
    tag = d.get("tag")
    if not isinstance(tag, str) or not tag:
        raise ParamsError(f"{where}['tag']: missing")
    return tag, _number(d, "expires", where), _number(d, "max_pull_s", where)


def _transfer_id(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _TRANSFER_ID.match(value):
        raise ParamsError(
            f"{where}: expected a transfer id of 1..128 characters from [A-Za-z0-9._:-], "
            f"got {value!r}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class PullSource:
    """Decode side, pull: where prefill holds the prompt's blocks (every prefill rank holds
    the same block ids; ``cards`` has one card per rank)."""

    cards: list[Card]
    blocks: GroupBlocks
    tag: str
    expires: float  # unix seconds: no pull starts after this
    max_pull_s: float  # how long a pull may run; prefill holds the blocks that long past expires


@dataclasses.dataclass(frozen=True)
class PushSource:
    """Decode side, push: which prefill will push (one card per rank), under which transfer
    id. ``bootstrap``: the cards came from that prefill's bootstrap server (vllm-router's
    flow), and prefill learns decode's cards from its offers."""

    cards: list[Card]
    transfer_id: str
    bootstrap: str | None = None


def router_push(params: dict[str, Any]) -> tuple[str, str | None] | None:
    """vllm-router's push request (its ``--kv-connector mooncake`` flow, which names neither
    side's card): (transfer id, prefill's bootstrap address at decode / None at prefill), or
    None when ``params`` are not one.

    Raises:
        ParamsError: a malformed transfer id or bootstrap address.
    """
    if "kvlink_push" in params or "kvlink" in params or "transfer_id" not in params:
        return None
    tid = _transfer_id(params["transfer_id"], "kv_transfer_params['transfer_id']")
    if not params.get("do_remote_prefill"):
        return tid, None
    addr = params.get("remote_bootstrap_addr")
    if not isinstance(addr, str) or not _BOOTSTRAP.match(addr):
        raise ParamsError(
            "kv_transfer_params['remote_bootstrap_addr']: expected prefill's bootstrap server "
            f"as http://HOST:PORT, got {addr!r}"
        )
    return tid, addr


def parse_decode_params(params: dict[str, Any]) -> PullSource | PushSource:
    """The load a decode instance is asked for (``do_remote_prefill`` is set).

    Raises:
        ParamsError: neither a kvlink pull (``kvlink``) nor a push (``kvlink_push``) request, or
            a malformed one; the message names the field.
    """
    if "kvlink_push" in params:
        push = params["kvlink_push"]
        if not isinstance(push, dict):
            raise ParamsError("kv_transfer_params['kvlink_push']: expected a JSON object")
        return PushSource(
            cards_from_wire(push.get("prefill"), "kv_transfer_params['kvlink_push']['prefill']"),
            _transfer_id(push.get("transfer_id"), _TID_WHERE),
        )
    info = params.get("kvlink")
    if not isinstance(info, dict):
        raise ParamsError(
            "kv_transfer_params: do_remote_prefill is set but there is neither 'kvlink' (pass "
            "prefill's kv_transfer_params unchanged) nor 'kvlink_push' (push mode: "
            "{'transfer_id': ..., 'prefill': <prefill's card>})"
        )
    blocks = blocks_from_wire(params.get("remote_block_ids"),
                              "kv_transfer_params['remote_block_ids']")
    tag, expires, max_pull_s = _pull_lease(info, "kv_transfer_params['kvlink']")
    if len(tag) > 512:
        raise ParamsError("kv_transfer_params['kvlink']['tag']: longer than 512 characters")
    return PullSource(
        cards_from_wire(info.get("card"), "kv_transfer_params['kvlink']['card']"),
        blocks, tag, expires, max_pull_s,
    )


def parse_prefill_push(params: dict[str, Any]) -> tuple[str, list[Card] | None] | None:
    """Prefill side: (transfer id, decode's cards) of a push request, None for a pull one.
    Decode's cards are None in vllm-router's flow: decode's offers bring them.

    Raises:
        ParamsError: a malformed ``kvlink_push`` or transfer id.
    """
    push = params.get("kvlink_push")
    if push is None:
        routed = router_push(params)
        return None if routed is None else (routed[0], None)
    if not isinstance(push, dict):
        raise ParamsError("kv_transfer_params['kvlink_push']: expected a JSON object")
    return (
        _transfer_id(push.get("transfer_id"), _TID_WHERE),
        cards_from_wire(push.get("decode"), "kv_transfer_params['kvlink_push']['decode']"),
    )


def layer_tag(transfer_id: str, src_rank: int, layer: int) -> bytes:
    """Notify tag of the push from prefill rank ``src_rank`` carrying ``layer`` of transfer
    ``transfer_id``."""
    return f"kvlp/{transfer_id}/{src_rank}/{layer}".encode()


def pull_note(tag: str, reader: int, readers: int) -> bytes:
    """Notify tag of decode rank ``reader``'s pull of a prefill rank's blocks held under
    ``tag``; ``readers`` decode ranks read that prefill rank, and it frees the blocks once
    that many distinct decode ranks have pulled."""
    return f"{tag}|{reader}|{readers}".encode()


def parse_pull_note(note: str) -> tuple[str, int, int]:
    """(tag, reader, readers) of a pull notification (a plain tag: reader 0 of 1).

    Raises:
        ParamsError: a malformed reader count.
    """
    tag, sep, rest = note.partition("|")
    if not sep:
        return note, 0, 1
    reader_s, _, readers_s = rest.partition("|")
    if not (reader_s.isdigit() and readers_s.isdigit()):
        raise ParamsError(f"pull notification {note[:80]!r}: malformed reader count")
    reader, readers = int(reader_s), int(readers_s)
    # reader is a decode rank (any of the engine's), readers how many ranks read this one
    if not (0 <= reader < MAX_RANKS and 1 <= readers <= MAX_RANKS):
        raise ParamsError(f"pull notification {note[:80]!r}: reader {reader} of {readers}")
    return tag, reader, readers


#: key of decode's "nobody here reads your blocks of this request" to a prefill rank
RELEASE_KEY = "kvlink_release"


def make_release(tag: str) -> dict[str, Any]:
    """Decode to a prefill rank none of its ranks reads (replicated KV, fewer decode ranks):
    free the blocks held under ``tag``."""
    return {RELEASE_KEY: tag, "v": VERSION}


def parse_release(layout: Any) -> str | None:
    """The tag a release announcement frees, or None when it is not one.

    Raises:
        ParamsError: a malformed release.
    """
    if not isinstance(layout, dict) or RELEASE_KEY not in layout:
        return None
    if layout.get("v") != VERSION:
        raise ParamsError(f"release: version {layout.get('v')!r}, this connector speaks {VERSION}")
    tag = layout[RELEASE_KEY]
    if not isinstance(tag, str) or not 0 < len(tag) <= 512:
        raise ParamsError("release: the tag is not a str of 1..512 characters")
    return tag


def runs(blocks: list[int]) -> list[list[int]]:
    """Block ids as [first, count] runs (an offer for 60 blocks is then a few bytes)."""
    out: list[list[int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return out


def unruns(value: Any, where: str) -> list[int]:
    """Inverse of :func:`runs` (at most MAX_BLOCKS ids). Raises: ParamsError."""
    if not isinstance(value, list):
        raise ParamsError(f"{where}: expected [[first, count], ...]")
    out: list[int] = []
    for r in value:
        if (
            not isinstance(r, list)
            or len(r) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            or r[0] < 0
            or not 1 <= r[1] <= 1 << 20
        ):
            raise ParamsError(f"{where}: expected [[first, count], ...], got element {r!r}")
        if len(out) + r[1] > MAX_BLOCKS:
            raise ParamsError(f"{where}: more than {MAX_BLOCKS} block ids")
        out.extend(range(r[0], r[0] + r[1]))
    return out


def _groups_to_layout(d: dict[str, Any], groups: GroupBlocks) -> dict[str, Any]:
    """``d`` with ``groups`` as runs: "blocks" for one group, "groups" for several."""
    if len(groups) == 1:
        d["blocks"] = runs(groups[0])
    else:
        d["groups"] = [runs(g) for g in groups]
    return d


def _groups_of_layout(layout: dict[str, Any], where: str) -> GroupBlocks:
    """Inverse of :func:`_groups_to_layout`. Raises: ParamsError."""
    if "groups" not in layout:
        return [unruns(layout.get("blocks"), f"{where}['blocks']")]
    groups = layout["groups"]
    if not isinstance(groups, list) or not 1 <= len(groups) <= MAX_GROUPS:
        raise ParamsError(f"{where}['groups']: expected a list of 1..{MAX_GROUPS} run lists")
    out = [unruns(g, f"{where}['groups'][{i}]") for i, g in enumerate(groups)]
    if sum(map(len, out)) > MAX_BLOCKS:
        raise ParamsError(f"{where}['groups']: more than {MAX_BLOCKS} block ids")
    return out


@dataclasses.dataclass(frozen=True)
class Offer:
    """Decode rank ``rank``'s destination blocks for a push of ``transfer_id``: per KV cache
    group, the blocks of positions ``first`` .. (decode computed the ones before itself)."""

    transfer_id: str
    rank: int
    blocks: GroupBlocks
    expires: float  # unix seconds
    first: int = 0
    card: Card | None = None  # the decode rank's own, when prefill was not given it


def make_offer(offer: Offer) -> dict[str, Any]:
    """An offer as a PREPARE announcement's layout."""
    d: dict[str, Any] = {OFFER_KEY: offer.transfer_id, "v": VERSION, "rank": offer.rank,
                         "expires": offer.expires, "first": offer.first}
    if offer.card is not None:
        d["card"] = offer.card.to_dict()
    return _groups_to_layout(d, offer.blocks)


def _rank(d: dict[str, Any], where: str) -> int:
    r = d.get("rank")
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < MAX_RANKS:
        raise ParamsError(f"{where}['rank']: expected an int in [0, {MAX_RANKS})")
    return r


def parse_offer(layout: Any) -> Offer | None:
    """The offer of an announcement, or None when it is not an offer.
    Raises: ParamsError for a malformed offer."""
    if not isinstance(layout, dict) or OFFER_KEY not in layout:
        return None
    if layout.get("v") != VERSION:
        raise ParamsError(f"offer: version {layout.get('v')!r}, this connector speaks {VERSION}")
    tid = _transfer_id(layout[OFFER_KEY], "offer['kvlink_offer']")
    expires = _number(layout, "expires", "offer")
    first = layout.get("first", 0)
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= MAX_BLOCKS:
        raise ParamsError(f"offer['first']: expected an int in [0, {MAX_BLOCKS}]")
    rank = _rank(layout, "offer")
    card = None
    if layout.get("card") is not None:
        card = Card.from_dict(layout["card"], "offer['card']")
        if card.shard.rank != rank:
            raise ParamsError(f"offer: decode rank {rank} sent rank {card.shard.rank}'s card")
    return Offer(tid, rank, _groups_of_layout(layout, "offer"), expires, first, card)


@dataclasses.dataclass(frozen=True)
class Fallback:
    """Prefill's answer to an offer it will not push to: decode pulls ``blocks`` (the request's
    blocks per KV cache group, paired with the offered ones by position) with ``tag`` as the
    pull's notification, as in pull mode."""

    transfer_id: str
    rank: int  # the prefill rank answering
    blocks: GroupBlocks
    tag: str
    expires: float  # unix seconds: no pull starts after this
    max_pull_s: float


def make_fallback(fb: Fallback) -> dict[str, Any]:
    """A fallback as a PREPARE announcement's layout (a few hundred bytes: blocks as runs)."""
    d = {
        FALLBACK_KEY: fb.transfer_id, "v": VERSION, "rank": fb.rank,
        "tag": fb.tag, "expires": fb.expires, "max_pull_s": fb.max_pull_s,
    }
    return _groups_to_layout(d, fb.blocks)


def parse_fallback(layout: Any) -> Fallback | None:
    """The fallback of an announcement, or None when it is not one.

    Raises:
        ParamsError: a malformed fallback, naming the field.
    """
    if not isinstance(layout, dict) or FALLBACK_KEY not in layout:
        return None
    if layout.get("v") != VERSION:
        raise ParamsError(f"fallback: version {layout.get('v')!r}, this connector speaks {VERSION}")
    tid = _transfer_id(layout[FALLBACK_KEY], "fallback['kvlink_fallback']")
    tag, expires, max_pull_s = _pull_lease(layout, "fallback")
    return Fallback(
        tid, _rank(layout, "fallback"), _groups_of_layout(layout, "fallback"), tag, expires,
        max_pull_s,
    )
