r"""Sends prompts to an OpenAI-compatible server (the proxy) and prints each one's TTFT.

    python examples/vllm_disagg/client.py --url http://127.0.0.1:8000 \
        --models-url http://127.0.0.1:8200 --lengths 256,1024 --save /tmp/proxy.jsonl
    python examples/vllm_disagg/client.py --url http://127.0.0.1:8200 \
        --lengths 256,1024 --against /tmp/proxy.jsonl

Prompts are made of the example tokenizer's words (w0 .. w1019), one word a token. Prompt
``N#i`` (the i-th of length N, i < --repeat) depends only on --seed, N and i, so two runs with
the same --lengths and --repeat send the same prompts. TTFT is the time from sending the
request to the first streamed token. --save keeps each prompt's generated text; --against
compares each text with a saved run's (greedy decoding: the same prompt gives the same text
through the proxy and on one server alone), says which differ and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import aiohttp


async def one(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
              max_tokens: int) -> tuple[float, str]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    text = []
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(chunk["choices"][0]["text"])
    assert ttft is not None, "no token streamed"
    return ttft, "".join(text)


def prompt_of(seed: int, n: int, i: int) -> str:
    """Prompt ``n#i``: the same for the same seed, length and index, whatever else is sent."""
    rng = random.Random(f"{seed}:{n}:{i}")
    return " ".join(f"w{rng.randrange(1020)}" for _ in range(n))


async def model_of(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(f"{url}/v1/models") as r:
        if r.status != 200:
            sys.exit(f"client: {url}/v1/models answered {r.status}: give --model NAME or "
                     "--models-url with a vLLM server's URL")
        return str((await r.json())["data"][0]["id"])


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: what --models-url serves")
    ap.add_argument("--models-url", default=None, help="a server with /v1/models (default --url)")
    ap.add_argument("--lengths", default="256,1024,1900")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=1, help="prompts of each length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="write each prompt's row (JSON lines) here")
    ap.add_argument("--against", default=None,
                    help="compare each prompt's text with the rows --save wrote")
    a = ap.parse_args()
    saved: dict[str, str] = {}
    if a.against:
        with open(a.against) as f:
            saved = {row["prompt"]: row["text"] for row in map(json.loads, f)}
    rows = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        model = a.model or await model_of(s, a.models_url or a.url)
        for n in [int(x) for x in a.lengths.split(",")]:
            for i in range(a.repeat):
                ttft, text = await one(s, a.url, model, prompt_of(a.seed, n, i), a.max_tokens)
                row: dict[str, object] = {"prompt": f"{n}#{i}", "prompt_tokens": n,
                                          "ttft_ms": round(ttft * 1000, 1), "text": text}
                rows.append(row)
                shown = dict(row, text=text[:60])
                if a.against:
                    shown["same_text"] = saved.get(str(row["prompt"])) == text
                print(json.dumps(shown), flush=True)
    if a.save:
        with open(a.save, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if a.against:
        differ = [str(r["prompt"]) for r in rows if saved.get(str(r["prompt"])) != r["text"]]
        if differ:
            print(f"texts differ from {a.against} for prompts {', '.join(differ)}")
            return 1
        print(f"all {len(rows)} prompts: the same text as in {a.against}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
