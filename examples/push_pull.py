"""Push a paged KV cache from a prefill agent to a decode agent, then pull it back.

Both agents live in this one process and talk over two loopback paths
(127.0.0.1 and 127.0.0.2), so this runs anywhere without root:

    .venv/bin/python examples/push_pull.py

In a real deployment each agent runs in its own process (one per GPU worker)
and the metadata and layout travel over whatever channel the serving system
already has (its router, an RPC, a key-value store).
"""

from __future__ import annotations

import json
import sys

import numpy as np

import kvlink
from kvlink import kv

LAYERS, PLANES, BLOCKS, BLOCK_BYTES = 3, 2, 32, 64 * kvlink.KiB  # K and V planes, as in vLLM
SRC_BLOCKS = [3, 9, 10, 11]  # the prompt's blocks on the prefill side ...
DST_BLOCKS = [0, 1, 2, 3]  # ... and where the decode side allocated them

# Small chunks so that this small cache still spreads over both paths.
cfg = kvlink.Config(nics="loopback:2", min_chunk_bytes=64 * kvlink.KiB)


def main() -> int:
    with kvlink.Agent("decode-0", cfg) as dec, kvlink.Agent("prefill-0", cfg) as pre:
        # ---- decode side: a zeroed cache that peers may write (push) and read (pull)
        dst_cache = np.zeros((LAYERS, PLANES, BLOCKS, BLOCK_BYTES), np.uint8)
        dec.register(dst_cache, remote_write=True, remote_read=True, name="kv")
        dst_layout = kv.PagedLayout.from_tensors(dec, list(dst_cache), planes=PLANES)
        # what the decode side hands to the prefill side (any byte channel will do)
        offer = json.dumps({"metadata": dec.metadata().decode(), "layout": dst_layout.to_dict()})

        # ---- prefill side: the computed cache, registered for local use only
        rng = np.random.default_rng(42)
        src_cache = rng.integers(0, 256, dst_cache.shape, dtype=np.uint8)
        pre.register(src_cache)
        src_layout = kv.PagedLayout.from_tensors(pre, list(src_cache), planes=PLANES)

        msg = json.loads(offer)
        peer = pre.add_peer(msg["metadata"])  # control + one data connection per path
        segs = kv.block_segments(
            src_layout, kv.PagedLayout.from_dict(msg["layout"]), SRC_BLOCKS, DST_BLOCKS
        )
        print(f"{len(segs)} segments, {int(segs['len'].sum())} bytes, layers 0..{LAYERS - 1}")

        h = pre.push(peer, segments=segs, notify=b"req-42")
        h.wait_layer(0, timeout_s=10)  # decode could start on layer 0 now
        print(f"layer 0 verified at {peer}: {h.bytes_done} of {h.nbytes} bytes so far")
        h.wait(timeout_s=30)  # every chunk verified; raises a TransferError on failure
        info = h.info()
        print(f"push done: {info.chunks_total} chunks, {info.retries} retries")
        for ev in h.chunks():  # completion order; layers = the layers that chunk closed
            print(f"  chunk {ev.index}: {ev.nbytes} bytes on path {ev.path}, closed {ev.layers}")

        # ---- decode side: check the bytes and take the notification
        expected = np.zeros_like(dst_cache)
        expected[:, :, DST_BLOCKS] = src_cache[:, :, SRC_BLOCKS]
        if not np.array_equal(dst_cache, expected):
            print("FAIL: the decode cache differs from the prefill blocks", file=sys.stderr)
            return 1
        for n in dec.notifications(timeout_s=5):
            print(f"decode-0 got {n.op.name} notification {n.tag!r} from {n.peer}")

        # ---- pull the whole decode cache back into a fresh prefill buffer
        back = np.empty_like(dst_cache)
        pre.register(back)
        pre.pull(peer, src="kv", dst=back, notify=b"pulled").wait(timeout_s=30)
        if not np.array_equal(back, dst_cache):
            print("FAIL: the pulled bytes differ from the decode cache", file=sys.stderr)
            return 1
        print(f"pull done: {back.nbytes} bytes match")
        for n in dec.notifications(timeout_s=5):
            print(f"decode-0 got {n.op.name} notification {n.tag!r} from {n.peer}")

        for p in pre.paths():
            print(
                f"path {p.index} {p.local} -> {p.remote}: {p.state.name}, "
                f"sent {p.bytes_sent} B, received {p.bytes_recv} B, {p.chunks_done} chunks"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
