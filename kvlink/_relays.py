"""Relayed paths (docs/relays.md): which data paths an agent opens to a peer, directly and
through the relays it knows, from the metadata of all three.

Pure functions of metadata; the Agent calls them in ``add_peer`` and hands the routes to the C
core (``kvl_peer_connect_routes``), which connects and seals them.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

from ._errors import InvalidArgumentError

MAX_PATHS = 64
E2E_KEY_BYTES = 32
log = logging.getLogger("kvlink")


class Route(NamedTuple):
    """One data path: local address index, index into the peer's hosts (its addresses, then its
    sealed ports), and the relay (address, port, name; "" / 0 / "" when direct)."""

    local: int
    remote: int
    via: str = ""
    via_port: int = 0
    via_name: str = ""


def _net24(host: str) -> int | None:
    try:
        return int(ipaddress.IPv4Address(host)) >> 8
    except ValueError:
        return None


def _addr_list(md: dict[str, Any], key: str) -> list[tuple[str, int]]:
    raw = md.get(key, [])
    if not isinstance(raw, list) or not all(
        isinstance(x, list)
        and len(x) == 2
        and isinstance(x[0], str)
        and isinstance(x[1], int)
        and 0 < x[1] < 65536
        for x in raw
    ):
        raise InvalidArgumentError(
            f"metadata: {key!r} must be a list of [host, port], got {raw!r:.80}"
        )
    return [(h, p) for h, p in raw]


def parse_relay_fields(md: dict[str, Any]) -> dict[str, Any]:
    """The relay-related fields of raw metadata ``md``, validated: ``e2e`` (bytes or None),
    ``sealed`` and ``relay`` (lists of (host, port)).

    Raises:
        InvalidArgumentError: a field is malformed (names it).
    """
    e2e_hex = md.get("e2e")
    e2e: bytes | None = None
    if e2e_hex is not None:
        try:
            e2e = bytes.fromhex(e2e_hex)
        except (TypeError, ValueError):
            e2e = b""
        if len(e2e) != E2E_KEY_BYTES:
            raise InvalidArgumentError(
                f"metadata: 'e2e' must be {2 * E2E_KEY_BYTES} hex digits (the agent's end-to-end "
                f"key), got {e2e_hex!r:.20}"
            )
    return {"e2e": e2e, "sealed": _addr_list(md, "sealed"), "relay": _addr_list(md, "relay")}


def load_relay(item: str | bytes | dict[str, Any]) -> dict[str, Any]:
    """A relay agent's metadata from its JSON text, a dict, or the path of a file holding it.

    Raises:
        InvalidArgumentError: unreadable, not kvlink metadata, or an agent that does not relay.
    """
    if isinstance(item, dict):
        md = dict(item)
    else:
        text = item.decode() if isinstance(item, bytes) else item
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as exc:
                raise InvalidArgumentError(
                    f"relays: cannot read relay metadata file {text!r}: {exc.strerror}"
                ) from None
        try:
            md = json.loads(text)
        except ValueError as exc:
            raise InvalidArgumentError(f"relays: not relay metadata (JSON): {exc}") from None
    if not isinstance(md, dict) or not isinstance(md.get("name"), str):
        raise InvalidArgumentError("relays: not kvlink agent metadata (no 'name')")
    fields = parse_relay_fields(md)
    if not fields["relay"]:
        raise InvalidArgumentError(
            f"relays: agent {md['name']!r} does not relay (its metadata has no 'relay' "
            "addresses): start it with Config(relay=True) or as `kvlink relay`"
        )
    return {"name": md["name"], "relay": fields["relay"]}


def plan_routes(
    local: list[str], peer: dict[str, Any], relays: list[dict[str, Any]], me: str
) -> tuple[list[tuple[str, int]], list[Route]]:
    """The peer's hosts (its addresses, then its sealed ports) and the data paths to open.

    Direct: each local address to the peer address on its /24 (rail-aligned NICs), else by
    index, except a local address that reaches a relay but no peer address on its /24 (its NIC
    goes to the relay, not to the peer). Relayed: for each relay, from every local address on
    the /24 of one of the relay's addresses (hop one), to each of the peer's sealed ports on
    another /24 the relay has an address on (hop two): one path per pair of NICs, so both hops
    spread over the relay's links. At most 64 in all.
    """
    addrs: list[tuple[str, int]] = list(peer["addrs"])
    # the C core takes at most 64 hosts in all
    sealed: list[tuple[str, int]] = list(peer.get("sealed") or [])[: MAX_PATHS - len(addrs)]
    hosts = addrs + sealed
    relayed: list[Route] = []
    feeds_relay: set[int] = set()
    if peer.get("e2e") and sealed:
        for r in relays:
            if r["name"] in (me, peer["name"]):
                continue
            r_hosts = {h for h, _ in r["relay"]}
            rnets = {_net24(h) for h in r_hosts}
            for li, lh in enumerate(local):
                ingress = [(h, p) for h, p in r["relay"] if _net24(h) == _net24(lh)]
                if not ingress:
                    continue
                ih, ip = ingress[0]
                for si, (sh, _) in enumerate(sealed):
                    if _net24(sh) not in rnets or sh in r_hosts:
                        continue
                    if _net24(sh) == _net24(lh) and not lh.startswith("127."):
                        continue  # a neighbour of this NIC: the direct path goes there
                    relayed.append(Route(li, len(addrs) + si, ih, ip, r["name"]))
                    feeds_relay.add(li)  # its link leads to a relay that reaches the peer
    direct: list[Route] = []
    peer_nets = [_net24(h) for h, _ in addrs]
    for li, lh in enumerate(local):
        same = [j for j, n in enumerate(peer_nets) if n is not None and n == _net24(lh)]
        loop = lh.startswith("127.")
        if same and not loop:
            direct.append(Route(li, same[0]))
        elif li in feeds_relay and not loop:
            continue  # this NIC's link leads to the relay, not to the peer
        else:
            direct.append(Route(li, li % len(addrs)))
    routes = direct + relayed
    if len(routes) > MAX_PATHS:
        log.warning(
            "peer %r: %d paths planned (%d relayed), more than %d: the last %d relayed "
            "ones are left out",
            peer["name"], len(routes), len(relayed), MAX_PATHS, len(routes) - MAX_PATHS,
        )  # fmt: skip
    return hosts, routes[:MAX_PATHS]
