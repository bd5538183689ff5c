"""Builds a small random-weight Llama and a word-level tokenizer in a folder (no model hub).

    python examples/vllm_disagg/make_model.py /tmp/tiny-llama            # ~1 MB, 2 layers
    python examples/vllm_disagg/make_model.py /tmp/big-kv --layers 16 --hidden 256 \
        --kv-heads 8 --head-dim 128                                    # 128 KiB of KV a token

The weights are random (seeded), so the text is gibberish, but prefill and decode compute real
attention over real KV: greedy decoding is deterministic and any wrong KV changes the tokens.
vLLM's CPU attention needs head_dim >= 32. Runs in the vLLM virtualenv (torch, transformers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


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
) -> Path:
    """Writes the model and tokenizer to ``path`` (returned) unless already there."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    spec = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "vocab": vocab, "max_positions": max_positions, "seed": seed}
    stamp = out / "kvlink-model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_positions, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
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
    ap.add_argument("--layers", type=int, default=2)
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
                head_dim=a.head_dim, vocab=a.vocab, seed=a.seed))


if __name__ == "__main__":
    main()
