"""Agent configuration: a frozen, validated dataclass.

Precedence: explicit arguments > config file > ``KVLINK_*`` environment >
defaults.  The C core reads no environment; this module builds its struct.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from . import _nics
from ._errors import ConfigError
from ._units import parse_size

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Config.transport values (docs/ucx.md); "fault" is for tests only (Config.fault_mover)
_TRANSPORTS = ("auto", "tcp", "ucx", "fault")

# Config.fault_mover keys (csrc/transport/fault/fault.c): rates 0..1, times in ms, the seed
_FAULT_RATES = ("drop", "corrupt", "dup", "late", "delay")
_FAULT_MS = ("delay_ms", "dup_ms", "late_ms")
_FAULT_SPEC_MAX = 127  # bytes: kvl_config.fault_spec

# KVLINK_* variables that are not Config fields (read by the test suite, the CLI and
# the build: docs/install.md); any other KVLINK_* name is taken for a typo and warned
# about.
OTHER_ENV_VARS = frozenset({
    "KVLINK_REQUIRE_ALL", "KVLINK_PEERS_DIR", "KVLINK_SECRET_FILE",
    "KVLINK_WERROR", "KVLINK_BUILD_UCX", "KVLINK_BUILD_URING",  # kvlink/_ffi_build.py
    "KVLINK_PHASE_TIMES", "KVLINK_TEST_MLA_BF16", "KVLINK_TEST_ZYGOTE",  # make test, tests/vllm
})

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Scheduler(Enum):
    """Which path gets the next chunk."""

    # the path that would finish it first, from its measured rate and backlog
    EARLIEST_FINISH = "earliest_finish"
    # paths in turn: a static baseline for benchmarks, never a good choice on
    # uneven paths
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True)
class Config:
    """How an :class:`~kvlink.Agent` listens, chunks and schedules.

    Fields ending in ``_bytes`` also accept size strings such as ``"64MiB"``
    (as ``KVLINK_*`` variables and config files do).

    Raises:
        ConfigError: at construction, naming the field and the fix.
    """

    # Which local NICs to use: "auto" (every up IPv4 interface but loopback),
    # "loopback:N" (N paths on 127.0.0.1..N, no root needed), or a list or
    # comma-separated string of interface names and IPv4 addresses (checked
    # against this host's interfaces at construction).
    nics: str | tuple[str, ...] = "auto"
    # 0 = an ephemeral port per address: metadata carries the real ones.
    port: int = 0
    # 64 MiB amortises per-chunk costs to noise while keeping retries cheap.
    chunk_bytes: int = 64 * MiB
    # Below 1 MiB per chunk the per-chunk round trip starts to show on
    # loopback (docs/BENCHMARKS.md, chunk-size sweep).
    min_chunk_bytes: int = 1 * MiB
    # Connect + handshake per connection; generous for loaded hosts.
    connect_timeout_s: float = 5.0
    # The engine's tick: deadlines, stats, handshake expiry (and the path
    # monitor's sampling period).
    monitor_interval_ms: int = 100
    # Copies of one chunk lost to errors before the transfer fails.
    max_attempts: int = 4
    # A busy path without progress for max(3 ticks, stall_factor x its
    # expected chunk time) is cut and its chunks re-queued: 4 leaves room for
    # a path that is merely slow, which the scheduler handles by its rate.
    stall_factor: int = 4
    # Down paths are re-probed after 100 ms, doubling up to this: a link that
    # comes back is in service again within ~2 s without flooding a dead one.
    probe_backoff_max_ms: int = 2000
    # Copy straggling chunks onto idle paths at the end of a transfer.
    hedge: bool = True
    # Earliest finish uses every path by its measured rate; round robin is a
    # benchmark baseline.  Also accepts the names "earliest_finish" and
    # "round_robin".
    scheduler: Scheduler = Scheduler.EARLIEST_FINISH
    # Two chunks in flight per path keep the pipe full across the ack.
    window_chunks: int = 2
    # ...or this many bytes, so small chunks still fill a fast path.
    window_bytes: int = 16 * MiB
    # 0 keeps kernel socket-buffer autotuning, which measured best here.
    sock_buf_bytes: int = 0
    # Default deadline of one transfer (0 = none).
    transfer_timeout_s: float = 60.0
    # close() waits up to this for queued frames to leave and notifications
    # to be acknowledged: long enough for a loaded host, short enough that a
    # dead peer does not hold close() up noticeably.
    close_linger_s: float = 2.0
    # The cluster secret every agent of a deployment shares (16..256 bytes):
    # each connection then proves that both ends hold it (docs/security.md).
    # None takes KVLINK_SECRET, or the file named by KVLINK_SECRET_FILE, from
    # the environment when the agent starts.  Never printed.
    secret: str | bytes | None = field(default=None, repr=False)
    # Without a secret an agent listens on loopback addresses only; True
    # allows other addresses (a trusted, isolated network), with a warning.
    allow_unauthenticated: bool = False
    # Accepted connections alive at once, from all peers together: each peer
    # opens one control connection plus one per path, so 16384 serves ~1800
    # peers with 8 paths each.  More are closed at accept (and logged); keep
    # it below the process's file-descriptor limit (ulimit -n).
    max_connections: int = 16384
    # An admitted connection that carried no frame for this long, with nothing
    # in flight, is closed (0: never): a live agent pings every connection it
    # holds every 5 monitor ticks, so 5 minutes of silence is a peer that
    # stopped or forgot it, holding a slot of max_connections; a live one
    # reconnects on demand (docs/security.md).
    idle_conn_timeout_s: float = 300.0
    # Threads that move payload bytes and compute their crc32c, beside the
    # engine thread that schedules (docs/architecture.md, threading model).
    # "auto": one per path up to half the usable cores (at most 16), and none
    # on hosts with fewer than 4 cores, where the engine thread of each side
    # already has a core of its own.  0: all I/O on the engine thread.
    io_threads: int | str = "auto"
    # What carries each data path's payloads (docs/architecture.md, "The
    # transport interface").  "auto": TCP, and same-host copies ("shm") to a
    # peer in another process on this host; the safe default everywhere.
    # "tcp": payloads always in the TCP stream.  "ucx": UCX puts on every path
    # whose peer accepts the set-up (needs a cluster secret and libucp:
    # docs/ucx.md), TCP elsewhere, shm to a same-host peer.
    transport: str = "auto"
    # Tests only, with transport="fault" (never for data that matters): what
    # goes wrong with the fault-injecting mover's writes, a one-sided mover whose
    # puts are memcpy's between two agents of one process.  Comma-separated:
    # drop, corrupt, dup, late, delay (rates 0..1 per write), delay_ms, dup_ms,
    # late_ms (times), seed, e.g. "drop=0.1,corrupt=0.05,dup=0.2,delay_ms=20,seed=7"
    # (docs/architecture.md, "The transport interface").  "": no faults.
    fault_mover: str = ""
    # Chunk size cap of transfers whose payloads are staged through host
    # memory (GPU memory over TCP, stage_host_memory): 16 MiB keeps a chunk's
    # device<->host copy short against its socket time, so copies on some
    # paths overlap sends on others (docs/api.md, "GPU memory").
    gpu_chunk_bytes: int = 16 * MiB
    # Idle staging slots (pinned host memory) kept for reuse, per agent:
    # pinned allocations take milliseconds, so slots are recycled; 256 MiB
    # keeps 16 slots of the default gpu_chunk_bytes (8 paths, both
    # directions).  Slots in use are bounded apart: two per data connection.
    gpu_staging_bytes: int = 256 * MiB
    # Debug/test knob, off by default: route host regions through the staging
    # path that GPU memory takes (memcpy instead of cudaMemcpy): for tests
    # and for measuring staging overhead.  Never needed for correctness.
    stage_host_memory: bool = False
    # Where agents find each other.  None: static exchange (pass metadata()
    # to add_peer yourself).  "etcd://HOST[:PORT][,HOST[:PORT]...][/PREFIX]"
    # (etcds:// for TLS): publish this agent there under a lease and look
    # peers up by name (docs/cluster.md).
    discovery: str | None = None
    # A stopped agent disappears from discovery this long after its last
    # keep-alive (renewed every third of it): long enough to ride out a
    # loaded host or an etcd leader election, short enough to drop a dead peer.
    discovery_ttl_s: float = 10.0
    # How often the peer table is read (restarts and expiries are noticed
    # within this, plus a grace of 3 refreshes before a peer is removed).
    discovery_refresh_s: float = 1.0
    # One etcd request (connect + answer); etcd answers in milliseconds.
    discovery_timeout_s: float = 2.0
    # TLS to etcd (etcds://): the CA to trust, and a client certificate.
    discovery_ca_file: str | None = None
    discovery_cert_file: str | None = None
    discovery_key_file: str | None = None
    # etcd authentication (etcd's own users, not the cluster secret); the
    # password is never printed.
    discovery_user: str | None = None
    discovery_password: str | None = field(default=None, repr=False)
    # Serve Prometheus metrics over HTTP on this port (0: any free port,
    # Agent.metrics_address says which).  None: no server; Agent.metrics()
    # still gives them to a host process's own registry.
    metrics_port: int | None = None
    # Loopback by default: the metrics name peers and addresses, which is
    # for operators, not for every host that can reach this one.
    metrics_host: str = "127.0.0.1"
    # Relays (docs/relays.md): this agent forwards relayed connections for
    # cluster members over its idle NICs (a `kvlink relay` daemon is an agent
    # with only this).  Off by default: lending NICs is the operator's call.
    relay: bool = False
    # The NICs it lends (as `nics` takes them); "": every NIC of `nics`.
    relay_nics: str | tuple[str, ...] = ""
    # The relay's port on each lent address; 0 = an ephemeral one (metadata
    # carries it).
    relay_port: int = 0
    # Traffic of this host's own (not relayed) above this on a lent NIC
    # takes the NIC back at once: relayed connections through it are reset
    # (their chunks go again on the senders' other paths) and new ones are
    # refused until it has been quiet for a second.  0: never take it back.
    relay_yield_mbps: int = 100
    # Relayed connections at once: each holds 2 MiB of pipes in the kernel and six file
    # descriptors (two sockets, two pipes), so 128 fits under the usual 1024-descriptor limit.
    relay_max_conns: int = 128
    # Relays this agent may route through: each an agent's metadata (JSON
    # text) or the path of a file holding it; a comma-separated string of
    # paths works too (KVLINK_RELAYS).  With discovery, members that relay
    # are found there as well.  add_relay() adds more at run time.
    relays: str | tuple[str, ...] = ()
    # Accept relayed connections (a sealed port per address, in metadata):
    # peers may then reach this agent through relays.
    accept_relayed: bool = True

    def __post_init__(self) -> None:
        nics = self.nics
        if isinstance(nics, str):
            pass
        elif isinstance(nics, Sequence) and all(isinstance(n, str) for n in nics):
            object.__setattr__(self, "nics", tuple(nics))
            if not nics:
                raise ConfigError("nics: the list is empty; give at least one NIC or 'auto'")
        else:
            raise ConfigError(
                f"nics: expected 'auto', 'loopback:N' or a list of names, got {nics!r}"
            )
        _nics.resolve(self.nics)
        for f in _FIELDS:
            value = getattr(self, f)
            if f.endswith("_bytes") and isinstance(value, str):
                object.__setattr__(self, f, _size(f, value))
        _int_range("port", self.port, 0, 65535)
        _int_range("chunk_bytes", self.chunk_bytes, 4 * KiB, 1 * GiB)
        _int_range("min_chunk_bytes", self.min_chunk_bytes, 1, self.chunk_bytes)
        _int_range("monitor_interval_ms", self.monitor_interval_ms, 1, 60_000)
        _int_range("max_attempts", self.max_attempts, 1, 255)
        _int_range("stall_factor", self.stall_factor, 1, 1000)
        _int_range("probe_backoff_max_ms", self.probe_backoff_max_ms, 100, 600_000)
        if not isinstance(self.hedge, bool):
            raise ConfigError(f"hedge: expected True or False, got {self.hedge!r}")
        object.__setattr__(self, "scheduler", _scheduler(self.scheduler))
        _int_range("window_chunks", self.window_chunks, 1, 1024)
        _int_range("window_bytes", self.window_bytes, 0, 16 * GiB)
        _int_range("sock_buf_bytes", self.sock_buf_bytes, 0, 1 * GiB)
        _float_range("connect_timeout_s", self.connect_timeout_s, 0.001, 3600.0)
        _float_range("transfer_timeout_s", self.transfer_timeout_s, 0.0, 7 * 86400.0)
        _float_range("close_linger_s", self.close_linger_s, 0.0, 60.0)
        _int_range("max_connections", self.max_connections, 1, 1 << 20)
        _float_range("idle_conn_timeout_s", self.idle_conn_timeout_s, 0.0, 86400.0)
        ping_s = 5 * self.monitor_interval_ms / 1000
        if 0 < self.idle_conn_timeout_s < max(1.0, 2 * ping_s):
            raise ConfigError(
                f"idle_conn_timeout_s: {self.idle_conn_timeout_s} s would close live peers' "
                f"connections between their pings (every {ping_s:g} s): give 0 (never) or at "
                f"least {max(1.0, 2 * ping_s):g} s"
            )
        io = self.io_threads
        if isinstance(io, str) and io.strip().isdigit():
            object.__setattr__(self, "io_threads", int(io))
        elif isinstance(io, str) and io.strip().lower() == "auto":
            object.__setattr__(self, "io_threads", "auto")
        elif isinstance(io, str):
            raise ConfigError(f"io_threads: expected 'auto' or a count 0..64, got {io!r}")
        else:
            _int_range("io_threads", io, 0, 64)
        _int_range("gpu_chunk_bytes", self.gpu_chunk_bytes, 4 * KiB, 1 * GiB)
        _int_range("gpu_staging_bytes", self.gpu_staging_bytes, 0, 1024 * GiB)
        if not isinstance(self.stage_host_memory, bool):
            raise ConfigError(
                f"stage_host_memory: expected True or False, got {self.stage_host_memory!r}"
            )
        tp = self.transport
        if not isinstance(tp, str) or tp.strip().lower() not in _TRANSPORTS:
            raise ConfigError(f"transport: expected one of {', '.join(_TRANSPORTS)}, got {tp!r}")
        object.__setattr__(self, "transport", tp.strip().lower())
        _check_fault_mover(self.fault_mover, self.transport)
        if self.secret is not None:
            _check_secret("secret", self.secret)
        if self.discovery is not None:
            from ._discovery import parse_url  # cryptography loads only when asked for

            parse_url(self.discovery)
        _float_range("discovery_ttl_s", self.discovery_ttl_s, 2.0, 3600.0)
        _float_range("discovery_refresh_s", self.discovery_refresh_s, 0.05, 600.0)
        _float_range("discovery_timeout_s", self.discovery_timeout_s, 0.05, 60.0)
        if self.discovery_refresh_s > self.discovery_ttl_s / 2:
            raise ConfigError(
                f"discovery_refresh_s: {self.discovery_refresh_s} s is more than half of "
                f"discovery_ttl_s ({self.discovery_ttl_s} s); a peer's expiry would be noticed "
                "too late: make it smaller or the TTL longer"
            )
        for name in ("discovery_ca_file", "discovery_cert_file", "discovery_key_file"):
            path = getattr(self, name)
            if path is not None and (not isinstance(path, str) or not os.path.isfile(path)):
                raise ConfigError(f"{name}: {path!r} is not a readable file")
        if self.discovery_key_file is not None and self.discovery_cert_file is None:
            raise ConfigError("discovery_key_file: given without discovery_cert_file")
        for name in ("discovery_user", "discovery_password"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"{name}: expected str or None, got {type(v).__name__}")
        if (self.discovery_user is None) != (self.discovery_password is None):
            raise ConfigError(
                "discovery_user: etcd authentication needs both discovery_user and "
                "discovery_password (KVLINK_DISCOVERY_PASSWORD), or neither"
            )
        if self.metrics_port is not None:
            _int_range("metrics_port", self.metrics_port, 0, 65535)
        for name in ("relay", "accept_relayed"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        _int_range("relay_port", self.relay_port, 0, 65535)
        _int_range("relay_yield_mbps", self.relay_yield_mbps, 0, 10_000_000)
        _int_range("relay_max_conns", self.relay_max_conns, 1, 65536)
        rn = self.relay_nics
        if isinstance(rn, Sequence) and not isinstance(rn, str):
            if not all(isinstance(n, str) for n in rn):
                raise ConfigError(f"relay_nics: expected NIC names or addresses, got {rn!r}")
            object.__setattr__(self, "relay_nics", tuple(rn))
        elif not isinstance(rn, str):
            raise ConfigError(f"relay_nics: expected NIC names or addresses, got {rn!r}")
        if self.relay_nics:
            _nics.resolve(self.relay_nics)
        object.__setattr__(self, "relays", _relay_list(self.relays))
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ConfigError(f"metrics_host: expected an address, got {self.metrics_host!r}")
        if not isinstance(self.allow_unauthenticated, bool):
            raise ConfigError(
                f"allow_unauthenticated: expected True or False, got {self.allow_unauthenticated!r}"
            )

    def resolved_secret(self) -> bytes | None:
        """The secret in force: this config's, else KVLINK_SECRET, else the
        contents of the file KVLINK_SECRET_FILE names (one trailing newline
        dropped), else None.

        Raises:
            ConfigError: an unreadable file, or a secret of the wrong size.
        """
        if self.secret is not None:
            return _check_secret("secret", self.secret)
        env = os.environ.get("KVLINK_SECRET")
        if env:
            return _check_secret("KVLINK_SECRET", env)
        path = os.environ.get("KVLINK_SECRET_FILE")
        if path:
            try:
                raw = Path(path).read_bytes()
            except OSError as exc:
                raise ConfigError(f"KVLINK_SECRET_FILE {path}: {exc.strerror}") from exc
            return _check_secret(f"KVLINK_SECRET_FILE {path}", raw.removesuffix(b"\n"))
        return None

    def resolved_io_threads(self, n_paths: int) -> int:
        """The I/O threads an agent with ``n_paths`` local addresses starts."""
        if isinstance(self.io_threads, int):
            return self.io_threads
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        return 0 if cores < 4 else max(1, min(n_paths, cores // 2, 16))

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def load(cls, file: str | Path | None = None, **overrides: Any) -> Config:
        """Defaults < ``KVLINK_*`` environment < ``file`` (JSON) < ``overrides``.

        Raises:
            ConfigError: unknown keys, unreadable file or invalid values.
        """
        values: dict[str, Any] = _from_env(os.environ)
        from_env = set(values)
        if file is not None:
            from_file = _from_file(Path(file))
            values.update(from_file)
            from_env -= set(from_file)
        values.update(overrides)
        from_env -= set(overrides)
        unknown = sorted(set(values) - set(_FIELDS))
        if unknown:
            hints = "".join(_closest(k, _FIELDS) for k in unknown)
            raise ConfigError(
                f"unknown config keys {unknown}{hints}; known keys: {sorted(_FIELDS)}"
            )
        try:
            return cls(**values)
        except ConfigError as exc:
            # name the variable a user set, not a field name they never typed
            field_name = str(exc).split(":", 1)[0]
            var = f"KVLINK_{field_name.upper()}"
            if field_name in from_env and field_name not in ("secret", "discovery_password"):
                raise ConfigError(
                    f"{var}={os.environ.get(var)!r} (from the environment): {exc}"
                ) from None
            raise


SECRET_MIN, SECRET_MAX = 16, 256  # bytes (csrc/internal.h)


def _check_secret(where: str, value: Any) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes):
        raise ConfigError(f"{where}: expected str or bytes, got {type(value).__name__}")
    if not SECRET_MIN <= len(value) <= SECRET_MAX:
        raise ConfigError(
            f"{where}: the secret is {len(value)} bytes; it must be {SECRET_MIN}..{SECRET_MAX}"
            " (use a random one, e.g. `openssl rand -hex 32`)"
        )
    return value


def _relay_list(value: Any) -> tuple[str, ...]:
    """Config.relays as a tuple of items (metadata JSON or file paths).

    Raises:
        ConfigError: not a string or a list of strings.
    """
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return ()
        # one metadata document, or paths separated by commas
        return (text,) if text.startswith("{") else tuple(
            p.strip() for p in text.split(",") if p.strip()
        )
    if isinstance(value, Sequence) and all(isinstance(v, (str, bytes)) for v in value):
        return tuple(v.decode() if isinstance(v, bytes) else v for v in value)
    raise ConfigError(
        f"relays: expected relay agents' metadata (JSON) or paths of files holding it, got "
        f"{value!r:.80}"
    )


def _check_fault_mover(spec: Any, transport: str) -> None:
    if not isinstance(spec, str):
        raise ConfigError(f"fault_mover: expected a string like 'drop=0.1,seed=7', got {spec!r}")
    if not spec:
        return
    if transport != "fault":
        raise ConfigError(
            f"fault_mover: {spec!r} is given, but transport={transport!r}; the fault mover is "
            "for tests only and runs with transport='fault' (or clear fault_mover)"
        )
    if len(spec.encode()) > _FAULT_SPEC_MAX:
        raise ConfigError(f"fault_mover: longer than {_FAULT_SPEC_MAX} bytes; shorten it")
    keys = (*_FAULT_RATES, *_FAULT_MS, "seed")
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in keys:
            raise ConfigError(
                f"fault_mover: {item!r} is not KEY=VALUE with KEY one of {', '.join(keys)}"
                f"{_closest(key, keys)}"
            )
        try:
            number = float(value) if key != "seed" else int(value)
        except ValueError:
            raise ConfigError(f"fault_mover: {key}={value!r} is not a number") from None
        if key in _FAULT_RATES and not 0.0 <= number <= 1.0:
            raise ConfigError(f"fault_mover: {key}={value} is a rate per write: give 0..1")
        if key in _FAULT_MS and (number != int(number) or not 0 <= number <= 600_000):
            raise ConfigError(f"fault_mover: {key}={value} must be whole milliseconds 0..600000")
        if key == "seed" and number < 0:
            raise ConfigError(f"fault_mover: seed={value} must be a non-negative integer")


_FIELDS = tuple(f.name for f in dataclasses.fields(Config))


def _closest(name: str, known: Sequence[str]) -> str:
    """ " (did you mean 'x'?)" for the known name closest to ``name``, or ""."""
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _refuse_unknown_fields(init: Callable[..., None]) -> Callable[..., None]:
    """Config(chunk_size=...) gets a ConfigError naming the closest field,
    not the dataclass's bare TypeError."""

    @functools.wraps(init)
    def checked(self: Config, *args: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in _FIELDS:
                raise ConfigError(
                    f"Config: unknown field {key!r}{_closest(key, _FIELDS)}; fields: "
                    + ", ".join(_FIELDS)
                )
        init(self, *args, **kwargs)

    return checked


Config.__init__ = _refuse_unknown_fields(Config.__init__)  # type: ignore[method-assign]


def _int_range(name: str, value: Any, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}: {value} is outside [{lo}, {hi}]")


def _float_range(name: str, value: Any, lo: float, hi: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}: {value} is outside [{lo}, {hi}]")


def _size(name: str, text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _scheduler(value: Any) -> Scheduler:
    if isinstance(value, Scheduler):
        return value
    names = [s.value for s in Scheduler]
    if isinstance(value, str) and value in names:
        return Scheduler(value)
    hint = _closest(value, names) if isinstance(value, str) else ""
    raise ConfigError(
        f"scheduler: unknown scheduler {value!r}{hint}; expected a kvlink.Scheduler or one of "
        + ", ".join(repr(n) for n in names)
    )


def _coerce(name: str, var: str, raw: str) -> Any:
    """The value of environment variable ``var`` for field ``name``."""
    default = Config.__dataclass_fields__[name].default
    if isinstance(default, bool):
        if raw.strip().lower() in _TRUE:
            return True
        if raw.strip().lower() in _FALSE:
            return False
        raise ConfigError(
            f"{var}: {raw!r} is not a boolean; use {', '.join(_TRUE)} to turn it on, "
            f"{', '.join(_FALSE)} to turn it off"
        )
    if name.endswith("_bytes"):
        return _size(var, raw)
    if name == "metrics_port":
        default = 0  # an int when given, None when not
    try:
        if isinstance(default, int):
            return int(raw, 0)
        if isinstance(default, float):
            return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{var}: cannot parse {raw!r}") from exc
    return raw


_WARNED: set[str] = set()  # misspelled KVLINK_* variables already warned about


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """Config values from ``KVLINK_<FIELD>`` variables; warns about other
    ``KVLINK_*`` names, which are most likely typos."""
    variables = {f"KVLINK_{name.upper()}": name for name in _FIELDS}
    out: dict[str, Any] = {}
    for var, raw in env.items():
        if var in variables:
            out[variables[var]] = _coerce(variables[var], var, raw)
        elif var.startswith("KVLINK_") and var not in OTHER_ENV_VARS and var not in _WARNED:
            _WARNED.add(var)  # once per process: every Config.load reads the environment
            known = [*variables, *sorted(OTHER_ENV_VARS)]
            warnings.warn(
                f"{var} is not a kvlink setting and is ignored{_closest(var, known)}; "
                f"kvlink reads {', '.join(known)}",
                stacklevel=3,
            )
    return out


def _from_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a JSON object")
    return data


__all__ = ["Config", "GiB", "KiB", "MiB", "Scheduler"]
