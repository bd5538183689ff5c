"""Cards through a bootstrap server: what push needs behind vllm-router's
``--kv-connector mooncake`` flow, which hands decode only prefill's bootstrap address and a
transfer id, and prefill only the transfer id (docs/vllm.md, "Behind vllm-router").

- A prefill's scheduler side runs :class:`BootstrapServer` on ``bootstrap_port``: ``GET /query``
  answers what the router asks every prefill at start (its engine id per data-parallel rank, in
  MooncakeConnector's shape), ``GET /kvlink/cards`` the prefill's cards.
- A decode's scheduler side fetches those cards with :class:`CardFetcher`, in the background
  (the scheduler loop never waits on HTTP), caches them for ``ttl_s`` and refetches after;
  decode's offers then carry decode's own card to prefill.

Plain Python (no vLLM import).
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import kvlink
from kvlink.integrations.vllm import _protocol as proto

log = logging.getLogger("vllm.kvlink")

#: at most this many prefills' cards cached at decode (oldest dropped first)
MAX_CACHED = 1024
#: at most this many fetches at once (a flood of addresses waits, it does not spawn threads)
MAX_FETCHES = 16
#: a card answer larger than this is refused (one card per rank: a few KiB each)
MAX_ANSWER = 1 << 20
#: connections the bootstrap server serves at once; more are closed at once (each is dropped
#: after 5 s without a request, so idle clients cannot hold the server)
MAX_CLIENTS = 64


class _Server(http.server.ThreadingHTTPServer):
    """A threading HTTP server with at most MAX_CLIENTS connections (threads) at once."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: accepted (or closed) at once, not queued

    def __init__(self, addr: tuple[str, int], handler: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        super().__init__(addr, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class BootstrapServer:
    """HTTP server of a prefill's cards, in a daemon thread.

    Raises (at construction):
        kvlink.ConfigError: the port cannot be bound (naming ``bootstrap_port``).
    """

    def __init__(self, host: str, port: int, engine_id: str,
                 card: dict[str, Any] | list[dict[str, Any]], agents: list[str]) -> None:
        query = json.dumps({"0": {"engine_id": engine_id, "worker_addr": {
            str(rank): {"0": name} for rank, name in enumerate(agents)}}}).encode()
        cards = json.dumps({"engine_id": engine_id, "card": card}).encode()
        pages = {"/query": query, proto.CARDS_PATH: cards}

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 5.0  # a client that sends nothing is dropped

            def do_GET(self) -> None:
                body = pages.get(self.path.split("?", 1)[0])
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, format: str, *args: Any) -> None:
                return

        try:
            self._httpd = _Server((host, port), Handler)
        except OSError as exc:
            raise kvlink.ConfigError(
                f"kv_connector_extra_config['bootstrap_port']: cannot listen on {host}:{port} "
                f"({exc}); give each prefill on a host its own port"
            ) from exc
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="kvlink-bootstrap", daemon=True)
        self._thread.start()
        log.info("kvlink: serving this prefill's cards for vllm-router on %s:%d", host, self.port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class CardFetcher:
    """Decode: prefills' cards by bootstrap address, fetched in the background."""

    def __init__(self, timeout_s: float, ttl_s: float = 10.0, retry_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s  # a card is refetched this long after it came (a restarted prefill)
        self.retry_s = retry_s  # a failed fetch is answered with its error this long
        self._lock = threading.Lock()
        # address -> (time.monotonic() of the answer, cards or why not)
        self._cache: dict[str, tuple[float, list[proto.Card] | proto.ParamsError]] = {}
        self._pending: set[str] = set()

    def cards(self, addr: str) -> list[proto.Card] | None:
        """Prefill's cards at ``addr``; None while they are being fetched (ask again).

        Raises:
            proto.ParamsError: the last fetch failed (why, with the address).
        """
        now = time.monotonic()
        with self._lock:
            entry = self._cache.get(addr)
            ttl = self.retry_s if entry and isinstance(entry[1], Exception) else self.ttl_s
            if (entry is None or now - entry[0] > ttl) and addr not in self._pending and len(
                    self._pending) < MAX_FETCHES:
                self._pending.add(addr)
                threading.Thread(target=self._fetch, args=(addr,), name="kvlink-cards",
                                 daemon=True).start()
        if entry is None:
            return None
        if isinstance(entry[1], proto.ParamsError):
            raise entry[1]
        return entry[1]

    def _fetch(self, addr: str) -> None:
        url = addr + proto.CARDS_PATH
        result: list[proto.Card] | proto.ParamsError
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as answer:
                raw = answer.read(MAX_ANSWER + 1)
            if len(raw) > MAX_ANSWER:
                raise ValueError(f"more than {MAX_ANSWER} bytes")
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            result = proto.cards_from_wire(doc.get("card"), f"{url}['card']")
        except proto.ParamsError as exc:
            result = exc
        except (OSError, ValueError, urllib.error.URLError) as exc:
            result = proto.ParamsError(
                f"could not fetch prefill's card from {url} ({exc}): is kv_connector_extra_"
                "config['bootstrap_port'] set on that prefill, and the router's --prefill URL "
                "PORT the same port?"
            )
        with self._lock:
            self._pending.discard(addr)
            if addr not in self._cache and len(self._cache) >= MAX_CACHED:
                del self._cache[next(iter(self._cache))]
            self._cache[addr] = (time.monotonic(), result)
