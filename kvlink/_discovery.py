"""Discovery through etcd: each agent publishes itself under a lease it keeps
alive, and finds its peers by name (docs/cluster.md).

Layout under the URL's prefix ``P`` (``etcd://host:2379/P``)::

    P/agents/<name>  ->  {"kvlink": 1, "name", "instance", "addrs", "sealed"?}

What goes to etcd is the agent's identity and addresses.  The region access
keys (which grant access to memory) go only sealed: AES-GCM under a key
derived from the cluster secret, bound to the record's name, instance and
prefix.  A reader of etcd without the secret learns addresses and region
ids, which a listener shows anyone anyway, and nothing that opens memory.
The secret itself is never written anywhere.  Without a secret no keys are
published: discovery then finds and connects peers, and the region keys
travel by hand (``add_peer(metadata)``), as with static exchange.

One daemon thread per agent renews the lease (every TTL/3), re-publishes
when etcd lost the lease or the key (an etcd restart without its data, a
keep-alive that came too late, someone deleting the key), and reads the
peer table every ``discovery_refresh_s``: a peer this agent connected
through discovery that restarted (new instance) is connected again, one
whose key stayed gone is removed.  Everything read from etcd is untrusted:
sizes and counts are bounded and every record is validated before use.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ._errors import ClosedError, ConfigError, DiscoveryError, KvlinkError, UnknownPeerError
from ._etcd import Etcd

if TYPE_CHECKING:
    from ._agent import Agent
    from ._config import Config

log = logging.getLogger("kvlink")

RECORD_VERSION = 1
DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/kvlink/"
# A record is a few hundred bytes plus ~60 per exposed region: 64 KiB holds
# ~1000 regions and keeps a full table read (MAX_PEERS records) under 512 MiB
# even from a hostile etcd (the HTTP layer stops reading at 48 MiB anyway).
MAX_RECORD_BYTES = 64 * 1024
MAX_PEERS = 4096  # records read per refresh; more are ignored (logged)
MAX_ADDRS = 64  # one per path: the C core's limit
MAX_ENDPOINTS = 16
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._\-/]{0,200}$")
_URL_HINT = (
    "expected etcd://HOST[:PORT][,HOST[:PORT]...][/PREFIX] (etcds:// for TLS), e.g. "
    "etcd://127.0.0.1:2379/kvlink"
)


@dataclass(frozen=True)
class DiscoveryUrl:
    endpoints: tuple[tuple[str, int], ...]
    prefix: str  # starts and ends with "/"
    tls: bool

    def __str__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"{'etcds' if self.tls else 'etcd'}://{hosts}{self.prefix.rstrip('/')}"


def parse_url(url: object, arg: str = "discovery") -> DiscoveryUrl:
    """The parts of a discovery URL.

    Raises:
        ConfigError: anything but etcd://HOST[:PORT][,...][/PREFIX], naming ``arg``.
    """
    if not isinstance(url, str):
        raise ConfigError(f"{arg}: {_URL_HINT}; got {url!r}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("etcd", "etcds"):
        raise ConfigError(f"{arg}: unknown scheme in {url!r}; {_URL_HINT}")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        raise ConfigError(
            f"{arg}: {url!r} carries credentials; URLs end up in logs, so pass them as "
            "discovery_user and discovery_password (KVLINK_DISCOVERY_PASSWORD) instead"
        )
    if "?" in rest or "#" in rest:
        raise ConfigError(f"{arg}: {url!r} has a query or fragment; {_URL_HINT}")
    hosts = [h for h in netloc.split(",")]
    if not netloc or len(hosts) > MAX_ENDPOINTS or any(not h for h in hosts):
        raise ConfigError(
            f"{arg}: no etcd host (or more than {MAX_ENDPOINTS}) in {url!r}; {_URL_HINT}"
        )
    endpoints = []
    for h in hosts:
        try:
            parts = urlsplit(f"//{h}")
            port = parts.port or DEFAULT_PORT
            host = parts.hostname
        except ValueError as exc:
            raise ConfigError(f"{arg}: bad host {h!r} in {url!r} ({exc}); {_URL_HINT}") from None
        if not host:
            raise ConfigError(f"{arg}: bad host {h!r} in {url!r}; {_URL_HINT}")
        endpoints.append((host, port))
    prefix = "/" + path.strip("/") + "/" if path.strip("/") else DEFAULT_PREFIX
    if not slash:
        prefix = DEFAULT_PREFIX
    if not _PREFIX_RE.match(prefix) or "//" in prefix:
        raise ConfigError(
            f"{arg}: prefix {prefix!r} in {url!r} may hold only letters, digits and . _ - / "
            "(200 at most, no empty segment)"
        )
    return DiscoveryUrl(tuple(endpoints), prefix, scheme == "etcds")


# ---- records -----------------------------------------------------------------


def _box(secret: bytes, prefix: str) -> Any:
    """The AEAD (AES-256-GCM) that seals region keys: its key is derived from
    the cluster secret for this purpose and prefix only, so it opens nothing
    else.  (cryptography is imported here: ~100 ms an agent without a secret
    need not pay.)"""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.hashes import SHA256
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    key = HKDF(
        algorithm=SHA256(), length=32, salt=b"kvlink discovery v1", info=prefix.encode()
    ).derive(secret)
    return AESGCM(key)


def _aad(name: str, instance: int, prefix: str) -> bytes:
    # binds the sealed keys to this record: pasted onto another agent's record
    # (or an older instance's) they do not open
    return f"{prefix}\0{name}\0{instance:016x}".encode()


@dataclass(frozen=True)
class PeerRecord:
    """A validated record read from etcd."""

    name: str
    instance: int
    addrs: tuple[tuple[str, int], ...]
    # region id -> access key; None: sealed under a secret this agent lacks
    # (or published without keys because the peer has no secret)
    keys: dict[int, bytes] | None = field(compare=True)
    # relays (docs/relays.md): the end-to-end key (sealed like the region keys), the sealed
    # ports relayed paths to it end at, and where it relays when it does
    e2e: bytes | None = None
    sealed_addrs: tuple[tuple[str, int], ...] = ()
    relay_addrs: tuple[tuple[str, int], ...] = ()

    def metadata(self) -> dict[str, Any]:
        """The dict ``Agent.add_peer`` takes."""
        md: dict[str, Any] = {
            "kvlink": 1,
            "name": self.name,
            "instance": f"{self.instance:016x}",
            "addrs": [[h, p] for h, p in self.addrs],
            "keys": {str(k): v.hex() for k, v in (self.keys or {}).items()},
        }
        if self.e2e and self.sealed_addrs:
            md["e2e"] = self.e2e.hex()
            md["sealed"] = [[h, p] for h, p in self.sealed_addrs]
        if self.relay_addrs:
            md["relay"] = [[h, p] for h, p in self.relay_addrs]
        return md


def make_record(
    name: str,
    instance: int,
    addrs: list[tuple[str, int]],
    keys: dict[int, bytes],
    secret: bytes | None,
    prefix: str,
    relay: dict[str, Any] | None = None,
) -> bytes:
    """The bytes an agent publishes (region keys sealed, or left out without a secret).
    ``relay``: its end-to-end key (sealed too), sealed ports and relay addresses."""
    rec: dict[str, Any] = {
        "kvlink": RECORD_VERSION,
        "name": name,
        "instance": f"{instance:016x}",
        "addrs": [[h, p] for h, p in addrs],
    }
    if secret is not None:
        plain = json.dumps({str(k): v.hex() for k, v in sorted(keys.items())}).encode()
        nonce = os.urandom(12)
        sealed = _box(secret, prefix).encrypt(nonce, plain, _aad(name, instance, prefix))
        rec["sealed"] = base64.b64encode(nonce + sealed).decode()
    relay = relay or {}
    if secret is not None and relay.get("e2e") and relay.get("sealed"):
        nonce = os.urandom(12)
        aad = _aad(name, instance, prefix) + b"\0e2e"
        sealed = _box(secret, prefix).encrypt(nonce, relay["e2e"], aad)
        rec["sealed_e2e"] = base64.b64encode(nonce + sealed).decode()
        rec["relay_in"] = [[h, p] for h, p in relay["sealed"]]
    if relay.get("relay"):
        rec["relay"] = [[h, p] for h, p in relay["relay"]]
    out = json.dumps(rec, separators=(",", ":")).encode()
    if len(out) > MAX_RECORD_BYTES:
        raise DiscoveryError(
            f"discovery: this agent's record is {len(out)} bytes (over {MAX_RECORD_BYTES}): "
            "too many regions exposed to peers; deregister some or expose fewer"
        )
    return out


def _valid_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and 0 < len(name.encode()) < 64
        and name.isprintable()
        and "/" not in name
    )


def parse_record(
    key_name: str, raw: bytes, secret: bytes | None, prefix: str, want_e2e: bool = True
) -> PeerRecord:
    """A record read from etcd, validated.  ``want_e2e``: unseal the end-to-end key too (an
    agent that relays never does: it has no business holding the keys that seal what it
    forwards, docs/security.md "Relays").

    Raises:
        ValueError: anything malformed, with the reason.
    """
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"{len(raw)} bytes, over {MAX_RECORD_BYTES}")
    try:
        rec = json.loads(raw)
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(rec, dict) or rec.get("kvlink") != RECORD_VERSION:
        raise ValueError(f"not a kvlink record of version {RECORD_VERSION}")
    name = rec.get("name")
    if name != key_name or not _valid_name(name):
        raise ValueError(f"names {name!r}, not the agent its key names")
    inst = rec.get("instance")
    if not isinstance(inst, str) or not re.fullmatch(r"[0-9a-f]{16}", inst):
        raise ValueError("'instance' is not 16 hex digits")
    instance = int(inst, 16)
    addrs = _addr_field(rec, "addrs", required=True)
    keys: dict[int, bytes] | None = None
    sealed = rec.get("sealed")
    if sealed is not None and secret is not None:
        from cryptography.exceptions import InvalidTag

        if not isinstance(sealed, str):
            raise ValueError("'sealed' is not base64 text")
        try:
            blob = base64.b64decode(sealed, validate=True)
            plain = _box(secret, prefix).decrypt(blob[:12], blob[12:], _aad(name, instance, prefix))
        except (ValueError, InvalidTag):
            # another cluster secret (the handshake will refuse it too), or tampered
            plain = None
        if plain is not None:
            table = json.loads(plain)
            keys = {}
            if not isinstance(table, dict):
                raise ValueError("sealed keys are not a table")
            for rid, key in table.items():
                k = bytes.fromhex(key) if isinstance(key, str) else b""
                if not rid.isdigit() or int(rid) <= 0 or len(k) != 16:
                    raise ValueError("sealed keys are not region ids to 16-byte keys")
                keys[int(rid)] = k
    e2e = None
    blob_text = rec.get("sealed_e2e")
    if isinstance(blob_text, str) and secret is not None and want_e2e:
        from cryptography.exceptions import InvalidTag

        try:
            blob = base64.b64decode(blob_text, validate=True)
            aad = _aad(name, instance, prefix) + b"\0e2e"
            e2e = _box(secret, prefix).decrypt(blob[:12], blob[12:], aad)
        except (ValueError, InvalidTag):
            e2e = None
        if e2e is not None and len(e2e) != 32:
            raise ValueError("the sealed end-to-end key is not 32 bytes")
    return PeerRecord(
        name,
        instance,
        addrs,
        keys,
        e2e,
        _addr_field(rec, "relay_in"),
        _addr_field(rec, "relay"),
    )


def _addr_field(
    rec: dict[str, Any], key: str, required: bool = False
) -> tuple[tuple[str, int], ...]:
    """A record's list of [host, port] under ``key``, validated: at most MAX_ADDRS entries,
    and at least one when ``required``.

    Raises:
        ValueError: malformed, naming the key.
    """
    raw = rec.get(key, None if required else [])
    lo = 1 if required else 0
    if not isinstance(raw, list) or not lo <= len(raw) <= MAX_ADDRS or not all(
        isinstance(a, list)
        and len(a) == 2
        and isinstance(a[0], str)
        and 0 < len(a[0]) <= 47
        and isinstance(a[1], int)
        and not isinstance(a[1], bool)
        and 0 < a[1] < 65536
        for a in raw
    ):
        raise ValueError(f"{key!r} is not a list of {lo}..{MAX_ADDRS} [host, port]")
    return tuple((h, p) for h, p in raw)


# ---- the agent's side ----------------------------------------------------------


class _DropEtcdRequests(logging.Filter):
    """httpx logs every request at INFO: a refresh a second per agent would
    flood an application's INFO log, so drop those of discovery's etcd only."""

    def __init__(self) -> None:
        super().__init__()
        self.hosts: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.levelno > logging.INFO or len(args) < 2:
            return True
        url = str(args[1])
        return not any(h in url for h in self.hosts)


_httpx_filter = _DropEtcdRequests()


def _quiet_httpx(url: DiscoveryUrl) -> None:
    if not _httpx_filter.hosts:
        logging.getLogger("httpx").addFilter(_httpx_filter)
    _httpx_filter.hosts.update(f"{h}:{p}/v3/" for h, p in url.endpoints)


class Discovery:
    """Publishes one agent and keeps its view of the others (see the module doc)."""

    def __init__(self, agent: Agent, cfg: Config, secret: bytes | None) -> None:
        assert cfg.discovery is not None
        self.url = parse_url(cfg.discovery)
        self._agent = weakref.ref(agent)
        self._name = agent.name
        self._secret = secret
        self._want_e2e = not cfg.relay  # a relay never unseals others' end-to-end keys
        self._ttl_s = max(1, round(cfg.discovery_ttl_s))
        self._refresh_s = cfg.discovery_refresh_s
        # a key absent this long is taken for gone: long enough for every agent
        # to re-publish after etcd lost its data (each notices within a refresh)
        self.grace_s = 3 * self._refresh_s + cfg.discovery_timeout_s
        _quiet_httpx(self.url)
        try:
            self._etcd = Etcd(
                self.url.endpoints,
                tls=self.url.tls,
                timeout_s=cfg.discovery_timeout_s,
                ca_file=cfg.discovery_ca_file,
                cert_file=cfg.discovery_cert_file,
                key_file=cfg.discovery_key_file,
                user=cfg.discovery_user,
                password=cfg.discovery_password,
            )
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise ConfigError(
                f"discovery_ca_file / discovery_cert_file / discovery_key_file: cannot set up "
                f"TLS to etcd ({exc}); give PEM files of a CA, a certificate and its key"
            ) from exc
        self._dir = f"{self.url.prefix}agents/"
        self._key = (self._dir + self._name).encode()
        self._lock = threading.Lock()
        self._seen: dict[str, PeerRecord] = {}  # the last table read
        self._missing: dict[str, float] = {}  # managed peer -> monotonic time first missed
        self._managed: dict[str, PeerRecord] = {}  # peers connected through discovery
        self._gone: dict[str, str] = {}  # peers removed by discovery -> why
        self._lease = 0
        self._published: bytes | None = None
        self._pub_lock = threading.Lock()  # one writer of the record at a time
        self._pub_gen = 0  # records written so far
        self._dirty = True
        self._next_keepalive = 0.0
        self._stop = False
        self._wake = threading.Event()
        self._failing = False
        self.republished = 0  # times the record was written again after etcd lost it
        self.published_at = 0.0  # time.monotonic() of the last write
        self.errors = 0
        self.removed = 0  # peers removed because their record stayed gone
        self.rounds = 0  # rounds done: etcd read and the peer table reconciled with it
        self._thread = threading.Thread(
            target=self._run, name=f"kvlink-discovery-{self._name}", daemon=True
        )
        try:
            self._tick()  # publish now, so peers can find us as soon as Agent() returns
        except DiscoveryError as exc:
            self._fail(exc)
        self._thread.start()

    # ---- the thread ------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self._refresh_s)
            self._wake.clear()
            if self._stop:
                break
            try:
                self._tick()
            except DiscoveryError as exc:
                self._fail(exc)
            except KvlinkError as exc:  # the agent closed meanwhile, a peer refused ...
                log.debug("discovery: %s", exc)
            except Exception:  # never let the thread die silently
                log.exception("discovery: unexpected error (the thread goes on)")
            else:
                if self._failing:
                    self._failing = False
                    log.warning("discovery: etcd %s answers again", self.url)

    def _fail(self, exc: DiscoveryError) -> None:
        self.errors += 1
        if not self._failing:
            self._failing = True
            log.warning(
                "discovery: %s; agent %r retries every %g s (static peers keep working)",
                exc,
                self._name,
                self._refresh_s,
            )

    def _tick(self) -> None:
        agent = self._agent()
        if agent is None or agent.closed:
            return
        now = time.monotonic()
        if self._lease == 0:
            self._lease = self._etcd.grant(self._ttl_s)
            self._next_keepalive = now + self._ttl_s / 3
            self._dirty = True
        elif now >= self._next_keepalive:
            if self._etcd.keepalive(self._lease) == 0:
                log.warning(
                    "discovery: etcd no longer has agent %r's lease (restarted without its "
                    "data, or the keep-alive came too late); re-publishing",
                    self._name,
                )
                self.republished += 1
                self._lease = self._etcd.grant(self._ttl_s)
                self._dirty = True
            self._next_keepalive = now + self._ttl_s / 3
        if self._dirty:
            self._publish(agent)
        gen = self._pub_gen
        kvs, more = self._etcd.range_prefix(self._dir.encode(), MAX_PEERS)
        if more:
            log.warning(
                "discovery: more than %d agents under %s; the rest are ignored",
                MAX_PEERS,
                self._dir,
            )
        table: dict[str, PeerRecord] = {}
        mine = None
        for kv in kvs:
            try:
                key_name = kv.key.decode()[len(self._dir) :]
            except UnicodeDecodeError:
                continue
            if key_name == self._name:
                mine = kv
                continue
            if not _valid_name(key_name):
                continue
            try:
                table[key_name] = parse_record(
                    key_name, kv.value, self._secret, self.url.prefix, self._want_e2e
                )
            except ValueError as exc:
                log.debug("discovery: ignoring the record of %r: %s", key_name, exc)
        lost = mine is None or mine.value != self._published or mine.lease != self._lease
        if lost and gen == self._pub_gen:  # (not a record written since the read began)
            # etcd lost our key (restart without data) or someone overwrote it
            log.warning(
                "discovery: agent %r's record is gone from etcd or changed; re-publishing",
                self._name,
            )
            self.republished += 1
            self._publish(agent)
        self._reconcile(agent, table, now)
        self.rounds += 1

    def _publish(self, agent: Agent) -> None:
        with self._pub_lock:
            self._dirty = False  # a change from here on asks for another write
            md = agent._identity()
            value = make_record(
                self._name,
                md["instance"],
                md["addrs"],
                md["keys"],
                self._secret,
                self.url.prefix,
                md.get("relay"),
            )
            try:
                self._etcd.put(self._key, value, self._lease)
            except DiscoveryError as exc:
                self._dirty = True
                if "lease not found" in str(exc):
                    self._lease = 0  # granted again at the next tick
                    self._wake.set()
                raise
            self._published = value
            self._pub_gen += 1
            self.published_at = time.monotonic()

    def _reconcile(self, agent: Agent, table: dict[str, PeerRecord], now: float) -> None:
        with self._lock:
            self._seen = table
            managed = dict(self._managed)
        # members that relay: routed through from the next add_peer on (docs/relays.md)
        for member in table.values():
            if member.relay_addrs and member.name != self._name:
                agent._discovered_relay(member.name, [list(a) for a in member.relay_addrs])
        agent._forget_relays_except({r.name for r in table.values() if r.relay_addrs})
        for name, had in managed.items():
            rec = table.get(name)
            if rec is None:
                since = self._missing.setdefault(name, now)
                if now - since >= self.grace_s:
                    self._drop(
                        agent,
                        name,
                        "its discovery lease expired (the agent stopped "
                        "renewing it, or was removed from etcd)",
                    )
                continue
            self._missing.pop(name, None)
            if rec == had:
                continue
            restarted = rec.instance != had.instance
            if restarted:
                log.info(
                    "discovery: peer %r restarted (instance %016x -> %016x); connecting "
                    "to the new one",
                    name,
                    had.instance,
                    rec.instance,
                )
            try:  # new instance, or new regions (keys) or addresses to record
                self.connect(agent, rec)
            except ClosedError:
                raise
            except KvlinkError as exc:
                # the old instance's paths may still be going down, or the new one is not
                # listening yet: the next round tries again (one peer never stops the others)
                log.log(
                    logging.WARNING if restarted else logging.DEBUG,
                    "discovery: cannot connect to peer %r yet: %s",
                    name,
                    exc,
                )

    def _drop(self, agent: Agent, name: str, why: str) -> None:
        log.warning("discovery: removing peer %r: %s", name, why)
        self.removed += 1
        with self._lock:
            self._managed.pop(name, None)
            self._gone[name] = why
        self._missing.pop(name, None)
        with contextlib.suppress(UnknownPeerError):
            agent.remove_peer(name)

    # ---- what the agent asks -----------------------------------------------

    def republish(self, agent: Agent) -> None:
        """The record changed (a region was registered or deregistered): write
        it now, so a peer that hears of the region from us finds its key in
        etcd; the thread retries when etcd does not answer (and while etcd is
        known to be away, only the thread tries, so register() does not wait)."""
        self._dirty = True
        if self._failing or self._lease == 0:
            self._wake.set()
            return
        try:
            self._publish(agent)
        except DiscoveryError as exc:
            self._fail(exc)
            self._wake.set()

    def lookup(self, name: str) -> PeerRecord | None:
        """``name``'s record, read from etcd now.

        Raises:
            DiscoveryError: etcd cannot be reached, or holds a malformed record.
        """
        if not _valid_name(name):
            return None
        kv = self._etcd.get((self._dir + name).encode())
        if kv is None:
            return None
        try:
            return parse_record(name, kv.value, self._secret, self.url.prefix, self._want_e2e)
        except ValueError as exc:
            raise DiscoveryError(
                f"discovery: etcd {self.url} holds a malformed record for {name!r} ({exc}); "
                "delete it, or restart that agent"
            ) from None

    def connect(self, agent: Agent, rec: PeerRecord) -> None:
        """Adds (or updates) ``rec``'s peer and watches it from now on."""
        agent.add_peer(rec.metadata())
        with self._lock:
            self._managed[rec.name] = rec
            self._seen[rec.name] = rec
            self._gone.pop(rec.name, None)

    def reconnect_if_restarted(self, agent: Agent, name: str) -> bool:
        """For a submit that found every path to ``name`` down: if etcd now
        lists another instance of it, connect to that one (True).

        Raises:
            DiscoveryError: etcd cannot be reached or holds a malformed record.
            PeerUnreachableError, HandshakeError, DuplicateNameError: as add_peer.
        """
        with self._lock:
            had = self._managed.get(name)
        if had is None:
            return False
        rec = self.lookup(name)
        if rec is None or rec.instance == had.instance:
            return False
        log.info("discovery: peer %r restarted (instance %016x -> %016x); connecting to the new "
                 "one", name, had.instance, rec.instance)
        self.connect(agent, rec)
        return True

    def manages(self, name: str) -> bool:
        """Whether discovery connected ``name`` (and so follows its restarts)."""
        with self._lock:
            return name in self._managed

    def forget(self, name: str) -> None:
        """The application removed ``name`` itself: stop managing it."""
        with self._lock:
            self._managed.pop(name, None)
        self._missing.pop(name, None)

    def why_gone(self, name: str) -> str | None:
        with self._lock:
            return self._gone.get(name)

    def table(self) -> dict[str, PeerRecord]:
        with self._lock:
            return dict(self._seen)

    def has_keys(self, name: str) -> bool:
        with self._lock:
            rec = self._managed.get(name)
        return rec is not None and rec.keys is not None

    @property
    def etcd(self) -> Etcd:
        """The etcd client (thread-safe), shared with the KV store's index."""
        return self._etcd

    @property
    def lease(self) -> int:
        return self._lease

    def close(self) -> None:
        """Stops the thread and revokes the lease (peers see this agent gone
        at their next refresh).  Bounded by the request timeout."""
        self._stop = True
        self._wake.set()
        # at interpreter exit the daemon thread is frozen: joining would never return
        if (
            threading.current_thread() is not self._thread
            and self._thread.is_alive()
            and not sys.is_finalizing()
        ):
            self._thread.join()
        if self._lease:
            try:
                self._etcd.revoke(self._lease)
            except DiscoveryError as exc:
                log.debug("discovery: revoking the lease at close: %s", exc)
            self._lease = 0
        self._etcd.close()
