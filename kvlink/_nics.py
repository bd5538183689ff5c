"""Turns ``Config.nics`` into the IPv4 addresses an agent listens and sends on."""

from __future__ import annotations

import ipaddress
import socket

from ._errors import ConfigError

MAX_PATHS = 64


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def _interfaces() -> dict[str, list[str]]:
    """Interface name -> IPv4 addresses, for interfaces that are up."""
    import psutil

    stats = psutil.net_if_stats()
    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        st = stats.get(name)
        if st is not None and not st.isup:
            continue
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        if v4:
            out[name] = v4
    return out


def _hint(item: str) -> str:
    """What a user who wrote ``item`` most likely meant."""
    if item == "loopback":
        return " (for loopback paths write 'loopback:N', N paths on 127.0.0.1..N)"
    if ":" in item:
        return " (IPv6 is not supported: kvlink paths are IPv4)"
    if item.replace(".", "").isdigit():
        return " (it is not a valid IPv4 address either)"
    return ""


def resolve(nics: str | tuple[str, ...]) -> list[str]:
    """Addresses for a NIC selection (see :class:`~kvlink.Config`).

    Raises:
        ConfigError: the selection names nothing usable; the message lists
            what this host has.
    """
    if isinstance(nics, str):
        spec = nics.strip()
        if spec == "auto":
            ifs = _interfaces()
            addrs = [a for addrs in ifs.values() for a in addrs if not a.startswith("127.")]
            return addrs[:MAX_PATHS] or ["127.0.0.1"]
        if spec.startswith("loopback:"):
            count = spec.split(":", 1)[1]
            if not count.isdigit() or not 1 <= int(count) <= MAX_PATHS:
                raise ConfigError(f"nics: 'loopback:N' needs 1 <= N <= {MAX_PATHS}, got {spec!r}")
            return [f"127.0.0.{i + 1}" for i in range(int(count))]
        items = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        items = list(nics)
    if not items:
        raise ConfigError("nics: empty selection; use 'auto', 'loopback:N' or NIC names")
    known: dict[str, list[str]] | None = None
    out: list[str] = []
    for item in items:
        if _is_ipv4(item):
            out.append(item)
            continue
        if known is None:
            known = _interfaces()
        if item not in known:
            raise ConfigError(
                f"nics: no up interface named {item!r} with an IPv4 address; "
                f"this host has {sorted(known)}{_hint(item)}"
            )
        out.append(known[item][0])
    if len(out) > MAX_PATHS:
        raise ConfigError(f"nics: at most {MAX_PATHS} NICs, got {len(out)}")
    if len(set(out)) != len(out):
        raise ConfigError(f"nics: an address is listed twice in {out}")
    return out
