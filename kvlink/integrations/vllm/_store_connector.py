"""KvlinkStoreConnector: vLLM's KV connector (v1 API) for reuse: finished requests' blocks go
into a kvlink.store (host memory, local NVMe, other hosts' stores), and a new request whose
prompt starts with stored blocks loads them instead of recomputing them.

The scheduler side decides per request how many leading blocks to load; it asks the worker's
store over a Unix socket (in a private directory, named after the engine id, so both sides find
it without vLLM's handshake channel, which MultiConnector gives to one sub-connector only),
since the store lives with the KV tensors in the worker process. A request whose blocks are on
disk or on another host stays in vLLM's waiting queue while they move up to host memory
(prefetch, with a deadline): vLLM keeps scheduling the others meanwhile
(``get_num_new_matched_tokens`` answers None), so no request waits for another's loads. Loads
run inside the forward pass, layer by layer; blocks that fail their checks are reported as load
errors and vLLM recomputes exactly those. Stores run in a background thread while the blocks
are held (``request_finished`` delays their release), so the engine's step never waits for
them.

With disaggregation, combine it with KvlinkConnector through vLLM's MultiConnector
(docs/vllm.md, "Reuse").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvlink
from kvlink import kv
from kvlink.integrations.vllm._settings import Settings, parse_settings
from kvlink.integrations.vllm._stats import STORE_COUNTERS, StoreConnectorStats, StorePromMetrics
from kvlink.store import Load, Prefetch, Store, Tier, block_keys

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvlink")

_MAX_MESSAGE = 4 << 20  # a lookup of 65536 keys in hex fits
_MAX_KEYS = 65536
_MAX_PREFETCHES = 4096  # requests waiting with a prefetch; beyond, the oldest is released
_MAX_CLIENTS = 8  # lookup connections at once


# ---------------------------------------------------------------------------------------------
# What the scheduler side sends its worker each step


@dataclasses.dataclass
class StoreLoad:
    """Load ``keys`` into ``blocks`` (this step's forward pass needs them)."""

    req_id: str
    keys: list[bytes]
    blocks: list[int]


@dataclasses.dataclass
class StoreSave:
    """Store ``blocks`` under ``keys`` (sent over the lookup socket when the request
    finished); the blocks stay held until the worker says it is done."""

    req_id: str
    keys: list[bytes]
    blocks: list[int]


@dataclasses.dataclass
class StoreMetadata(KVConnectorMetadata):
    loads: list[StoreLoad] = dataclasses.field(default_factory=list)
    releases: list[str] = dataclasses.field(default_factory=list)  # prefetches to let go


# ---------------------------------------------------------------------------------------------
# The lookup channel: length-prefixed JSON over a Unix socket


def socket_path(engine_id: str) -> str:
    """Where the worker of engine ``engine_id`` answers lookups: a socket in a directory only
    this user can enter.

    Raises:
        kvlink.ConfigError: the directory exists but is not this user's alone.
    """
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    d = os.path.join(base, f"kvlink-store-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise kvlink.ConfigError(
            f"{d}: not a directory of this user's alone (mode {stat.filemode(st.st_mode)}, "
            f"uid {st.st_uid}); remove it or set XDG_RUNTIME_DIR to a private directory"
        )
    name = hashlib.sha256(engine_id.encode()).hexdigest()[:24]
    return os.path.join(d, f"{name}.sock")



def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def _recv(sock: socket.socket) -> dict[str, Any] | None:
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = struct.unpack("<I", head)
    if n > _MAX_MESSAGE:
        raise ValueError(f"a lookup message of {n} bytes (at most {_MAX_MESSAGE})")
    body = _recv_exact(sock, n)
    if body is None:
        return None
    msg = json.loads(body)
    if not isinstance(msg, dict):
        raise ValueError("a lookup message that is not a JSON object")
    return msg


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


class _LookupClient:
    """The scheduler side's end: one request at a time, reconnecting after an error."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Raises OSError / ValueError when the worker does not answer in time."""
        with self._lock:
            for attempt in range(2):
                try:
                    if self._sock is None:
                        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        s.settimeout(self.timeout_s)
                        s.connect(self.path)
                        self._sock = s
                    _send(self._sock, msg)
                    got = _recv(self._sock)
                    if got is None:
                        raise ConnectionError("the worker's store closed the lookup channel")
                    return got
                except (OSError, ValueError):
                    if self._sock is not None:
                        self._sock.close()
                        self._sock = None
                    if attempt:
                        raise
            raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


# ---------------------------------------------------------------------------------------------


class KvlinkStoreConnector(KVConnectorBase_V1):
    """vLLM KV connector for reuse through kvlink.store (``kv_connector="KvlinkStoreConnector"``,
    ``kv_connector_module_path="kvlink.integrations.vllm"``, ``kv_role="kv_both"``).

    Raises:
        kvlink.ConfigError: at construction, for a bad ``kv_connector_extra_config``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = parse_settings(self._kv_transfer_config.kv_connector_extra_config)
        self.settings.kvlink_config()  # transport settings checked at start, on both sides
        self._scheduler: _StoreScheduler | None = None
        self._worker: _StoreWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _StoreScheduler(self.settings, vllm_config)
        else:
            num_blocks = getattr(kv_cache_config, "num_blocks", None)
            self._worker = _StoreWorker(self.settings, vllm_config, num_blocks)

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None  # the scheduler side finds the worker's socket by the engine id

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        self._worker.start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass  # whole blocks are stored once the request finished (StoreSave)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        self._worker.forward_done(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.finished_saves(), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a save a preemption drops is a future miss, never a wrong byte (saves copy
        # from blocks vLLM still holds for them).
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # The worker's agent has the KV cache registered: a remap under it is refused.
        return False

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None if self._worker is None else self._worker.take_interval_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return StoreConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return StorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side --------------------------------------------------------------------

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.set_handshake(metadata)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids)


def _namespace(settings: Settings, vllm_config: VllmConfig) -> str:
    """What every block key is salted with: blocks of another model, dtype, block size, tensor
    parallelism or user namespace never match."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    return "|".join(
        str(x)
        for x in (
            "vllm",
            mc.model,
            getattr(mc, "revision", None),
            mc.dtype,
            cc.cache_dtype,
            cc.block_size,
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            settings.store.namespace,
        )
    )


