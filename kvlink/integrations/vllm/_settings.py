"""The connector's settings: ``kv_connector_extra_config`` parsed and validated.

Everything here is plain Python (no vLLM import), so bad settings are caught and tested without
an engine. Every error names the key as the user wrote it and says what is accepted.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
from collections.abc import Mapping
from typing import Any

import kvlink
from kvlink import _relays
from kvlink._units import parse_size

WHERE = "kv_connector_extra_config"


class Mode(enum.Enum):
    """Which flows an instance serves; the proxy picks the flow of each request."""

    #: both flows, as each request's kv_transfer_params ask
    AUTO = "auto"
    #: decode reads prefill's blocks (NixlConnector's flow): prefill answers first with where its
    #: blocks are; the proxy hands that to decode.
    PULL = "pull"
    #: prefill writes into blocks decode allocated, layer by layer while it computes; the proxy
    #: sends the request to both at once with one transfer id.
    PUSH = "push"


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """``kv_connector_extra_config["store"]`` of ``KvlinkStoreConnector`` (docs/vllm.md,
    "Reuse"): the worker's kvlink.store.  Sizes are bytes (ints or "8GiB")."""

    host_bytes: int = 1 << 30  # registered host memory: what a restart of the turn hits first
    disk_path: str | None = None  # a directory on local NVMe; None: no disk tier
    disk_bytes: int = 0
    eviction: str = "lru"  # or "arc"
    write_policy: str = "write-back"  # or "write-through"
    # A request whose prefix is on disk or another host waits in vLLM's queue (other requests
    # run) while it moves up: "timeout" waits base + per block, capped; "wait" until it is up
    # (at most load_timeout_s); "best-effort" not at all: only what is in host memory hits.
    prefetch: str = "timeout"
    prefetch_base_s: float = 0.05
    prefetch_per_block_s: float = 0.002
    prefetch_cap_s: float = 1.0
    # Part of every block key beside the model, dtype and layout, e.g. a weights revision.
    namespace: str = ""

    def store_config(self, block_bytes: int, name: str) -> Any:
        from kvlink.store import StoreConfig

        return StoreConfig(
            block_bytes=block_bytes,
            host_bytes=self.host_bytes,
            disk_path=self.disk_path,
            disk_bytes=self.disk_bytes if self.disk_path else 0,
            eviction=self.eviction,
            write_policy=self.write_policy,
            prefetch_base_s=self.prefetch_base_s,
            prefetch_per_block_s=self.prefetch_per_block_s,
            prefetch_cap_s=self.prefetch_cap_s,
            name=name,
        )


_STORE_KEYS = tuple(f.name for f in dataclasses.fields(StoreSettings))


def _size(key: str, value: Any) -> int:
    try:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected bytes as an int or a size string, got {value!r}")
        n = parse_size(value)
    except ValueError as exc:
        raise kvlink.ConfigError(f"{WHERE}[{key}]: {exc}") from None
    if n <= 0:
        raise kvlink.ConfigError(f"{WHERE}[{key}]: expected a positive size, got {value!r}")
    return n


