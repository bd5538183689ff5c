"""Sends prompts to an OpenAI-compatible server (the proxy) and prints each one's TTFT.

    python examples/vllm_disagg/client.py --url http://127.0.0.1:8000 --lengths 256,1024

Prompts are made of the example tokenizer's words (w0 .. w1019), one word a token. TTFT is the
time from sending the request to the first streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: what --models-url serves")
    ap.add_argument("--models-url", default=None, help="a server with /v1/models (default --url)")
    ap.add_argument("--lengths", default="256,1024,1900")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        model = a.model
        if model is None:
            async with s.get(f"{a.models_url or a.url}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        for n in [int(x) for x in a.lengths.split(",")]:
            for _ in range(a.repeat):
                prompt = " ".join(f"w{rng.randrange(1020)}" for _ in range(n))
                ttft, text = await one(s, a.url, model, prompt, a.max_tokens)
                print(json.dumps({"prompt_tokens": n, "ttft_ms": round(ttft * 1000, 1),
                                  "text": text[:60]}))


if __name__ == "__main__":
    asyncio.run(main())