class _StoreScheduler:
    def __init__(self, settings: Settings, vllm_config: VllmConfig) -> None:
        self.settings = settings
        self.block_size = int(vllm_config.cache_config.block_size)
        self.namespace = _namespace(settings, vllm_config)
        tc = vllm_config.kv_transfer_config
        assert tc is not None
        self._client = _LookupClient(socket_path(str(tc.engine_id)), settings.connect_timeout_s)
        self._keys: dict[str, list[bytes]] = {}  # request -> its prompt's block keys
        self._local: dict[str, int] = {}  # request -> locally computed tokens at the match
        self._loads: list[StoreLoad] = []
        self._releases: list[str] = []
        self._warned = False

    def set_handshake(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        # Another sub-connector's (MultiConnector hands every one the first it gets): only the
        # number of workers matters here.
        if len(metadata) > 1:
            raise kvlink.ConfigError(
                f"KvlinkStoreConnector supports one worker per engine (tensor_parallel_size=1), "
                f"got {len(metadata)} workers"
            )

    def _prompt_keys(self, request: Request) -> list[bytes]:
        keys = self._keys.get(request.request_id)
        if keys is None:
            # The last prompt position is computed here (its logits give the next token), so
            # the keys cover the full blocks before it.
            n = (request.num_prompt_tokens - 1) // self.block_size
            toks = list(request.prompt_token_ids[: n * self.block_size])
            keys = block_keys(self.namespace, toks, self.block_size)
            self._keys[request.request_id] = keys
        return keys

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if num_computed_tokens % self.block_size:
            return 0, False
        keys = self._prompt_keys(request)
        first = num_computed_tokens // self.block_size
        if len(keys) <= first:
            return 0, False
        try:
            ans = self._client.call({"op": "lookup", "req": request.request_id,
                                     "keys": [k.hex() for k in keys]})
        except (OSError, ValueError) as exc:
            if not self._warned:
                log.warning("kvlink store: the worker's store does not answer lookups (%s); "
                            "requests compute their prompts", exc)
                self._warned = True
            return 0, False
        if ans.get("pending"):
            return None, False  # asked again next step; other requests go on meanwhile
        ready = min(int(ans.get("host", 0)), len(keys))
        if ready <= first:
            self._releases.append(request.request_id)
            return 0, False
        self._local[request.request_id] = num_computed_tokens
        return (ready - first) * self.block_size, False

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        local = self._local.pop(req_id, None)
        if num_external_tokens <= 0 or local is None:
            return
        first = local // self.block_size
        last = (local + num_external_tokens) // self.block_size
        ids = list(blocks.get_block_ids()[0][first:last])
        keys = self._prompt_keys(request)[first:last]
        self._loads.append(StoreLoad(req_id, keys, ids))

    def build_meta(self) -> StoreMetadata:
        meta = StoreMetadata(loads=self._loads, releases=self._releases)
        self._loads, self._releases = [], []
        return meta

    def finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._keys.pop(req_id, None)
        self._local.pop(req_id, None)
        self._releases.append(req_id)
        # Every full block whose KV was computed: the prompt's and the output's so far (the
        # last token has none yet). The next turn's prompt starts with them.
        toks = list(request.all_token_ids)
        n = min(len(toks) - 1, request.num_computed_tokens) // self.block_size
        n = min(n, len(block_ids))
        if n <= 0:
            return False, None
        keys = block_keys(self.namespace, toks[: n * self.block_size], self.block_size)
        # Straight to the worker (not in the next step's metadata): the blocks' KV is complete
        # now, and the next turn of the conversation may arrive before another step runs.
        try:
            self._client.call({"op": "save", "req": req_id, "keys": [k.hex() for k in keys],
                               "blocks": list(block_ids[:n])})
        except (OSError, ValueError) as exc:
            log.warning("kvlink store: request %s: blocks not stored (%s)", req_id, exc)
            return False, None
        return True, None  # vLLM keeps the blocks until get_finished names the request

    def close(self) -> None:
        self._client.close()


# ---------------------------------------------------------------------------------------------


class _StoreWorker:
    def __init__(self, settings: Settings, vllm_config: VllmConfig, num_blocks: int | None) -> None:
        tc = vllm_config.kv_transfer_config
        assert tc is not None
        self.settings = settings
        self.engine_id = str(tc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.num_blocks = num_blocks
        self.config = settings.kvlink_config()
        self.agent: kvlink.Agent | None = None
        self.store: Store | None = None
        self.layout: kv.PagedLayout | None = None
        self.layer_index: dict[str, int] = {}
        self.socket_path: str | None = None
        self._server: socket.socket | None = None
        self._stop = False
        self._lock = threading.Lock()
        self._prefetches: dict[str, Prefetch] = {}
        self._clients = 0
        self._loads: list[tuple[StoreLoad, Load]] = []
        self._errors: set[int] = set()
        self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvlink-save")
        self._saving: dict[str, concurrent.futures.Future[Any]] = {}
        self._saving_keys: dict[str, set[bytes]] = {}
        self._interval = StoreConnectorStats()
        self._last: dict[str, int] = {}

    # -- set-up ------------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Registers the KV tensors, opens the store and its lookup socket.

        Raises:
            kvlink.InvalidArgumentError: a KV layout that is not blocks first (named).
            kvlink.ConfigError: a store the settings cannot open (disk_path, sizes).
        """
        if not kv_caches:
            raise kvlink.InvalidArgumentError("register_kv_caches: no KV cache tensors")
        name = self.settings.agent_name or f"vllm-store-{self.engine_id}"[:63]
        self.agent = kvlink.Agent(name, self.config)
        tensors = list(kv_caches.values())
        self.layer_index = {n: i for i, n in enumerate(kv_caches)}
        shape = tuple(tensors[0].shape)
        num_blocks = int(self.num_blocks) if self.num_blocks else int(shape[0])
        if shape[0] == num_blocks:
            planes = 1
        elif len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
            planes = 2
        else:
            raise kvlink.InvalidArgumentError(
                f"register_kv_caches: KV tensors of shape {shape} have no block axis of "
                f"{num_blocks} blocks first (or after a K/V axis of 2); not supported"
            )
        for n, t in kv_caches.items():
            if tuple(t.shape) != shape or not t.is_contiguous():
                raise kvlink.InvalidArgumentError(
                    f"register_kv_caches: layer {n!r} is {tuple(t.shape)}, not contiguous like "
                    f"the first {shape}: every layer must be alike"
                )
            self.agent.register(t, name=n[-63:])
        self.layout = kv.PagedLayout.from_tensors(self.agent, tensors, planes=planes)
        block_bytes = self.layout.num_layers * self.layout.planes * self.layout.block_bytes
        try:
            self.store = Store(self.agent, self.settings.store.store_config(block_bytes, "kvstore"))
        except kvlink.ConfigError as exc:
            raise kvlink.ConfigError(f"kv_connector_extra_config['store']: {exc}") from exc
        self.socket_path = socket_path(self.engine_id)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)  # a crashed run's
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(self.socket_path)
        srv.listen(4)
        self._server = srv
        threading.Thread(target=self._serve, name="kvlink-store-lookups", daemon=True).start()
        log.info(
            "kvlink store %s: %d layers, blocks of %d bytes; host %d MiB%s",
            name, self.layout.num_layers, block_bytes, self.settings.store.host_bytes >> 20,
            f", disk {self.settings.store.disk_bytes >> 20} MiB at {self.settings.store.disk_path}"
            if self.settings.store.disk_path else "",
        )

    def close(self) -> None:
        self._stop = True
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.close()
        self._saver.shutdown(wait=True)
        with self._lock:
            for pf in self._prefetches.values():
                pf.release()
            self._prefetches.clear()
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)

    # -- lookups from the scheduler side -------------------------------------------------------

    def _serve(self) -> None:
        assert self._server is not None
        while not self._stop:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                full = self._clients >= _MAX_CLIENTS
                if not full:
                    self._clients += 1
            if full:  # the scheduler side holds one connection; more is someone else
                log.warning("kvlink store: more than %d lookup connections; refused one",
                            _MAX_CLIENTS)
                conn.close()
                continue
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        try:
            self._serve_client(conn)
        finally:
            with self._lock:
                self._clients -= 1

    def _serve_client(self, conn: socket.socket) -> None:
        conn.settimeout(None)  # the scheduler side stays connected between lookups
        with conn:
            while not self._stop:
                try:
                    msg = _recv(conn)
                    if msg is None:
                        return
                    _send(conn, self._answer(msg))
                except (OSError, ValueError, kvlink.KvlinkError) as exc:
                    log.warning("kvlink store: lookup channel: %s", exc)
                    return

    def _answer(self, msg: dict[str, Any]) -> dict[str, Any]:
        store = self.store
        if store is None:
            return {"host": 0, "hits": 0, "pending": False}
        req = str(msg.get("req", ""))[:256]
        raw = msg.get("keys")
        if not isinstance(raw, list) or len(raw) > _MAX_KEYS:
            raise ValueError("a message without a list of at most 65536 keys")
        keys = [bytes.fromhex(k) for k in raw if isinstance(k, str) and len(k) == 64]
        if len(keys) != len(raw):
            raise ValueError("a key that is not 64 hex digits")
        if msg.get("op") == "save":
            blocks = msg.get("blocks")
            if (
                not isinstance(blocks, list)
                or len(blocks) != len(keys)
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks)
            ):
                raise ValueError("a save whose blocks do not pair with its keys")
            save = StoreSave(req, keys, blocks)
            with self._lock:
                if req in self._saving:
                    raise ValueError(f"a second save for request {req!r}")
                self._saving_keys[req] = set(keys)
                self._saving[req] = self._saver.submit(self._save, save)
            return {}
        # read your writes: a conversation's next turn finds what its last turn stored (only
        # saves of these keys are waited for: a new prompt never waits for others' saves)
        wanted = set(keys)
        with self._lock:
            inflight = [
                f for r, f in self._saving.items() if self._saving_keys.get(r, set()) & wanted
            ]
        concurrent.futures.wait(inflight, timeout=1.0)
        look = store.lookup(keys)
        hits = look.hits
        host = 0
        for t in look.tiers:
            if t is not Tier.HOST:
                break
            host += 1
        with self._lock:
            pf = self._prefetches.get(req)
        pending = False
        if host < hits:
            if pf is None:
                pol = self.settings.store.prefetch
                wait_s = self.settings.load_timeout_s if pol == "wait" else None
                pf = store.prefetch(keys[:hits], policy=pol, timeout_s=wait_s)
                with self._lock:
                    self._prefetches[req] = pf
                    while len(self._prefetches) > _MAX_PREFETCHES:
                        self._prefetches.pop(next(iter(self._prefetches))).release()
            if not pf.done and time.monotonic() < pf.deadline:
                pending = True
            elif not pf.done and pf.deadline > 0:
                self._interval.add("store_prefetch_missed", 1)
                pf.deadline = 0.0  # counted once; it goes on in the background
            host = pf.ready()
        return {"host": host, "hits": hits, "pending": pending}

    def _release(self, req_id: str) -> None:
        with self._lock:
            pf = self._prefetches.pop(req_id, None)
        if pf is not None:
            pf.release()

    # -- per step ------------------------------------------------------------------------------

    def start_step(self, meta: StoreMetadata) -> None:
        for req_id in meta.releases:
            self._release(req_id)
        if not meta.loads or self.store is None:
            return
        assert self.layout is not None
        for job in meta.loads:
            ld = self.store.get(job.keys, self.layout, job.blocks,
                                timeout_s=self.settings.load_timeout_s)
            self._loads.append((job, ld))

    def wait_layer(self, layer_name: str) -> None:
        i = self.layer_index.get(layer_name)
        if i is None:
            return
        for job, ld in self._loads:
            try:
                ld.wait_layer(i, timeout_s=self.settings.load_timeout_s)
            except kvlink.KvlinkError as exc:
                log.warning("kvlink store: request %s: layer %d not loaded in time: %s",
                            job.req_id, i, exc)

    def forward_done(self, meta: StoreMetadata) -> None:
        # The loads ended with the forward pass: a block that failed is reported (vLLM
        # recomputes exactly those).
        for job, ld in self._loads:
            with contextlib.suppress(kvlink.KvlinkError):
                ld.wait(timeout_s=self.settings.load_timeout_s)
            failed = ld.failed if ld.done else list(range(len(job.blocks)))
            for j in failed:
                self._errors.add(job.blocks[j])
            if failed:
                log.info("kvlink store: request %s: %d of %d blocks not loaded (%s); "
                         "recomputing them", job.req_id, len(failed), len(job.blocks),
                         ld.reasons.get(failed[0], "timed out"))
            self._interval.add("store_loaded_blocks", len(job.blocks) - len(failed))
            self._interval.add("store_failed_blocks", len(failed))
            self._release(job.req_id)
        self._loads = []

    def _save(self, save: StoreSave) -> None:
        store, layout = self.store, self.layout
        if store is None or layout is None:
            return
        try:
            n = store.put(save.keys, layout, save.blocks)
            self._interval.add("store_saved_blocks", n)
        except kvlink.KvlinkError as exc:
            log.warning("kvlink store: request %s: blocks not stored: %s", save.req_id, exc)

    def finished_saves(self) -> set[str]:
        with self._lock:
            done = {r for r, f in self._saving.items() if f.done()}
            for r in done:
                del self._saving[r]
                self._saving_keys.pop(r, None)
        return done

    def take_load_errors(self) -> set[int]:
        errs, self._errors = self._errors, set()
        return errs

    def take_interval_stats(self) -> StoreConnectorStats | None:
        if self.store is not None:
            s = self.store.stats()
            now = {
                "store_hit_blocks_host": s.hits["host"],
                "store_hit_blocks_disk": s.hits["disk"],
                "store_hit_blocks_remote": s.hits["remote"],
                "store_miss_blocks": s.misses,
                "store_read_bytes_host": s.bytes_read["host"],
                "store_read_bytes_disk": s.bytes_read["disk"],
                "store_read_bytes_remote": s.bytes_read["remote"],
                "store_written_bytes_host": s.bytes_written["host"],
                "store_written_bytes_disk": s.bytes_written["disk"],
                "store_evictions_host": s.evictions["host"],
                "store_evictions_disk": s.evictions["disk"],
                "store_discarded_blocks": s.discarded,
            }
            for k, v in now.items():
                d = v - self._last.get(k, 0)
                if d:
                    self._interval.add(k, d)
            self._last = now
        if self._interval.is_empty():
            return None
        out, self._interval = self._interval, StoreConnectorStats()
        return out


assert set(STORE_COUNTERS) >= {"store_prefetch_missed", "store_loaded_blocks"}
