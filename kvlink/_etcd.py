"""A small etcd v3 client over etcd's JSON gateway (``/v3/...``), through httpx.

Only what discovery needs: leases (grant, keep-alive, revoke), put, get, a
bounded prefix range and delete.  The gateway is etcd's own documented HTTP
mapping of its gRPC API (keys and values base64, 64-bit integers as strings);
httpx does the HTTP, TLS and connection pooling.

Every request has a timeout; every answer is read up to a size bound before
it is parsed, and treated as untrusted input (a field of the wrong type is an
:class:`EtcdError`, never a crash).
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from ._errors import DiscoveryError

# An answer bigger than this is refused before it is parsed: the largest one
# discovery asks for is a prefix range of at most MAX_KEYS records of at most
# 64 KiB each, base64-encoded.
MAX_RESPONSE_BYTES = 48 * 1024 * 1024
MAX_TXN_OPS = 128  # etcd --max-txn-ops default
# etcd's gRPC code for "unauthenticated" and the token errors that mean
# "authenticate again".
_UNAUTHENTICATED = 16
_TOKEN_ERRORS = ("invalid auth token", "user name is empty", "auth: revision in header is old")


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    lease: int
    mod_revision: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(field: str, raw: Any) -> bytes:
    if not isinstance(raw, str):
        raise DiscoveryError(f"etcd answered a {field} that is not base64 text")
    try:
        return base64.b64decode(raw, validate=True)
    except ValueError:
        raise DiscoveryError(f"etcd answered a {field} that is not base64") from None


def _int(field: str, raw: Any, default: int = 0) -> int:
    """etcd's int64 fields arrive as strings (JSON numbers lose precision)."""
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise DiscoveryError(f"etcd answered a {field} that is not an integer")
    try:
        return int(raw)
    except ValueError:
        raise DiscoveryError(f"etcd answered a {field} that is not an integer") from None


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that selects every key starting with ``prefix``."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"  # every key