def parse_store(value: Any) -> StoreSettings:
    """``kv_connector_extra_config["store"]`` as :class:`StoreSettings`.

    Raises:
        kvlink.ConfigError: an unknown key (naming the closest) or a bad value (naming it).
    """
    if value is None:
        return StoreSettings()
    if not isinstance(value, Mapping):
        raise kvlink.ConfigError(f"{WHERE}['store']: expected a dict, got {type(value).__name__}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        where = f"'store']['{key}'"
        if key not in _STORE_KEYS:
            match = difflib.get_close_matches(str(key), _STORE_KEYS, n=1, cutoff=0.6)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            raise kvlink.ConfigError(
                f"{WHERE}['store']: unknown key {key!r}{hint}; keys: " + ", ".join(_STORE_KEYS)
            )
        if key in ("host_bytes", "disk_bytes"):
            out[key] = _size(where, v)
        elif key == "disk_path":
            if v is None:
                continue
            if not isinstance(v, str) or not v:
                raise kvlink.ConfigError(f"{WHERE}[{where}]: expected a directory path")
            out[key] = v
        elif key in ("eviction", "write_policy", "prefetch"):
            allowed = {
                "eviction": ("lru", "arc"),
                "write_policy": ("write-back", "write-through"),
                "prefetch": ("timeout", "wait", "best-effort"),
            }[key]
            if v not in allowed:
                raise kvlink.ConfigError(
                    f"{WHERE}[{where}]: {v!r} is not one of " + ", ".join(map(repr, allowed))
                )
            out[key] = v
        elif key in ("prefetch_base_s", "prefetch_per_block_s", "prefetch_cap_s"):
            out[key] = _seconds(f"'store']['{key}", v, 0.0, 600.0)
        elif key == "namespace":
            if not isinstance(v, str):
                raise kvlink.ConfigError(f"{WHERE}[{where}]: expected a str")
            out[key] = v
    st = StoreSettings(**out)
    if st.disk_path is not None and st.disk_bytes == 0:
        raise kvlink.ConfigError(
            f"{WHERE}['store']['disk_bytes']: disk_path is set; give the disk tier's capacity "
            "(e.g. '100GiB')"
        )
    return st


@dataclasses.dataclass(frozen=True)
class Settings:
    """Validated ``kv_connector_extra_config`` (docs/vllm.md lists every key)."""

    # A proxy picks the flow per request; "auto" serves both.
    mode: Mode = Mode.AUTO
    # Pull and push both need the peer's regions on the network; "auto" = every NIC, as kvlink.
    nics: str | tuple[str, ...] = "auto"
    # None: kvlink's own default (64 MiB, shrunk per transfer so every path gets work).
    chunk_bytes: int | None = None
    # None: KVLINK_SECRET / KVLINK_SECRET_FILE from the environment, as for any kvlink agent.
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    allow_unauthenticated: bool = False
    # NixlConnector's lease is 30 s too: long enough for a decode queue, short enough that a
    # dead decode does not starve prefill of blocks for long.
    lease_s: float = 30.0
    # Every decode-side wait for one request's KV (the pull, or a pushed layer) ends by then
    # and its blocks are reported as failed: a dead prefill never hangs decode.
    load_timeout_s: float = 30.0
    # Push: how long after prefill computed the KV it still waits for decode's destination
    # before it gives the push up (decode then times out and recomputes or fails).
    offer_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    # None: "vllm-<engine id>-<rank>", unique per engine and worker.
    agent_name: str | None = None
    # None ("static"): a card carries the worker's full kvlink metadata, as without etcd. An
    # etcd URL: the worker publishes its agent there and finds peers by name, so cards carry
    # the name and instance only (docs/vllm.md, "Discovery").
    discovery: str | None = None
    # Relays this worker's agent may route through (docs/relays.md): relay agents' metadata
    # (JSON) or paths of files holding it; with discovery, relaying members are found there.
    relays: tuple[str, ...] = ()
    # Push behind vllm-router's "--kv-connector mooncake" flow (docs/vllm.md, "Behind
    # vllm-router"): a prefill serves its card on this HTTP port (the router's "--prefill URL
    # PORT"), decode fetches it from there. None: no such server.
    bootstrap_port: int | None = None
    bootstrap_host: str = "0.0.0.0"
    # KvlinkStoreConnector only: the store (StoreSettings); the P/D connector ignores it.
    store: StoreSettings = dataclasses.field(default_factory=StoreSettings)

    def kvlink_config(self) -> kvlink.Config:
        """The kvlink.Config of the worker's agent (KVLINK_* variables fill what is unset).

        Raises:
            kvlink.ConfigError: a value kvlink refuses, with the key named.
        """
        fields: dict[str, Any] = {
            "nics": list(self.nics) if isinstance(self.nics, tuple) else self.nics,
            "connect_timeout_s": self.connect_timeout_s,
            "transfer_timeout_s": self.load_timeout_s,
        }
        if self.allow_unauthenticated:
            fields["allow_unauthenticated"] = True
        if self.chunk_bytes is not None:
            fields["chunk_bytes"] = self.chunk_bytes
            fields["min_chunk_bytes"] = min(self.chunk_bytes, 1 << 20)
        if self.secret is not None:
            fields["secret"] = self.secret
        if self.discovery is not None:
            fields["discovery"] = self.discovery
        if self.relays:
            fields["relays"] = list(self.relays)
        try:
            cfg = kvlink.Config.load(**fields)
        except kvlink.ConfigError as exc:
            raise kvlink.ConfigError(f"{WHERE}: {exc}") from exc
        if self.discovery is not None and cfg.resolved_secret() is None:
            # Without it no region key is published and every load would fail at run time.
            raise kvlink.ConfigError(
                f"{WHERE}['discovery']: {self.discovery!r} needs the cluster secret (the "
                "'secret' key or KVLINK_SECRET): discovery publishes region keys only sealed "
                "under it (docs/cluster.md)"
            )
        return cfg


_KEYS = tuple(f.name for f in dataclasses.fields(Settings))


def _closest(name: str) -> str:
    match = difflib.get_close_matches(name, _KEYS, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _seconds(key: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise kvlink.ConfigError(f"{WHERE}[{key!r}]: expected seconds as a number, got {value!r}")
    if math.isnan(value) or not lo <= value <= hi:
        raise kvlink.ConfigError(f"{WHERE}[{key!r}]: {value} is outside [{lo}, {hi}] seconds")
    return float(value)


def parse_settings(extra: Mapping[str, Any] | None) -> Settings:
    """``kv_connector_extra_config`` as :class:`Settings`.

    Raises:
        kvlink.ConfigError: an unknown key (naming the closest known one) or a bad value (naming
            the key and what it accepts).
    """
    if extra is None:
        return Settings()
    if not isinstance(extra, Mapping):
        raise kvlink.ConfigError(f"{WHERE}: expected a dict, got {type(extra).__name__}")
    out: dict[str, Any] = {}
    for key, value in extra.items():
        if key not in _KEYS:
            raise kvlink.ConfigError(
                f"{WHERE}: unknown key {key!r}{_closest(str(key))}; keys: " + ", ".join(_KEYS)
            )
        if key == "mode":
            names = [m.value for m in Mode]
            if value not in names:
                raise kvlink.ConfigError(
                    f"{WHERE}['mode']: {value!r} is not a mode; use 'auto', 'pull' or 'push'"
                )
            out[key] = Mode(value)
        elif key == "nics":
            if isinstance(value, str) and value:
                out[key] = value
            elif isinstance(value, (list, tuple)) and value and all(
                isinstance(v, str) and v for v in value
            ):
                out[key] = tuple(value)
            else:
                raise kvlink.ConfigError(
                    f"{WHERE}['nics']: expected 'auto', 'loopback:N', 'eth2,eth3' or a list of "
                    f"interface names / IPv4 addresses, got {value!r}"
                )
        elif key == "chunk_bytes":
            if value is None:
                continue
            try:
                if isinstance(value, bool) or not isinstance(value, (int, str)):
                    raise ValueError(f"expected bytes as an int or a size string, got {value!r}")
                out[key] = parse_size(value)
            except ValueError as exc:
                raise kvlink.ConfigError(
                    f"{WHERE}['chunk_bytes']: {exc} (e.g. 4194304 or '4MiB')"
                ) from None
        elif key == "secret":
            if value is None:
                continue
            if isinstance(value, str):
                value = value.encode()
            if not isinstance(value, bytes) or not 16 <= len(value) <= 256:
                raise kvlink.ConfigError(
                    f"{WHERE}['secret']: expected a str of 16..256 bytes shared by every "
                    "instance (e.g. `openssl rand -hex 32`), or leave it out and set KVLINK_SECRET"
                )
            out[key] = value
        elif key == "bootstrap_port":
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
                raise kvlink.ConfigError(
                    f"{WHERE}['bootstrap_port']: expected a TCP port in 1..65535 (the one "
                    f"vllm-router's --prefill URL PORT names), got {value!r}"
                )
            out[key] = value
        elif key == "bootstrap_host":
            if not isinstance(value, str) or not value:
                raise kvlink.ConfigError(
                    f"{WHERE}['bootstrap_host']: expected the address to listen on, e.g. "
                    "'0.0.0.0' or '10.0.0.5'"
                )
            out[key] = value
        elif key == "allow_unauthenticated":
            if not isinstance(value, bool):
                raise kvlink.ConfigError(f"{WHERE}['allow_unauthenticated']: expected true/false")
            out[key] = value
        elif key in ("lease_s", "load_timeout_s", "offer_timeout_s"):
            out[key] = _seconds(key, value, 0.001, 3600.0)
        elif key == "connect_timeout_s":
            out[key] = _seconds(key, value, 0.001, 600.0)
        elif key == "discovery":
            if value is None or value == "static":
                continue
            if not isinstance(value, str) or not value.startswith(("etcd://", "etcds://")):
                raise kvlink.ConfigError(
                    f"{WHERE}['discovery']: expected 'static' (the default: cards carry the "
                    "full metadata) or an etcd URL 'etcd://HOST[:PORT][,HOST[:PORT]...][/PREFIX]"
                    f"' ('etcds://' for TLS), got {value!r}"
                )
            from kvlink._discovery import parse_url

            parse_url(value, arg=f"{WHERE}['discovery']")  # ConfigError naming the key
            out[key] = value
        elif key == "relays":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, str) and v for v in value
            ):
                raise kvlink.ConfigError(
                    f"{WHERE}['relays']: expected a list of relay metadata (JSON text) or paths "
                    f"of files holding it (`kvlink relay --metadata-out FILE`), got {value!r:.80}"
                )
            for v in value:  # an unreadable file or an agent that does not relay: at start
                try:
                    _relays.load_relay(v)
                except kvlink.KvlinkError as exc:
                    raise kvlink.ConfigError(f"{WHERE}['relays']: {exc}") from None
            out[key] = tuple(value)
        elif key == "store":
            out[key] = parse_store(value)
        elif key == "agent_name":
            if not isinstance(value, str) or not 1 <= len(value.encode()) <= 63:
                raise kvlink.ConfigError(f"{WHERE}['agent_name']: expected a str of 1..63 bytes")
            out[key] = value
    return Settings(**out)


# The connectors of this package, as vLLM names them in KVTransferConfig.
CONNECTORS = ("KvlinkConnector", "KvlinkStoreConnector")
MODULE = "kvlink.integrations.vllm"


def _connectors_in(kv_transfer_config: Any) -> list[tuple[str, Any]]:
    """(name, kv_connector_extra_config) of every kvlink connector ``kv_transfer_config``
    (vLLM's KVTransferConfig, or anything with its attributes) loads, MultiConnector's
    sub-connectors included."""
    name = getattr(kv_transfer_config, "kv_connector", None)
    module = getattr(kv_transfer_config, "kv_connector_module_path", None) or ""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
    if name in CONNECTORS and module.startswith(MODULE):
        return [(str(name), extra)]
    out: list[tuple[str, Any]] = []
    if name == "MultiConnector" and isinstance(extra, Mapping):
        for sub in extra.get("connectors") or ():
            if isinstance(sub, Mapping):
                out += _connectors_in(types.SimpleNamespace(
                    kv_connector=sub.get("kv_connector"),
                    kv_connector_module_path=sub.get("kv_connector_module_path"),
                    kv_connector_extra_config=sub.get("kv_connector_extra_config"),
                ))
    return out


def check_at_start(kv_transfer_config: Any) -> None:
    """What a kvlink connector would refuse when vLLM constructs it, checked from the
    KVTransferConfig alone (nothing is opened): its ``kv_connector_extra_config``, the kvlink
    settings it makes with the ``KVLINK_*`` environment, and a listener beyond loopback without
    a cluster secret. The vLLM plugin (:mod:`kvlink.integrations.vllm._plugin`) runs it as soon
    as vLLM has built its config, so these errors stop a server in seconds instead of after
    the model has loaded. Configs that load no kvlink connector pass.

    Raises:
        kvlink.ConfigError: naming the key (or variable) and the fix.
    """
    from kvlink import _nics

    for _name, extra in _connectors_in(kv_transfer_config):
        settings = parse_settings(extra)
        cfg = settings.kvlink_config()
        if cfg.allow_unauthenticated or cfg.resolved_secret() is not None:
            continue
        exposed = [a for a in _nics.resolve(cfg.nics) if not a.startswith("127.")]
        if exposed:
            given = list(settings.nics) if isinstance(settings.nics, tuple) else settings.nics
            raise kvlink.ConfigError(
                f"{WHERE}['nics']: {given!r} listens on {exposed[0]} (beyond loopback) "
                "and no cluster secret is set, so anyone who reaches it could write this "
                "instance's KV cache. Give every instance the same secret: KVLINK_SECRET (or "
                f"KVLINK_SECRET_FILE) in the server's environment, or {WHERE}['secret']; on a "
                f"trusted network allow it with {WHERE}['allow_unauthenticated'] = true "
                "(docs/security.md)"
            )
