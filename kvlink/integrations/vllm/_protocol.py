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
  :func:`layer_tag`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from kvlink import kv

#: version of the card / params format; a mismatch is refused with both versions named
VERSION = 1
#: key of the offer inside a PREPARE announcement's "layout"
OFFER_KEY = "kvlink_offer"
_TID_WHERE = "kv_transfer_params['kvlink_push']['transfer_id']"
_TRANSFER_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class ParamsError(ValueError):
    """kv_transfer_params (or a card, or an offer) that the connector cannot use."""


@dataclasses.dataclass(frozen=True)
class Card:
    """How to reach one worker's KV cache."""

    agent: str
    metadata: str
    layout: kv.PagedLayout
    block_size: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "agent": self.agent,
            "metadata": self.metadata,
            "layout": self.layout.to_dict(),
            "block_size": self.block_size,
        }

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
        for key, typ in (("agent", str), ("metadata", str), ("layout", dict), ("block_size", int)):
            if not isinstance(d.get(key), typ):
                raise ParamsError(f"{where}[{key!r}]: missing or not a {typ.__name__}")
        try:
            layout = kv.PagedLayout.from_dict(d["layout"])
        except (ValueError, TypeError, KeyError) as exc:
            raise ParamsError(f"{where}['layout']: {exc}") from exc
        return cls(d["agent"], d["metadata"], layout, d["block_size"])


def _block_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value
    ):
        raise ParamsError(f"{where}: expected a list of block ids (ints >= 0)")
    return value


def _transfer_id(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _TRANSFER_ID.match(value):
        raise ParamsError(
            f"{where}: expected a transfer id of 1..128 characters from [A-Za-z0-9._:-], "
            f"got {value!r}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class PullSource:
    """Decode side, pull: where prefill holds the prompt's blocks."""

    card: Card
    blocks: list[int]
    tag: str
    expires: float  # unix seconds: no pull starts after this
    max_pull_s: float  # how long a pull may run; prefill holds the blocks that long past expires


@dataclasses.dataclass(frozen=True)
class PushSource:
    """Decode side, push: which prefill will push, under which transfer id."""

    card: Card
    transfer_id: str


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
            Card.from_dict(push.get("prefill"), "kv_transfer_params['kvlink_push']['prefill']"),
            _transfer_id(push.get("transfer_id"), _TID_WHERE),
        )
    info = params.get("kvlink")
    if not isinstance(info, dict):
        raise ParamsError(
            "kv_transfer_params: do_remote_prefill is set but there is neither 'kvlink' (pass "
            "prefill's kv_transfer_params unchanged) nor 'kvlink_push' (push mode: "
            "{'transfer_id': ..., 'prefill': <prefill's card>})"
        )
    blocks = _block_list(params.get("remote_block_ids"), "kv_transfer_params['remote_block_ids']")
    tag = info.get("tag")
    if not isinstance(tag, str) or not tag:
        raise ParamsError("kv_transfer_params['kvlink']['tag']: missing")
    numbers = []
    for key in ("expires", "max_pull_s"):
        value = info.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ParamsError(f"kv_transfer_params['kvlink'][{key!r}]: missing or not a number")
        numbers.append(float(value))
    return PullSource(
        Card.from_dict(info.get("card"), "kv_transfer_params['kvlink']['card']"),
        blocks, tag, numbers[0], numbers[1],
    )


def parse_prefill_push(params: dict[str, Any]) -> tuple[str, Card] | None:
    """Prefill side: (transfer id, decode's card) of a push request, None for a pull one.

    Raises:
        ParamsError: a malformed ``kvlink_push``.
    """
    push = params.get("kvlink_push")
    if push is None:
        return None
    if not isinstance(push, dict):
        raise ParamsError("kv_transfer_params['kvlink_push']: expected a JSON object")
    return (
        _transfer_id(push.get("transfer_id"), _TID_WHERE),
        Card.from_dict(push.get("decode"), "kv_transfer_params['kvlink_push']['decode']"),
    )


def layer_tag(transfer_id: str, layer: int) -> bytes:
    """Notify tag of the push carrying ``layer`` of transfer ``transfer_id``."""
    return f"kvlp/{transfer_id}/{layer}".encode()


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
    """Inverse of :func:`runs`. Raises: ParamsError."""
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
        out.extend(range(r[0], r[0] + r[1]))
    return out


def make_offer(transfer_id: str, blocks: list[int], expires_unix: float) -> dict[str, Any]:
    """Decode's destination for a push (sent as a PREPARE announcement's layout)."""
    return {OFFER_KEY: transfer_id, "v": VERSION, "blocks": runs(blocks), "expires": expires_unix}


def parse_offer(layout: Any) -> tuple[str, list[int], float] | None:
    """(transfer id, destination blocks, expiry in unix seconds) of an offer, or None when the
    announcement is not an offer. Raises: ParamsError for a malformed offer."""
    if not isinstance(layout, dict) or OFFER_KEY not in layout:
        return None
    if layout.get("v") != VERSION:
        raise ParamsError(f"offer: version {layout.get('v')!r}, this connector speaks {VERSION}")
    tid = _transfer_id(layout[OFFER_KEY], "offer['kvlink_offer']")
    expires = layout.get("expires")
    if not isinstance(expires, (int, float)) or isinstance(expires, bool):
        raise ParamsError("offer['expires']: expected unix seconds")
    return tid, unruns(layout.get("blocks"), "offer['blocks']"), float(expires)
