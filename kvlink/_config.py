"""Agent configuration: a frozen, validated dataclass.

Precedence: explicit arguments > config file > ``KVLINK_*`` environment >
defaults.  The C core reads no environment; this module builds its struct.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


@dataclass(frozen=True)
class Config:
    """How an :class:`~kvlink.Agent` listens, chunks and schedules.

    Raises:
        ConfigError: at construction, naming the field and the fix.
    """

    # Which local NICs to use: "auto" (every up IPv4 interface but loopback),
    # "loopback:N" (N paths on 127.0.0.1..N, no root needed), or a list or
    # comma-separated string of interface names and IPv4 addresses.
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
    # "earliest_finish" (the default) or "round_robin" (a static baseline for
    # benchmarks, never a good choice on uneven paths).
    scheduler: str = "earliest_finish"
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
        _int_range("port", self.port, 0, 65535)
        _int_range("chunk_bytes", self.chunk_bytes, 4 * KiB, 1 * GiB)
        _int_range("min_chunk_bytes", self.min_chunk_bytes, 1, self.chunk_bytes)
        _int_range("monitor_interval_ms", self.monitor_interval_ms, 1, 60_000)
        _int_range("max_attempts", self.max_attempts, 1, 255)
        _int_range("stall_factor", self.stall_factor, 1, 1000)
        _int_range("probe_backoff_max_ms", self.probe_backoff_max_ms, 100, 600_000)
        if not isinstance(self.hedge, bool):
            raise ConfigError(f"hedge: expected True or False, got {self.hedge!r}")
        if self.scheduler not in ("earliest_finish", "round_robin"):
            raise ConfigError(
                f"scheduler: expected 'earliest_finish' or 'round_robin', got {self.scheduler!r}"
            )
        _int_range("window_chunks", self.window_chunks, 1, 1024)
        _int_range("window_bytes", self.window_bytes, 0, 16 * GiB)
        _int_range("sock_buf_bytes", self.sock_buf_bytes, 0, 1 * GiB)
        _float_range("connect_timeout_s", self.connect_timeout_s, 0.001, 3600.0)
        _float_range("transfer_timeout_s", self.transfer_timeout_s, 0.0, 7 * 86400.0)
        _float_range("close_linger_s", self.close_linger_s, 0.0, 60.0)
        if self.secret is not None:
            _check_secret("secret", self.secret)
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

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def load(cls, file: str | Path | None = None, **overrides: Any) -> Config:
        """Defaults < ``KVLINK_*`` environment < ``file`` (JSON) < ``overrides``.

        Raises:
            ConfigError: unknown keys, unreadable file or invalid values.
        """
        values: dict[str, Any] = {}
        values.update(_from_env(os.environ))
        if file is not None:
            values.update(_from_file(Path(file)))
        values.update(overrides)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)


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


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _coerce(name: str, raw: str) -> Any:
    default = _FIELDS[name].default
    try:
        if isinstance(default, bool):
            return raw.lower() in ("1", "true", "yes")
        if isinstance(default, int):
            return int(raw, 0)
        if isinstance(default, float):
            return float(raw)
    except ValueError as exc:
        raise ConfigError(f"KVLINK_{name.upper()}: cannot parse {raw!r}") from exc
    return raw


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _FIELDS:
        raw = env.get(f"KVLINK_{name.upper()}")
        if raw is not None:
            out[name] = _coerce(name, raw)
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


__all__ = ["Config", "GiB", "KiB", "MiB"]
