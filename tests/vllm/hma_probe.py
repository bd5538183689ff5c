"""What vLLM hands a connector that supports its hybrid KV cache manager (HMA), with a model of
two KV cache groups (sliding-window and full-attention layers), and a stand-in for a P/D
transfer that shows which of those blocks a decode needs.

Runs in the vLLM virtualenv, one in-process engine:
``.venv-vllm/bin/python tests/vllm/hma_probe.py MODEL_DIR OUT.jsonl 94,95,250``.
``HmaProbeConnector`` (``SupportsHMA``, so vLLM keeps the hybrid manager on) writes every hook
call to OUT.jsonl. For each prompt length the engine computes the prompt itself (the baseline),
then runs it as a "prefill" (max_tokens 1; request_finished_all_groups holds its blocks) and as
a "decode" of the same prompt that loads all but the last token: its blocks are first filled
with random values (x100: a block read by mistake shows in the tokens), then, group by group
and position by position, filled from the prefill's blocks wherever both lists hold a real
block (block 0 is vLLM's null block: a position the sliding window has left, or never needs).
Once with a prefill of the whole prompt (as P/D prefills run today), once with a prefill of
all but its last token (the tokens decode loads), and once more so with the sliding group's
first block that both hold randomised (a negative control). The last stdout line is the
result as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

# Scheduler side: the held "prefill" requests' block ids by key (both sides of the stand-in
# live in this one process).
HELD: dict[str, tuple[str, list[list[int]]]] = {}


def _record(path: str, **kw: Any) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(kw, default=str) + "\n")


@dataclasses.dataclass
class _Meta(KVConnectorMetadata):
    loads: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    release: list[str] = dataclasses.field(default_factory=list)


class HmaProbeConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.out = self._kv_transfer_config.kv_connector_extra_config["out"]
        c = kv_cache_config
        self.groups = [list(g.layer_names) for g in c.kv_cache_groups]
        self._pending: list[dict[str, Any]] = []
        self._release: list[str] = []
        self._to_release: set[str] = set()
        self.caches: dict[str, Any] = {}
        _record(
            self.out, ev="init", role=role.name, num_blocks=c.num_blocks,
            hma_disabled=vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
            groups=[{
                "layers": list(g.layer_names), "spec": type(g.kv_cache_spec).__name__,
                "block_size": g.kv_cache_spec.block_size,
                "page_size_bytes": g.kv_cache_spec.page_size_bytes,
                "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
            } for g in c.kv_cache_groups],
            tensors=[{"size": t.size, "layers": list(t.layers), "offset": t.offset,
                      "layer_stride": t.layer_stride, "block_stride": t.block_stride}
                     for t in c.kv_cache_tensors],
            transfer_group_ids=list(c.transfer_group_ids),
        )

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.caches = kv_caches
        _record(self.out, ev="register", caches={
            n: {"shape": list(t.shape), "dtype": str(t.dtype), "data_ptr": t.data_ptr(),
                "storage_nbytes": t.untyped_storage().nbytes()}
            for n, t in kv_caches.items()})

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        import torch

        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        self._to_release |= set(meta.release)
        gen = torch.Generator().manual_seed(1234)
        for job in meta.loads:
            src, dst = job["src"], job["dst"]
            both = [[i for i, (s, d) in enumerate(zip(src[g], dst[g], strict=False)) if s and d]
                    for g in range(len(self.groups))]
            # negative control: the first position of group 0 (sliding) that both hold
            drop = (0, both[0][0]) if job["drop"] and both[0] else None
            for g, layers in enumerate(self.groups):
                for i, d in enumerate(dst[g]):
                    if not d:
                        continue
                    for name in layers:
                        t = self.caches[name]
                        if i in both[g] and (g, i) != drop:
                            t[d].copy_(t[src[g][i]])
                        else:
                            t[d].copy_(torch.randn(t[d].shape, generator=gen) * 100)
            _record(self.out, ev="copied", req=job["req"], positions=both, dropped=drop)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        done, self._to_release = self._to_release, set()
        return (done or None), None

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int,
                                                                                         bool]:
        p = request.kv_transfer_params or {}
        if p.get("probe_load") in HELD:
            return len(request.prompt_token_ids) - 1 - num_computed_tokens, False
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        ids = [list(x) for x in blocks.get_block_ids()]
        _record(self.out, ev="update_state_after_alloc", req=request.request_id,
                prompt_len=len(request.prompt_token_ids),
                num_external_tokens=num_external_tokens, block_ids=ids,
                type=type(blocks.get_block_ids()).__name__)
        p = request.kv_transfer_params or {}
        if num_external_tokens and p.get("probe_load") in HELD:
            src_req, src = HELD.pop(p["probe_load"])
            self._pending.append({"req": request.request_id, "src": src, "dst": ids,
                                  "drop": bool(p.get("drop"))})
            self._release.append(src_req)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = _Meta(loads=self._pending, release=self._release)
        self._pending, self._release = [], []
        return meta

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # a P/D load restores every group, not only the prefix-cacheable ones (the default)
        return tuple(self._kv_cache_config.transfer_group_ids)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        _record(self.out, ev="request_finished", req=request.request_id, block_ids=block_ids)
        return False, None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        ids = [list(x) for x in block_ids]
        p = request.kv_transfer_params or {}
        _record(self.out, ev="request_finished_all_groups", req=request.request_id,
                prompt_len=len(request.prompt_token_ids), hold=p.get("probe_hold"),
                num_computed_tokens=request.num_computed_tokens, block_ids=ids,
                type=type(block_ids).__name__)
        if p.get("probe_hold"):
            HELD[p["probe_hold"]] = (request.request_id, ids)
            return True, None
        return False, None


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model, out, lengths = sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3].split(",")]
    if os.path.exists(out):
        os.remove(out)
    llm = LLM(
        model=model, dtype="float32", max_model_len=1024, block_size=32, enforce_eager=True,
        max_num_seqs=4, max_num_batched_tokens=1024, seed=0, enable_prefix_caching=False,
        disable_hybrid_kv_cache_manager=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HmaProbeConnector", kv_connector_module_path="hma_probe",
            kv_role="kv_both", kv_connector_extra_config={"out": out}),
    )

    def gen(p: list[int], params: dict[str, Any] | None, n: int) -> list[int]:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        o = llm.generate([TokensPrompt(prompt_token_ids=p)], [sp], use_tqdm=False)
        return list(o[0].outputs[0].token_ids)

    rng = random.Random(1)
    res = {}
    for n in lengths:
        p = [rng.randrange(4, 1000) for _ in range(n)]
        base = gen(p, None, 8)
        # prefill computes the whole prompt, as a P/D prefill does today
        gen(p, {"probe_hold": f"a{n}"}, 1)
        whole = gen(p, {"probe_load": f"a{n}"}, 8)
        # prefill computes all but the last token, the ones decode loads
        gen(p[:-1], {"probe_hold": f"b{n}"}, 1)
        got = gen(p, {"probe_load": f"b{n}"}, 8)
        gen(p[:-1], {"probe_hold": f"c{n}"}, 1)
        neg = gen(p, {"probe_load": f"c{n}", "drop": True}, 8)
        res[n] = {"baseline": base, "from_whole_prompt": whole, "loaded": got, "negative": neg}
    sys.stdout.write(json.dumps(res) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the engine's threads would hold the exit


if __name__ == "__main__":
    main()