class Etcd:
    """A thread-safe etcd client for one cluster (one or more endpoints).

    ``endpoints`` are tried in turn: a request that cannot reach one moves to
    the next.  ``user``/``password`` turn on etcd authentication (a token is
    taken at the first request and again when etcd says it expired);
    ``ca_file`` / ``cert_file`` / ``key_file`` set up TLS (``tls=True``).
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        tls: bool,
        timeout_s: float,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        scheme = "https" if tls else "http"
        self._bases = [
            f"{scheme}://[{h}]:{p}" if ":" in h else f"{scheme}://{h}:{p}" for h, p in endpoints
        ]
        self._next = 0
        self._lock = threading.Lock()
        self._user = user
        self._password = password
        self._token: str | None = None
        # plain http needs no TLS context, and the default one loads the system's CA
        # store (~80 ms of an agent's start)
        verify: Any = tls
        if tls:
            verify = ssl.create_default_context(cafile=ca_file)
            if cert_file:
                verify.load_cert_chain(cert_file, key_file)
        # no retries inside httpx: a failed endpoint moves us to the next one
        self._http = httpx.Client(timeout=timeout_s, verify=verify, trust_env=False)

    def close(self) -> None:
        self._http.close()

    @property
    def endpoints(self) -> list[str]:
        return list(self._bases)

    def server_version(self, base: str) -> str:
        """etcd's version at endpoint ``base`` (one of :attr:`endpoints`): ``GET /version``,
        no authentication needed (kvlink doctor asks it of every endpoint).

        Raises:
            httpx.HTTPError: it did not answer, or answered an error.
            ValueError: the answer is not etcd's JSON.
        """
        r = self._http.get(f"{base}/version")
        r.raise_for_status()
        return str(r.json().get("etcdserver", "?"))

    # ---- transport -------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any], *, auth: bool = True) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers.

        Raises:
            DiscoveryError: no endpoint answered, or etcd answered an error.
        """
        with self._lock:
            start = self._next
        errors: list[str] = []
        for k in range(len(self._bases)):
            i = (start + k) % len(self._bases)
            base = self._bases[i]
            for attempt in range(2):  # the second only after a token expired
                headers = {}
                if auth and self._user is not None:
                    if self._token is None:
                        self._authenticate(base)
                    headers["Authorization"] = self._token or ""
                try:
                    status, data = self._request(f"{base}/v3/{path}", body, headers)
                except httpx.HTTPError as exc:
                    errors.append(f"{base}: {type(exc).__name__}: {exc}")
                    break
                if status == 200:
                    with self._lock:
                        self._next = i
                    return data
                code = _int("error code", data.get("code"), -1)
                msg = str(data.get("message") or data.get("error") or f"HTTP {status}")[:300]
                if (
                    auth
                    and self._user is not None
                    and attempt == 0
                    and (code == _UNAUTHENTICATED or any(t in msg for t in _TOKEN_ERRORS))
                ):
                    self._token = None
                    continue
                raise DiscoveryError(f"etcd {base} refused {path}: {msg} (code {code})")
        raise DiscoveryError(
            "cannot reach etcd: "
            + "; ".join(errors)
            + " (is etcd running, and does discovery= name its client URL?)"
        )

    def _request(
        self, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int, dict[str, Any]]:
        with self._http.stream("POST", url, json=body, headers=headers) as resp:
            buf = bytearray()
            for piece in resp.iter_bytes():
                buf += piece
                if len(buf) > MAX_RESPONSE_BYTES:
                    raise DiscoveryError(
                        f"etcd {url} answered more than {MAX_RESPONSE_BYTES} bytes; refused"
                    )
            status = resp.status_code
        try:
            data = json.loads(buf) if buf else {}
        except ValueError:
            raise DiscoveryError(f"etcd {url} answered HTTP {status} with no JSON") from None
        if not isinstance(data, dict):
            raise DiscoveryError(f"etcd {url} answered HTTP {status} with no JSON object")
        return status, data

    def _authenticate(self, base: str) -> None:
        try:
            status, data = self._request(
                f"{base}/v3/auth/authenticate",
                {"name": self._user, "password": self._password or ""},
                {},
            )
        except httpx.HTTPError as exc:
            raise DiscoveryError(f"cannot reach etcd {base} to authenticate: {exc}") from exc
        token = data.get("token")
        if status != 200 or not isinstance(token, str) or not token:
            msg = str(data.get("message") or data.get("error") or f"HTTP {status}")[:300]
            raise DiscoveryError(
                f"etcd {base} refused user {self._user!r}: {msg}; check discovery_user and "
                "discovery_password (KVLINK_DISCOVERY_PASSWORD)"
            )
        self._token = token

    # ---- leases ----------------------------------------------------------

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        data = self._post("lease/grant", {"TTL": ttl_s})
        lease = _int("lease ID", data.get("ID"))
        if lease <= 0:
            raise DiscoveryError(f"etcd granted no lease: {str(data.get('error', ''))[:200]}")
        return lease

    def keepalive(self, lease: int) -> int:
        """Renews ``lease``; returns its new TTL, 0 when etcd no longer has it."""
        data = self._post("lease/keepalive", {"ID": str(lease)})
        result = data.get("result")
        if not isinstance(result, dict):
            raise DiscoveryError("etcd answered a keep-alive without a result")
        return max(0, _int("lease TTL", result.get("TTL")))

    def revoke(self, lease: int) -> None:
        """Ends ``lease`` and deletes the keys attached to it."""
        self._post("lease/revoke", {"ID": str(lease)})

    # ---- keys ------------------------------------------------------------

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        """Raises DiscoveryError; ``lease_lost`` in its message when the lease is gone."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self._post("kv/put", body)

    def get(self, key: bytes) -> KeyValue | None:
        kvs = self._range({"key": _b64(key)}, 1)
        return kvs[0] if kvs else None

    def range_prefix(self, prefix: bytes, limit: int) -> tuple[list[KeyValue], bool]:
        """Up to ``limit`` keys starting with ``prefix``; True when there were more."""
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "limit": limit}
        data = self._post("kv/range", body)
        kvs = self._kvs(data, limit)
        return kvs, bool(data.get("more"))

    def delete(self, key: bytes) -> None:
        self._post("kv/deleterange", {"key": _b64(key)})

    def txn(self, ops: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Runs ``ops`` (``{"put": (key, value, lease)}``, ``{"delete": key}`` or
        ``{"range": (prefix, limit)}``) as one etcd transaction without conditions, at
        most MAX_TXN_OPS of them (etcd's default limit); returns one answer per op:
        ``{}`` for a put or delete, ``{"kvs": [KeyValue, ...]}`` for a range."""
        if len(ops) > MAX_TXN_OPS:
            raise DiscoveryError(
                f"{len(ops)} operations in one etcd transaction (at most {MAX_TXN_OPS})"
            )
        body = []
        for op in ops:
            if "put" in op:
                key, value, lease = op["put"]
                put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
                if lease:
                    put["lease"] = str(lease)
                body.append({"request_put": put})
            elif "delete" in op:
                body.append({"request_delete_range": {"key": _b64(op["delete"])}})
            else:
                prefix, limit = op["range"]
                body.append(
                    {
                        "request_range": {
                            "key": _b64(prefix),
                            "range_end": _b64(prefix_end(prefix)),
                            "limit": limit,
                        }
                    }
                )
        data = self._post("kv/txn", {"success": body})
        raw = data.get("responses", [])
        if not isinstance(raw, list) or len(raw) != len(ops):
            raise DiscoveryError("etcd answered a transaction with the wrong number of responses")
        out: list[dict[str, Any]] = []
        for op, r in zip(ops, raw, strict=False):
            if "range" in op:
                rr = r.get("response_range", {}) if isinstance(r, dict) else {}
                out.append({"kvs": self._kvs(rr if isinstance(rr, dict) else {}, op["range"][1])})
            else:
                out.append({})
        return out

    def _range(self, body: dict[str, Any], limit: int) -> list[KeyValue]:
        return self._kvs(self._post("kv/range", {**body, "limit": limit}), limit)

    @staticmethod
    def _kvs(data: dict[str, Any], limit: int) -> list[KeyValue]:
        raw = data.get("kvs", [])
        if not isinstance(raw, list):
            raise DiscoveryError("etcd answered a range whose kvs is not a list")
        out = []
        for kv in raw[:limit]:
            if not isinstance(kv, dict):
                raise DiscoveryError("etcd answered a range with a malformed key-value")
            out.append(
                KeyValue(
                    key=_unb64("key", kv.get("key")),
                    value=_unb64("value", kv.get("value", "")),
                    lease=_int("lease", kv.get("lease")),
                    mod_revision=_int("mod_revision", kv.get("mod_revision")),
                )
            )
        return out
