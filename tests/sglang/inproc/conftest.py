"""SGLang's real disaggregation classes with kvlink's backend, prefill and decode in one process:
SGLang's runtime context for one rank (TP 1), its HTTP bootstrap server, its ZMQ control
sockets, two real kvlink agents over loopback and numpy buffers standing in for the KV pools.
This is how SGLang's own CPU unit tests drive backends (test/registered/unit/disaggregation),
without a model."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# loopback paths: no secret needed, no root, and every test agent on one host
os.environ["KVLINK_NICS"] = "loopback:2"

import kvlink.integrations.sglang as kvlink_sglang

# kvlink as users install it: the wheel in this venv, never the checkout above this folder
if not Path(kvlink_sglang.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()):
    raise RuntimeError(f"kvlink imported from {kvlink_sglang.__file__}, not {sys.prefix}'s wheel")

kvlink_sglang.register()

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel  # noqa: E402

from kvlink.bench.ports import free_port  # noqa: E402
from kvlink.integrations.sglang._backend import (  # noqa: E402
    KvlinkKVBootstrapServer,
    KvlinkKVManager,
    KvlinkKVReceiver,
    KvlinkKVSender,
)

LAYERS, PAGES, ITEM, AUX_SLOTS, AUX_ITEM = 3, 128, 512, 8, 64
TERMINAL = (KVPoll.Success, KVPoll.Failed)


def kv_args(bufs: list[np.ndarray], aux: np.ndarray) -> KVArgs:
    """KVArgs as SGLang's prefill/decode set them up for an MHA pool: every layer's K, then
    every layer's V, one buffer each, page size 1."""
    a = KVArgs()
    a.engine_rank = 0
    a.kv_data_ptrs = [b.ctypes.data for b in bufs]
    a.kv_data_lens = [b.nbytes for b in bufs]
    a.kv_item_lens = [ITEM] * len(bufs)
    a.kv_layer_ids = list(range(LAYERS)) * 2
    a.aux_data_ptrs = [aux.ctypes.data]
    a.aux_data_lens = [aux.nbytes]
    a.aux_item_lens = [AUX_ITEM]
    a.state_types, a.state_data_ptrs, a.state_data_lens = [], [], []
    a.state_item_lens, a.state_layer_ids, a.state_dim_per_tensor = [], [], []
    a.kv_cache_dtype_str, a.page_size, a.pp_rank, a.prefill_start_layer = "float32", 1, 0, 0
    a.system_dp_rank, a.ib_device, a.gpu_id, a.kv_head_num, a.total_kv_head_num = 0, None, 0, 2, 2
    return a


@contextlib.contextmanager
def secret_env(secret: str | None) -> Iterator[None]:
    old = os.environ.get("KVLINK_SECRET")
    if secret is None:
        os.environ.pop("KVLINK_SECRET", None)
    else:
        os.environ["KVLINK_SECRET"] = secret
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVLINK_SECRET", None)
        else:
            os.environ["KVLINK_SECRET"] = old


class Pair:
    """A prefill and a decode manager on one bootstrap server, with their KV buffers."""

    def __init__(self, stack: contextlib.ExitStack, *, prefill_secret: str | None = None,
                 decode_secret: str | None = None, seed: int = 0) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        stack.enter_context(get_context().override_server_args(
            host="127.0.0.1", port=free_port(), disaggregation_bootstrap_port=self.port,
            device="cpu"))
        self.server = KvlinkKVBootstrapServer("127.0.0.1", self.port)
        stack.callback(self.server.close)
        rng = np.random.default_rng(seed)
        self.src = [rng.integers(0, 256, PAGES * ITEM, dtype=np.uint8) for _ in range(2 * LAYERS)]
        self.dst = [np.zeros(PAGES * ITEM, np.uint8) for _ in range(2 * LAYERS)]
        self.src_aux = rng.integers(0, 256, (AUX_SLOTS, AUX_ITEM), dtype=np.uint8)
        self.dst_aux = np.zeros((AUX_SLOTS, AUX_ITEM), np.uint8)
        with secret_env(prefill_secret):
            self.prefill = KvlinkKVManager(kv_args(self.src, self.src_aux),
                                           DisaggregationMode.PREFILL, None, False)
        stack.callback(self.prefill.agent.close)
        with secret_env(decode_secret):
            self.decode = KvlinkKVManager(kv_args(self.dst, self.dst_aux),
                                          DisaggregationMode.DECODE, None, False)
        stack.callback(self.decode.agent.close)
        deadline = time.monotonic() + 10
        while not self.decode.try_ensure_parallel_info(self.addr):
            assert time.monotonic() < deadline, "prefill never registered with bootstrap"
            time.sleep(0.05)

    def start(self, room: int, dst_pages: list[int], aux_slot: int = 3
              ) -> tuple[KvlinkKVSender, KvlinkKVReceiver, Recorder]:
        """Sender and receiver for ``room`` up to the point where prefill may send."""
        sender = KvlinkKVSender(self.prefill, self.addr, room)
        receiver = KvlinkKVReceiver(self.decode, self.addr, room)
        rec = Recorder(sender, receiver)
        receiver.init(0)
        receiver.send_metadata(np.asarray(dst_pages, np.int32), aux_index=aux_slot)
        rec.until(lambda s, r: s == KVPoll.WaitingForInput or s == KVPoll.Failed)
        return sender, receiver, rec

    def expected_pages_ok(self, src_pages: list[int], dst_pages: list[int]) -> bool:
        return all(
            np.array_equal(self.dst[e][d * ITEM:(d + 1) * ITEM],
                           self.src[e][s * ITEM:(s + 1) * ITEM])
            for e in range(2 * LAYERS) for s, d in zip(src_pages, dst_pages, strict=False)
        )


class Recorder:
    """Polls a sender and a receiver as SGLang's scheduler does, keeping every status seen."""

    def __init__(self, sender: Any, receiver: Any) -> None:
        self.sender, self.receiver = sender, receiver
        self.seen: list[tuple[int, int]] = []

    def poll(self) -> tuple[int, int]:
        pair = (int(self.sender.poll()), int(self.receiver.poll()))
        self.seen.append(pair)
        return pair

    def until(self, done: Any, timeout_s: float = 15.0) -> tuple[int, int]:
        deadline = time.monotonic() + timeout_s
        while True:
            s, r = self.poll()
            if done(s, r):
                return s, r
            if time.monotonic() > deadline:
                raise AssertionError(f"no such state within {timeout_s} s; seen {self.seen[-5:]}")
            time.sleep(0.005)

    def until_terminal(self, timeout_s: float = 15.0) -> tuple[int, int]:
        return self.until(lambda s, r: s in TERMINAL and r in TERMINAL, timeout_s)

    def monotonic(self) -> bool:
        """SGLang all-reduces polls with MIN across ranks: a status may only move forward,
        and Failed (0) never turns into anything else."""
        for side in (0, 1):
            seq = [p[side] for p in self.seen]
            if KVPoll.Failed in seq and any(v != KVPoll.Failed for v in
                                            seq[seq.index(KVPoll.Failed):]):
                return False
            live = [v for v in seq if v != KVPoll.Failed]
            if any(b < a for a, b in itertools.pairwise(live)):
                return False
        return True


@pytest.fixture(scope="module")
def ctx() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(get_parallel().override(
            attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, pp_rank=0, tp_rank=0,
            attn_dcp_rank=0, pp_group=None))
        yield stack


@pytest.fixture(scope="module")
def pair(ctx: contextlib.ExitStack) -> Pair:
    return Pair(ctx)
