"""The object API's endpoint: :class:`Agent` (registrations, peers, transfers)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _cuda, _host, _native, _nics, _relays, _transport
from ._args import bool_arg, int_error, timeout_arg
from ._config import Config
from ._errors import (
    ArgumentTypeError,
    ClosedError,
    ConfigError,
    DiscoveryError,
    DuplicateNameError,
    InvalidArgumentError,
    KvlinkError,
    NotRegisteredError,
    OutOfBoundsError,
    PeerUnreachableError,
    RegistrationError,
    RemoteAccessError,
    SizeMismatchError,
    UnknownPeerError,
    UnknownRegionError,
)
from ._inbound import InboundTransfer
from ._logdrain import LogDrain
from ._memory import as_span
from ._regions import RegionTable
from ._segments import SEGMENT_DTYPE, as_segment_array
from ._transfer import Transfer
from ._types import (
    InboundStats,
    MemoryType,
    Notification,
    Op,
    PathInfo,
    PathState,
    PeerInfo,
    Region,
    RemoteRegion,
)
from .kv import PagedLayout

log = logging.getLogger("kvlink")

METADATA_VERSION = 1

_live_names: weakref.WeakValueDictionary[str, Agent] = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


class Agent:
    """One kvlink endpoint: registrations, peers, paths, the engine thread.

    Example::

        with kvlink.Agent("decode-0", kvlink.Config(nics="loopback:4")) as agent:
            region = agent.register(kv, remote_write=True, name="kv")
            send_to_prefill(agent.metadata())

    Raises:
        ConfigError: invalid configuration or NIC selection.
        DuplicateNameError: another live agent in this process has ``name``.
        KvlinkError: listening failed (the message names the address).
    """

    def __init__(self, name: str, config: Config | None = None, **overrides: Any) -> None:
        if not isinstance(name, str):
            raise ArgumentTypeError(f"name: expected 1..63 bytes of text (a str), got {name!r}")
        if not 0 < len(name.encode()) < 64:
            raise InvalidArgumentError(f"name: expected 1..63 bytes of text, got {name!r}")
        if config is not None and not isinstance(config, Config):
            raise ArgumentTypeError(
                f"config: expected a kvlink.Config or None, got {type(config).__name__}"
            )
        cfg = config if config is not None else Config.load()
        if overrides:
            cfg = cfg.replace(**overrides)
        self.name = name
        self.config = cfg
        self._lock = threading.Lock()
        self._closed = False
        self._users = 0
        self._idle = threading.Condition(self._lock)
        self._regions = RegionTable()
        addrs = _nics.resolve(cfg.nics)
        if cfg.transport == "ucx":
            ok, why = _transport.ucx_status()
            if not ok:
                raise ConfigError(f"transport='ucx': {why}; or use transport='tcp'")
            if cfg.resolved_secret() is None:
                raise ConfigError(
                    "transport='ucx' needs a cluster secret (Config.secret or KVLINK_SECRET): "
                    "UCX is set up only between agents that proved it, because libucp parses "
                    "a peer's worker address unchecked (docs/ucx.md)"
                )
        self._transport = _transport.path_transport(cfg.transport)
        with _live_lock:
            if name in _live_names:
                raise DuplicateNameError(
                    f"name: an agent named {name!r} is already open in this process; "
                    "close it first or choose another name"
                )
            relay_addrs = _nics.resolve(cfg.relay_nics) if cfg.relay_nics else []
            self._a = _native.agent_create(name, addrs, cfg, relay_addrs)
            self._drain = LogDrain(self._a, name)
            _live_names[name] = self
        self.instance_id = _native.agent_instance(self._a)
        self.addresses = _native.agent_addresses(self._a)
        self._relay_addrs = relay_addrs or [h for h, _ in self.addresses]
        self._relays: dict[str, dict[str, Any]] = {}
        self._discovered_relays: set[str] = set()
        # its own lock: add_peer plans routes while other calls run (self._lock is not held)
        self._relay_lock = threading.Lock()
        self._peer_md: dict[str, tuple[int, tuple[tuple[str, int], ...]]] = {}
        self._discover_lock = threading.Lock()
        self._discovery: Any = None
        self._metrics: Any = None
        self._metrics_server: Any = None
        try:
            for item in cfg.relays:
                self.add_relay(item)
            if cfg.metrics_port is not None:
                from ._metrics import MetricsServer

                self._metrics_server = MetricsServer(
                    self.metrics(), cfg.metrics_host, cfg.metrics_port
                )
            if cfg.discovery is not None:
                from ._discovery import Discovery

                self._discovery = Discovery(self, cfg, cfg.resolved_secret())
        except BaseException:
            self.close()
            raise
        log.info("agent %s listening on %s", name, self.addresses)

    # ---- lifecycle -------------------------------------------------------

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"agent {self.name!r} is closed; create a new Agent")

    @contextlib.contextmanager
    def _using(self) -> Iterator[_native.Handle]:
        """Lends the native agent for one call; close() waits until it is back."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            self._users += 1
        try:
            yield self._a
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._idle.notify_all()

    @contextlib.contextmanager
    def _alone(self) -> Iterator[_native.Handle]:
        """The native agent with no other call in progress: for what frees a
        peer, whose native pointer no other call may hold meanwhile."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            while self._users:
                self._idle.wait()
            yield self._a

    def close(self) -> None:
        """Stops the engine and frees everything.  Running transfers fail with
        TransferAbortedError.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._users:
                self._idle.wait()
        if self._discovery is not None:
            self._discovery.close()  # revokes the lease: peers see this agent go
        if self._metrics_server is not None:
            self._metrics_server.close()
        self._drain.close_agent()  # stops the log thread, then closes the native agent
        self._a = None
        self._regions.clear()
        with _live_lock:
            if _live_names.get(self.name) is self:
                del _live_names[self.name]

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Agent:
        if self._closed:
            raise self._closed_error()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise from a finaliser
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.addresses)} NICs"
        return f"Agent({self.name!r}, {state})"

    # ---- memory ----------------------------------------------------------

    def register(
        self,
        memory: Any,
        *,
        remote_read: bool = False,
        remote_write: bool = False,
        name: str | None = None,
    ) -> Region:
        """Registers host or GPU memory so transfers can read or write it.

        ``memory``: a C-contiguous numpy array, torch CPU or CUDA tensor, CUDA
        array (``__cuda_array_interface__``: CuPy, Numba, ...), DLPack tensor
        or "dltensor" capsule on the CPU or a CUDA device, or buffer-protocol
        object; it is kept alive until deregistered.  GPU memory needs the
        CUDA runtime (loaded on the first such registration) and moves through
        pinned host memory (docs/api.md, "GPU memory").  ``remote_read`` lets
        peers pull from it, ``remote_write`` lets peers push into it.
        ``name`` lets peers find it by name.

        Raises:
            RegistrationError: non-contiguous, empty, read-only with
                ``remote_write``, a meta tensor, not memory at all, or GPU
                memory without the CUDA runtime or not on the device its
                object names (nothing is registered then).
            ArgumentTypeError: ``remote_read`` or ``remote_write`` is not a
                bool, or ``name`` is not a str.
            InvalidArgumentError: duplicate or over-long ``name``.
            ClosedError: the agent is closed.
        """
        bool_arg("remote_read", remote_read)
        bool_arg("remote_write", remote_write)
        if name is not None and not isinstance(name, str):
            raise ArgumentTypeError(f"name: expected str, got {type(name).__name__}")
        span = as_span(memory, "memory")
        if span.readonly and remote_write:
            raise RegistrationError(
                "memory: the buffer is read-only, so remote_write=True cannot be honoured; "
                "register a writable buffer"
            )
        gpu = span.mem == MemoryType.CUDA
        if gpu:
            _cuda.ensure_runtime("memory")
        with self._using() as a:
            try:
                rid, device = _native.region_register(
                    a,
                    span.address,
                    span.nbytes,
                    remote_read=remote_read,
                    remote_write=remote_write,
                    readonly=span.readonly,
                    mem=span.mem,
                    name=name or "",
                    device=span.device,
                )
            except InvalidArgumentError as exc:
                if not gpu or "cuda" not in str(exc).lower():
                    raise
                raise RegistrationError(f"memory: {exc}") from exc
            bus, numa = _cuda.gpu_numa_node(device) if gpu else ("", -1)
            region = Region(
                id=rid,
                address=span.address,
                nbytes=span.nbytes,
                remote_read=remote_read,
                remote_write=remote_write,
                readonly=span.readonly,
                mem=span.mem,
                name=name or "",
                _keepalive=span.keepalive,
                device=device,
                pci_bus_id=bus,
                numa_node=numa,
            )
            self._regions.add(region)
        if self._discovery is not None and (remote_read or remote_write):
            self._discovery.republish(self)  # the record carries the new region's key
        return region

    def deregister(self, region: Region | int) -> None:
        """Removes a registration.

        Raises:
            ArgumentTypeError: ``region`` is neither a Region nor a region id.
            RegionBusyError: a transfer still uses it (nothing changed).
            UnknownRegionError: it is not registered here.
            ClosedError: the agent is closed.
        """
        if isinstance(region, Region):
            rid = region.id
            if self._regions.get(rid) is not region:
                raise UnknownRegionError(
                    f"region: {region!r} is not registered with agent {self.name!r} (deregistered "
                    "already, or registered with another agent)"
                )
        elif isinstance(region, int) and not isinstance(region, bool):
            rid = region
        else:
            raise ArgumentTypeError(
                f"region: expected the Region that register() returned or its id (int), got "
                f"{type(region).__name__}; agent.regions() lists what is registered"
            )
        with self._using() as a:
            _native.region_deregister(a, rid)
            self._regions.remove(rid)
        if self._discovery is not None:
            self._discovery.republish(self)

    def regions(self) -> list[Region]:
        """This agent's registered regions.

        Raises:
            ClosedError: the agent is closed.
        """
        with self._using():
            return self._regions.snapshot()

    def _locate(self, obj: Any, arg: str) -> tuple[int, int, int]:
        """(region id, offset, nbytes) of a local buffer or Region."""
        if isinstance(obj, Region):
            if self._regions.get(obj.id) is not obj:
                raise NotRegisteredError(
                    f"{arg}: region {obj.id} is not registered with agent {self.name!r}"
                )
            return obj.id, 0, obj.nbytes
        span = as_span(obj, arg)
        r = self._regions.containing(span.address, span.nbytes)
        if r is None:
            raise NotRegisteredError(
                f"{arg}: this buffer ({span.nbytes} bytes at {span.address:#x}) is not inside "
                f"any region registered with agent {self.name!r}; call agent.register() on it "
                "first"
            )
        return r.id, span.address - r.address, span.nbytes

    # ---- peers -----------------------------------------------------------

    def metadata(self) -> bytes:
        """What a peer needs to connect to this agent (pass to its ``add_peer``).

        Raises:
            ClosedError: the agent is closed.
        """
        ident = self._identity()
        relay = ident["relay"]
        extra: dict[str, Any] = {}
        if relay["e2e"]:
            # relayed paths end at the sealed ports, sealed under "e2e" (docs/relays.md);
            # whoever holds this metadata may open one, as with the region keys
            extra["e2e"] = relay["e2e"].hex()
            extra["sealed"] = [[h, p] for h, p in relay["sealed"]]
        if relay["relay"]:
            extra["relay"] = [[h, p] for h, p in relay["relay"]]
        return json.dumps(
            {
                "kvlink": METADATA_VERSION,
                "name": self.name,
                "instance": f"{self.instance_id:016x}",
                "addrs": [[h, p] for h, p in self.addresses],
                "keys": {str(rid): key.hex() for rid, key in ident["keys"].items()},
                # same-host copies (docs/ucx.md, "Same-host peers"): where this agent
                # runs, and whether it takes them
                "host": _host.host_id(),
                "pid": os.getpid(),
                "shm": self.config.transport != "tcp",
                **extra,
            }
        ).encode()

    def _identity(self) -> dict[str, Any]:
        """Instance, addresses and the access key of every exposed region:
        whoever holds the keys may write / read those regions (docs/security.md).

        Raises:
            ClosedError: the agent is closed.
        """
        with self._using() as a:
            keys = {
                r.id: _native.region_key(a, r.id)
                for r in self._regions.snapshot()
                if r.remote_read or r.remote_write
            }
            relay = _native.relay_info(a)
        return {
            "instance": self.instance_id,
            "addrs": list(self.addresses),
            "keys": keys,
            "relay": {
                "e2e": relay["e2e"] if relay["sealed_ports"] else None,
                # each list is empty when that side is off, else one port per address
                "sealed": [
                    (h, p) for (h, _), p in zip(self.addresses, relay["sealed_ports"], strict=False)
                ],
                "relay": list(zip(self._relay_addrs, relay["relay_ports"], strict=False)),
            },
        }

    def add_peer(self, metadata: bytes | str | dict[str, Any]) -> str:
        """Connects to a peer: a control connection plus one data connection per
        path, each with a versioned handshake.  Returns the peer's name.
        Adding the same peer again is a no-op.

        Raises:
            InvalidArgumentError: the metadata is malformed.
            DuplicateNameError: the peer has this agent's name, or another live
                agent already uses the peer's name.
            PeerUnreachableError: no path could connect.
            HandshakeError: the peer is not the agent the metadata names, or
                speaks another protocol version.
            ClosedError: the agent is closed.
        """
        if self._closed:
            raise self._closed_error()
        md = _parse_metadata(metadata)
        with self._using() as a:
            known = _native.peer_find(a, md["name"], missing_ok=True) is not None
            if not known:
                p = self._connect(a, md)
                self._take_keys(p, md)
        if known:
            # A restarted agent of that name replaces the old peer. Connecting takes up to
            # connect_timeout_s a path, so it runs beside every other call (the old peer is
            # only hidden meanwhile); freeing the old one needs no other call holding it:
            # that part alone keeps them out, and it is short.
            try:
                with self._using() as a:
                    p = self._connect(a, md, defer_retire=True)
                    self._take_keys(p, md)
            finally:
                with self._alone() as a:
                    _native.peer_retire_replaced(a)
        with self._lock:
            self._peer_md[md["name"]] = (md["instance"], tuple(md["addrs"]))
        return str(md["name"])

    def _connect(self, a: Any, md: dict[str, Any], defer_retire: bool = False) -> Any:
        """The peer of metadata ``md``, connected: directly on every path, and through every
        relay this agent knows that reaches it (docs/relays.md). ``defer_retire``: a peer of
        that name it replaces waits for ``_native.peer_retire_replaced``."""
        with self._relay_lock:
            relays = list(self._relays.values())
        local = [h for h, _ in self.addresses]
        hosts, routes = _relays.plan_routes(local, md, relays, self.name)
        if not any(r.via for r in routes):
            return _native.peer_connect(
                a, md["name"], md["instance"], md["addrs"], self._same_host(md), defer_retire
            )
        return _native.peer_connect_routes(
            a, md["name"], md["instance"], hosts, routes, md["e2e"], self._same_host(md),
            defer_retire,
        )

    def add_relay(self, metadata: bytes | str | dict[str, Any]) -> str:
        """Lets this agent route through the relay whose metadata this is (an agent started
        with ``Config(relay=True)``, or ``kvlink relay``): peers added from now on that the
        relay reaches get relayed paths through it besides the direct ones (docs/relays.md).
        Returns the relay's name.  Adding it again updates it.

        Raises:
            InvalidArgumentError: not the metadata of an agent that relays.
            ClosedError: the agent is closed.
        """
        if self._closed:
            raise self._closed_error()
        r = _relays.load_relay(metadata)
        with self._relay_lock:
            self._relays[r["name"]] = r
        return str(r["name"])

    def _discovered_relay(self, name: str, addrs: list[list[Any]]) -> None:
        """Discovery lists ``name`` as a relay at ``addrs``: route through it."""
        with self._relay_lock:
            known = self._relays.get(name)
        if known is None or [list(a) for a in known["relay"]] != addrs:
            with contextlib.suppress(KvlinkError):
                self.add_relay({"name": name, "relay": addrs})
                with self._relay_lock:
                    self._discovered_relays.add(name)

    def _forget_relays_except(self, listed: set[str]) -> None:
        """Relays discovery found earlier and lists no more are not routed through again."""
        with self._relay_lock:
            for name in self._discovered_relays - listed:
                self._relays.pop(name, None)
            self._discovered_relays &= listed

    def relays(self) -> list[str]:
        """The relays this agent routes through (names), sorted."""
        with self._relay_lock:
            return sorted(self._relays)

    def relay_stats(self) -> dict[str, int]:
        """This agent's relay, when it runs one (``Config(relay=True)``): relayed
        connections open now and ever, bytes forwarded (both ways), requests refused, and how
        often a lent NIC was taken back for this host's own traffic.

        Raises:
            ClosedError: the agent is closed.
        """
        with self._using() as a:
            info = _native.relay_info(a)
        return {
            k: int(info[k])
            for k in ("relayed_conns", "relayed_total", "relayed_bytes", "refused", "yields")
        }

    def _same_host(self, md: dict[str, Any]) -> bool:
        """Whether paths to the peer of metadata ``md`` may copy process to
        process: another process on this host (boot, PID and network namespace)
        that takes same-host copies and whose memory the OS lets this process
        read (ptrace rules: kvl_cma_allowed), and this agent's transport is not
        "tcp"."""
        return (
            self.config.transport != "tcp"
            and md["shm"]
            and bool(md["host"])
            and md["host"] == _host.host_id()
            and md["pid"] != os.getpid()
            and _native.cma_allowed(md["pid"])
        )

    @staticmethod
    def _take_keys(p: Any, md: dict[str, Any]) -> None:
        """The access keys of the peer's exposed regions, from its metadata."""
        for rid, key in md["keys"].items():
            _native.peer_set_key(p, md["name"], rid, key)

    def remove_peer(self, peer: str) -> None:
        """Forgets ``peer``: its running transfers fail with
        ConnectionLostError ("removed"), frames already queued are sent (up
        to ``close_linger_s``), its connections close and its memory is freed.
        Add it again (new metadata) to talk to it later.  Waits for calls in
        progress on this agent to finish first, so none uses the peer as it
        goes.

        Raises:
            UnknownPeerError: no peer of that name.
            InvalidArgumentError: ``peer`` is not a name.
            ClosedError: the agent is closed.
        """
        _peer_name(peer)
        with self._alone() as a:
            _native.peer_remove(a, peer)
            self._peer_md.pop(peer, None)
        if self._discovery is not None:
            self._discovery.forget(peer)

    def peers(self) -> list[PeerInfo]:
        """Every peer this agent knows: those discovery lists now (with
        ``Config(discovery=...)``) and those added, by hand or through
        discovery, sorted by name.

        Raises:
            ClosedError: the agent is closed.
        """
        with self._using():
            added = dict(self._peer_md)
        table = self._discovery.table() if self._discovery is not None else {}
        out = []
        for name in sorted(set(added) | set(table)):
            rec = table.get(name)
            instance, addrs = (rec.instance, rec.addrs) if rec is not None else added[name]
            out.append(PeerInfo(name, instance, addrs, rec is not None, name in added))
        return out

    @property
    def discovery(self) -> Any:
        """The agent's discovery (None with static exchange): ``url``,
        ``lease``, ``republished`` (times it re-published after etcd lost its
        record) and ``errors`` (failed rounds)."""
        return self._discovery

    def _ensure_peer(self, peer: str) -> None:
        """With discovery: connects to ``peer`` if it is not added yet.

        Raises:
            UnknownPeerError: discovery lists no agent of that name.
            DiscoveryError: etcd cannot be reached or holds a malformed record.
            PeerUnreachableError, HandshakeError: as add_peer.
        """
        d = self._discovery
        if d is None:
            return
        mine: list[PathInfo] = []
        with self._using() as a:
            known = _native.peer_find(a, peer, missing_ok=True) is not None
            if known and d.manages(peer):
                mine = [p for p in _native.paths(a) if p.peer == peer]
        if known:
            if mine and all(
                p.state in (PathState.DOWN, PathState.PROBING) for p in mine
            ):
                # every path down: it may have restarted since discovery's last round
                with self._discover_lock, contextlib.suppress(DiscoveryError):
                    d.reconnect_if_restarted(self, peer)
            return
        with self._discover_lock:  # one look-up per peer, however many threads push
            with self._using() as a:
                if _native.peer_find(a, peer, missing_ok=True) is not None:
                    return
            rec = d.lookup(peer)
            if rec is None:
                raise UnknownPeerError(
                    f"peer {peer!r}: not added, and discovery ({d.url}) lists no agent of that "
                    "name: is it running, with the same discovery URL and prefix?",
                    peer=peer,
                )
            d.connect(self, rec)

    def _refresh_keys(self, peer: str, exc: RemoteAccessError) -> None:
        """A submit lacked a region key of a discovered peer: read its record
        again (it may have registered the region since).

        Raises:
            RemoteAccessError: ``exc``, with the reason when no key can come.
        """
        d = self._discovery
        rec = d.lookup(peer) if d is not None else None
        if rec is None or rec.keys is None:
            why = (
                "this agent has no cluster secret, and discovery publishes region keys only "
                "sealed under it"
                if self.config.resolved_secret() is None
                else "the peer published no keys this agent can open (no secret there, or "
                "another one)"
            )
            raise RemoteAccessError(
                f"{exc} (discovery: {why}; docs/cluster.md)", code=exc.code, peer=peer
            ) from exc
        d.connect(self, rec)
    def remote_regions(self, peer: str, *, refresh: bool = False) -> list[RemoteRegion]:
        """Regions ``peer`` exposes, as of the handshake (``refresh`` asks again).

        Raises:
            UnknownPeerError: ``peer`` was not added.
            ArgumentTypeError: ``refresh`` is not a bool.
            PeerUnreachableError: the refresh got no answer.
            ClosedError: the agent is closed.
        """
        bool_arg("refresh", refresh)
        with self._using() as a:
            p = _native.peer_find(a, _peer_name(peer))
            if refresh:
                _native.peer_refresh(p, self.config.connect_timeout_s)
            return _native.peer_regions(p, peer)

    def prepare(
        self,
        peer: str,
        *,
        nbytes: int | None = None,
        layout: Any = None,
        timeout_s: float = 5.0,
    ) -> list[PathInfo]:
        """Pre-warm: readies ``peer`` for a transfer while its data is still being
        computed (call it when prefill starts).  Waits until every path to the
        peer is up (down paths are re-probed), refreshes the peer's region
        table, probes every path, and delivers a PREPARE notification with
        ``nbytes`` and ``layout`` (a :class:`kvlink.kv.PagedLayout` or a dict)
        so the peer can allocate and register the destination now.  Returns
        the peer's paths.

        Blocks: up to ``timeout_s`` for the paths (woken by the engine when a
        path changes state; with every path up it does not wait), then up to
        ``connect_timeout_s`` for the region table, asked again while
        ``timeout_s`` lasts when the control connection that carries it is
        still reconnecting.  When ``timeout_s`` passes with some paths up and
        others not, it goes on with those that are up.

        Raises:
            InvalidArgumentError: negative ``nbytes`` or ``timeout_s``, or an
                announcement over 4096 bytes of JSON.
            ArgumentTypeError: ``layout`` is not a PagedLayout, a JSON-able
                dict or None, or ``timeout_s`` is not a number.
            UnknownPeerError: ``peer`` was not added.
            PeerUnreachableError: no path came up within ``timeout_s``.
            ClosedError: the agent is closed.
        """
        _peer_name(peer)
        if nbytes is not None and (
            isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0
        ):
            raise int_error("nbytes", nbytes, "a non-negative int")
        timeout = timeout_arg(timeout_s, none_ok=False)
        tag = _prepare_tag(nbytes, layout)
        self._ensure_peer(peer)
        deadline = time.monotonic() + (timeout or 0.0)
        seen = 0  # the path table's generation this loop last looked at (0: none yet)
        while True:
            # the first call answers the current generation at once; later ones
            # sleep in the engine until a path changes state or the deadline
            left = max(0.0, deadline - time.monotonic()) if seen else 0.0
            seen = _native.paths_wait(self._using, seen, left) or seen
            mine = [p for p in self.paths() if p.peer == peer]
            if not mine:
                with self._using() as a:
                    _native.peer_find(a, peer)  # raises UnknownPeerError
            if mine and all(p.state in (PathState.UP, PathState.DEGRADED) for p in mine):
                break
            if time.monotonic() >= deadline:
                if any(p.state in (PathState.UP, PathState.DEGRADED) for p in mine):
                    break  # go with the paths that are up
                raise PeerUnreachableError(
                    f"prepare: no path to peer {peer!r} came up within {timeout_s} s: "
                    + "; ".join(
                        f"path {p.index} {p.local}->{p.remote}: {p.last_error}" for p in mine
                    ),
                    peer=peer,
                )
        while True:
            try:
                with self._using() as a:
                    p = _native.peer_find(a, peer)
                    _native.peer_refresh(p, self.config.connect_timeout_s)
                    _native.peer_send_prepare(p, peer, tag)
                break
            except PeerUnreachableError:
                # the control connection (which carries the refresh) may still be
                # reconnecting after the paths: its state change wakes this wait
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                seen = _native.paths_wait(self._using, seen, left) or seen
        return [p for p in self.paths() if p.peer == peer]

    # ---- transfers -------------------------------------------------------

    def push(
        self,
        peer: str,
        src: Any = None,
        dst: Any = None,
        *,
        nbytes: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        segments: Any = None,
        notify: bytes | None = None,
        timeout_s: float | None = None,
        instance: int | None = None,
    ) -> Transfer:
        """Writes local memory into a peer's region.

        Either ``src`` (a registered buffer or Region) and ``dst`` (the
        peer's region: RemoteRegion, id or name) with optional offsets and
        ``nbytes``, or ``segments`` (see :mod:`kvlink.kv`).  ``notify`` is
        delivered to the peer once every byte is verified there.

        Returns once the transfer is queued; it waits for the peer only when
        ``dst`` names a region the peer's table (as of the handshake) lacks:
        then the table is asked for again, up to ``connect_timeout_s``.

        Raises:
            InvalidArgumentError: a bad argument (named), a negative
                ``timeout_s``, or segments whose destinations overlap.
            ArgumentTypeError: ``timeout_s`` or ``notify`` of the wrong type.
            NotRegisteredError: ``src`` is not registered memory.
            SizeMismatchError: ``src`` and ``dst`` differ in size and no
                ``nbytes`` says how much to move.
            UnknownRegionError, OutOfBoundsError, RemoteAccessError: a segment
                does not fit or lacks ``remote_write`` (nothing is sent).
            UnknownPeerError: ``peer`` was not added.
            PeerUnreachableError: ``peer`` restarted (a reconnect met a new
                instance: add it again), or ``instance`` is given and ``peer`` is
                another instance now (the regions and contents the caller knew are
                gone), nothing sent; or the peer did not send its region table
                within ``connect_timeout_s``.  Every path being down is no error
                here: the transfer waits for one until its deadline (docs/api.md,
                "Every path down").
        """
        return self._submit(
            Op.PUSH, peer, src, dst, nbytes, src_offset, dst_offset, segments, notify, timeout_s,
            instance,
        )

    def pull(
        self,
        peer: str,
        src: Any = None,
        dst: Any = None,
        *,
        nbytes: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        segments: Any = None,
        notify: bytes | None = None,
        timeout_s: float | None = None,
        instance: int | None = None,
    ) -> Transfer:
        """Reads a peer's region (``src``) into local memory (``dst``).

        The mirror of :meth:`push`: the peer's region needs ``remote_read``.
        ``instance`` (both): move bytes only if ``peer`` is still that
        instance (``int`` of the metadata's ``instance``), the one whose
        contents the caller means: with discovery, a peer whose paths are all
        down is looked up again and may be replaced by its restarted instance.

        Raises:
            As :meth:`push`, with the roles of ``src`` and ``dst`` swapped.
        """
        return self._submit(
            Op.PULL, peer, src, dst, nbytes, src_offset, dst_offset, segments, notify, timeout_s,
            instance,
        )

    def _submit(
        self,
        op: Op,
        peer: str,
        src: Any,
        dst: Any,
        nbytes: int | None,
        src_offset: int,
        dst_offset: int,
        segments: Any,
        notify: bytes | None,
        timeout_s: float | None,
        instance: int | None = None,
    ) -> Transfer:
        _peer_name(peer)
        if instance is not None and (
            isinstance(instance, bool) or not isinstance(instance, int)
            or not 0 <= instance < 1 << 64
        ):
            raise int_error("instance", instance, "a peer's instance id (int of 64 bits)")
        if notify is not None and not isinstance(notify, (bytes, bytearray)):
            raise ArgumentTypeError(f"notify: expected bytes, got {type(notify).__name__}")
        tag = bytes(notify or b"")
        timeout = timeout_arg(timeout_s)
        deadline_s = self.config.transfer_timeout_s if timeout is None else timeout
        self._ensure_peer(peer)
        for attempt in range(2):
            try:
                with self._using() as a:
                    p = _native.peer_find(a, peer)
                    if instance is not None:
                        # Under _using() the peer cannot be replaced until this is submitted,
                        # and a replaced peer's transfers fail: the check holds for the transfer.
                        with self._lock:
                            now = self._peer_md.get(peer, (None, ()))[0]
                        if now != instance:
                            raise PeerUnreachableError(
                                f"peer {peer!r} is instance "
                                f"{'unknown' if now is None else format(now, '016x')} now, not "
                                f"{instance:016x}: it restarted, and what it held then is gone",
                                peer=peer,
                            )
                    if segments is not None:
                        if src is not None or dst is not None or nbytes is not None:
                            raise InvalidArgumentError(
                                "segments: pass either segments or src/dst/nbytes, not both"
                            )
                        segs = as_segment_array(segments)
                        _refuse_overlapping_destinations(segs)
                    else:
                        segs = self._simple_segment(
                            op, p, peer, src, dst, nbytes, src_offset, dst_offset
                        )
                    x = self._submit_native(a, p, peer, op, segs, tag, deadline_s)
                    t = Transfer(x, op, peer, int(segs["len"].sum()), self._why_gone,
                                 self._using)
                if self._metrics is not None:
                    self._metrics.track(t)  # once per transfer: nothing per chunk
                return t
            except RemoteAccessError as exc:
                # a discovered peer may have registered the region after we read its record
                if attempt or self._discovery is None or "no access key" not in str(exc):
                    raise
                self._refresh_keys(peer, exc)

        raise AssertionError("unreachable")  # pragma: no cover

    def _submit_native(
        self,
        a: _native.Handle,
        p: _native.Handle,
        peer: str,
        op: Op,
        segs: np.ndarray[Any, Any],
        tag: bytes,
        deadline_s: float,
    ) -> _native.Handle:
        """kvl_xfer_submit, which never waits for the peer: when the segments
        name a region the peer's table lacks (it may have registered it after
        the handshake), the table is refreshed here, in the caller's thread
        (up to ``connect_timeout_s``), and the transfer submitted once more.

        Raises:
            UnknownRegionError: the peer has no such region, even after the
                refresh (or a local region is unknown: no refresh then).
            PeerUnreachableError: the refresh got no answer.
        """
        try:
            return _native.xfer_submit(a, p, peer, op, segs, tag, deadline_s)
        except UnknownRegionError:
            remote = segs["dst_region"] if op == Op.PUSH else segs["src_region"]
            known = [r.id for r in _native.peer_regions(p, peer)]
            if not np.isin(remote, known).all():
                _native.peer_refresh(p, self.config.connect_timeout_s)
                return _native.xfer_submit(a, p, peer, op, segs, tag, deadline_s)
            raise  # the peer's table has them: a local region is unknown

    # ---- metrics ---------------------------------------------------------

    def metrics(self) -> Any:
        """This agent's Prometheus metrics, as a ``prometheus_client``
        collector read at scrape time: ``registry.register(agent.metrics())``
        in a process that serves its own registry (docs/cluster.md lists
        them).  The first call starts the accounting: transfers submitted
        before it are not counted.  Always the same object.

        Raises:
            ClosedError: the agent is closed.
        """
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._metrics is None:
                from ._metrics import AgentMetrics

                self._metrics = AgentMetrics(self)
                self._drain.on_record = self._metrics.on_log
            return self._metrics

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of the metrics server ``Config(metrics_port=...)``
        started (``http://host:port/metrics``), or None."""
        server = self._metrics_server
        return server.address if server is not None else None

    def _why_gone(self, peer: str) -> str | None:
        """Why discovery removed ``peer``, for the errors of its transfers."""
        return self._discovery.why_gone(peer) if self._discovery is not None else None

    def _simple_segment(
        self,
        op: Op,
        p: Any,
        peer: str,
        src: Any,
        dst: Any,
        nbytes: int | None,
        src_offset: int,
        dst_offset: int,
    ) -> np.ndarray[Any, Any]:
        if src is None or dst is None:
            raise InvalidArgumentError("src and dst are required unless segments= is given")
        for arg, v in (("src_offset", src_offset), ("dst_offset", dst_offset)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise int_error(arg, v, "a non-negative int")
        if nbytes is not None and (
            isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0
        ):
            raise int_error("nbytes", nbytes, "a positive int")
        local_arg, remote_arg = ("src", "dst") if op == Op.PUSH else ("dst", "src")
        local_obj, remote_obj = (src, dst) if op == Op.PUSH else (dst, src)
        local_off, remote_off = (
            (src_offset, dst_offset) if op == Op.PUSH else (dst_offset, src_offset)
        )
        lid, lbase, lsize = self._locate(local_obj, local_arg)
        remote = self._resolve_remote(p, peer, remote_obj, remote_arg)
        local_avail = lsize - local_off
        remote_avail = remote.nbytes - remote_off
        if local_avail <= 0:
            raise OutOfBoundsError(
                f"{local_arg}_offset: {local_off} is past the end ({lsize} bytes)"
            )
        if remote_avail <= 0:
            raise OutOfBoundsError(
                f"{remote_arg}_offset: {remote_off} is past the end of peer {peer!r} region "
                f"{remote.id} ({remote.nbytes} bytes)"
            )
        # The local buffer says how much to move unless nbytes does.
        want = local_avail if nbytes is None else nbytes
        if want > local_avail:
            raise SizeMismatchError(
                f"nbytes: {want} exceeds the {local_avail} bytes {local_arg} has"
            )
        if want > remote_avail:
            raise SizeMismatchError(
                f"size mismatch: moving {want} bytes but {remote_arg} (peer {peer!r} region "
                f"{remote.id}, {remote.nbytes} bytes) has only {remote_avail} from offset "
                f"{remote_off}; pass nbytes= to move a prefix"
            )
        nbytes = want
        seg = np.zeros(1, dtype=SEGMENT_DTYPE)
        if op == Op.PUSH:
            seg[0] = (lid, lbase + local_off, remote.id, remote_off, nbytes, 0, 0)
        else:
            seg[0] = (remote.id, remote_off, lid, lbase + local_off, nbytes, 0, 0)
        return seg

    def _resolve_remote(self, p: _native.Handle, peer: str, ref: Any, arg: str) -> RemoteRegion:
        if isinstance(ref, RemoteRegion):
            if ref.peer != peer:
                raise InvalidArgumentError(
                    f"{arg}: region belongs to peer {ref.peer!r}, not {peer!r}"
                )
            key: int | str = ref.id
        elif isinstance(ref, (int, str)) and not isinstance(ref, bool):
            key = ref
        else:
            raise ArgumentTypeError(
                f"{arg}: expected the peer's RemoteRegion, region id or region name, got "
                f"{type(ref).__name__} (local buffers go on the other side)"
            )
        for refresh in (False, True):
            if refresh:
                _native.peer_refresh(p, self.config.connect_timeout_s)
            for r in _native.peer_regions(p, peer):
                if r.id == key or (r.name and r.name == key):
                    return r
        raise UnknownRegionError(f"{arg}: peer {peer!r} has no region {key!r}", peer=peer)

    # ---- observation -----------------------------------------------------

    def inbound(self, tag: bytes | None = None, timeout_s: float | None = None) -> InboundTransfer:
        """The receiver's handle of a push arriving at this agent: the one
        whose notify tag is ``tag``, or the next one when ``tag`` is None (in
        the order they were announced).

        A push announces itself before its first chunk, so the handle is
        available from its first frame on: ``wait_layer(0)`` returns as soon
        as layer 0 is verified here while the rest is still in flight.  Each
        push is handed out once.  Handles nobody takes are kept (up to 1024,
        a finished one for 60 s).  The push's notification still arrives
        through :meth:`notifications`, once.

        Raises:
            InvalidArgumentError: ``tag`` is not bytes of at most 4096 bytes,
                or ``timeout_s`` is negative.
            TransferTimeoutError: no such push was announced within ``timeout_s``.
            ClosedError: the agent is (or was, meanwhile) closed.
        """
        if tag is not None and not isinstance(tag, (bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"tag: expected bytes or None, got {type(tag).__name__}")
        raw = bytes(tag) if tag is not None else None
        if raw is not None and len(raw) > _native.MAX_TAG_BYTES:
            raise InvalidArgumentError(
                f"tag: {len(raw)} bytes; notify tags are at most {_native.MAX_TAG_BYTES}"
            )
        timeout_arg(timeout_s)
        h = InboundTransfer(_native.inbound_next(self._using, raw, timeout_s))
        if self._metrics is not None:
            self._metrics.track_inbound(h)  # once per push: nothing per chunk
        return h

    def notifications(self, timeout_s: float = 0.0) -> list[Notification]:
        """Inbound notifications; waits up to ``timeout_s`` for the first one,
        then returns it with every other one already queued.

        Raises:
            ArgumentTypeError, InvalidArgumentError: ``timeout_s`` is not a
                non-negative number.
            ClosedError: the agent is closed.
        """
        deadline = time.monotonic() + (timeout_arg(timeout_s, none_ok=False) or 0.0)
        out: list[Notification] = []
        while True:
            left = max(0.0, deadline - time.monotonic()) if not out else 0.0
            with self._using() as a:
                n = _native.next_notification(a, left)
            if n is not None:
                out.append(n)
                if self._metrics is not None:
                    self._metrics.notified(n.peer)
                continue
            if out or time.monotonic() >= deadline:
                return out

    def inbound_stats(self) -> InboundStats:
        """What peers' pushes and notifications hold on this agent: each sender
        session's part is bounded (docs/security.md), refreshed every monitor
        interval.

        Raises:
            ClosedError: the agent is closed.
        """
        with self._using() as a:
            return _native.inbound_stats(a)

    def paths(self) -> list[PathInfo]:
        """Every path to every peer, with its live statistics.

        Raises:
            ClosedError: the agent is closed.
        """
        with self._using() as a:
            return self._with_transport(_native.paths(a))

    def _with_transport(self, paths: list[PathInfo]) -> list[PathInfo]:
        """Each path with the transport it runs and why (docs/ucx.md), and the
        NUMA node of its local NIC."""
        _, note = self._transport
        return [
            dataclasses.replace(
                p,
                transport_note=p.transport_note or note,
                numa_node=_local_numa_node(p.local),
            )
            for p in paths
        ]


@functools.lru_cache(maxsize=256)
def _local_numa_node(address: str) -> int:
    """NUMA node of the NIC holding a local address (sysfs, read once)."""
    return _cuda.address_numa_node(address.rsplit(":", 1)[0] if ":" in address else address)


def _peer_name(peer: Any) -> str:
    if not isinstance(peer, str):
        raise ArgumentTypeError(f"peer: expected the peer's name (a str), got {peer!r}")
    return peer


def _prepare_tag(nbytes: int | None, layout: Any) -> bytes:
    """The JSON a PREPARE notification carries.

    Raises:
        ArgumentTypeError: ``layout`` is not a PagedLayout, a JSON-able dict or None.
        InvalidArgumentError: the JSON is over 4096 bytes.
    """
    if isinstance(layout, PagedLayout):
        layout = layout.to_dict()
    elif layout is not None and not isinstance(layout, dict):
        raise ArgumentTypeError(
            f"layout: expected a kvlink.kv.PagedLayout, a dict or None, got {type(layout).__name__}"
        )
    try:
        tag = json.dumps({"nbytes": nbytes, "layout": layout}).encode()
    except (TypeError, ValueError) as exc:
        raise ArgumentTypeError(f"layout: the dict is not JSON-able ({exc})") from None
    if len(tag) > _native.MAX_TAG_BYTES:
        raise InvalidArgumentError(
            f"layout: the announcement is {len(tag)} bytes of JSON; at most "
            f"{_native.MAX_TAG_BYTES} fit in a notification"
        )
    return tag


def _refuse_overlapping_destinations(segs: np.ndarray[Any, Any]) -> None:
    """Two segments writing the same destination bytes would leave whichever
    chunk landed last: refuse them, naming both.

    Raises:
        InvalidArgumentError: two segments overlap in their destination region.
    """
    if len(segs) < 2:
        return
    order = np.lexsort((segs["dst_offset"], segs["dst_region"]))
    s = segs[order]
    # sorted by (region, start): if any two overlap, some neighbours do
    same = s["dst_region"][1:] == s["dst_region"][:-1]
    clash = np.flatnonzero(same & (s["dst_offset"][1:] < s["dst_offset"][:-1] + s["len"][:-1]))
    if clash.size:
        i, j = sorted((int(order[clash[0]]), int(order[clash[0] + 1])))

        def where(k: int) -> str:
            off, n, rid = (int(segs[f][k]) for f in ("dst_offset", "len", "dst_region"))
            return f"segments[{k}] (dst region {rid}, bytes [{off}, {off + n}))"

        raise InvalidArgumentError(
            f"segments: {where(i)} and {where(j)} overlap in the destination, so the result "
            "would depend on which chunk lands last; write each destination byte once"
        )


def _parse_metadata(metadata: bytes | str | dict[str, Any]) -> dict[str, Any]:
    if not isinstance(metadata, (bytes, str, dict)):
        raise ArgumentTypeError(
            f"metadata: expected the bytes of the peer's agent.metadata(), got "
            f"{type(metadata).__name__}"
        )
    try:
        md = json.loads(metadata) if isinstance(metadata, (bytes, str)) else dict(metadata)
    except (ValueError, TypeError) as exc:
        raise InvalidArgumentError(
            f"metadata: not kvlink agent metadata ({exc}); pass the bytes of the peer's "
            "agent.metadata()"
        ) from None
    if not isinstance(md, dict) or md.get("kvlink") != METADATA_VERSION:
        raise InvalidArgumentError(
            f"metadata: expected kvlink metadata version {METADATA_VERSION}, got "
            f"{md.get('kvlink') if isinstance(md, dict) else type(md).__name__!r}"
        )
    name = md.get("name")
    addrs = md.get("addrs")
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("metadata: 'name' is missing")
    if (
        not isinstance(addrs, list)
        or not addrs
        or not all(
            isinstance(x, list)
            and len(x) == 2
            and isinstance(x[0], str)
            and isinstance(x[1], int)
            and 0 < x[1] < 65536
            for x in addrs
        )
    ):
        raise InvalidArgumentError(
            f"metadata: 'addrs' must be a list of [host, port], got {addrs!r}"
        )
    try:
        instance = int(md.get("instance", "0"), 16)
    except (TypeError, ValueError):
        raise InvalidArgumentError("metadata: 'instance' is not a hex id") from None
    raw_keys = md.get("keys", {})
    keys: dict[int, bytes] = {}
    try:
        if not isinstance(raw_keys, dict):
            raise ValueError
        for rid, key in raw_keys.items():
            keys[int(rid)] = bytes.fromhex(key)
            if len(keys[int(rid)]) != 16 or int(rid) <= 0:
                raise ValueError
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            "metadata: 'keys' must map region ids to 32 hex digits (16-byte access keys), "
            f"got {raw_keys!r:.80}"
        ) from None
    host = md.get("host", "")
    if not isinstance(host, str) or len(host) > 256:
        raise InvalidArgumentError(
            f"metadata: 'host' must be the peer's host id (a str of at most 256 characters), "
            f"got {host!r:.80}"
        )
    pid = md.get("pid", 0)
    shm = md.get("shm", False)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0 or not isinstance(shm, bool):
        raise InvalidArgumentError(
            f"metadata: 'pid' must be a process id and 'shm' a bool, got {pid!r:.40} and "
            f"{shm!r:.20}"
        )
    return {
        "name": name,
        "addrs": [(h, p) for h, p in addrs],
        "instance": instance,
        "keys": keys,
        "host": host,
        "pid": pid,
        "shm": shm,
        **_relays.parse_relay_fields(md),
    }
