"""A small disaggregation proxy for two vLLM OpenAI servers running KvlinkConnector.

    python examples/vllm_disagg/proxy.py --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 --port 8000 --mode pull|push

Clients talk to it as to one OpenAI server (POST /v1/completions, streaming or not).

pull (NixlConnector's contract, so this proxy works with it too): the prompt goes to prefill with
max_tokens=1 and kv_transfer_params={"do_remote_decode": true}; prefill's answer carries
kv_transfer_params (its card, the block ids, a tag and the lease), passed unchanged to decode,
which pulls the blocks and generates.

push: both instances' cards are fetched once (a one-token request with
{"kvlink_card_only": true}); each request gets a transfer id and goes to decode
({"do_remote_prefill": true, "kvlink_push": {"transfer_id", "prefill": <card>}}) and, at the same
time, to prefill ({"do_remote_decode": true, "kvlink_push": {"transfer_id", "decode": <card>}}).
Decode sends its block ids to prefill, which pushes every layer as it computes it. Prefill's
answer carries its current card: a restarted prefill is picked up by the next request.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("proxy")


class Proxy:
    def __init__(self, prefill: str, decode: str, mode: str, timeout_s: float) -> None:
        self.prefill, self.decode, self.mode = prefill.rstrip("/"), decode.rstrip("/"), mode
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.cards: dict[str, Any] = {}

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout)
        if self.mode == "push":
            await self.fetch_cards()

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def _complete(self, base: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.post(f"{base}/v1/completions", json=body) as r:
            if r.status != 200:
                raise web.HTTPBadGateway(text=f"{base}: {r.status} {await r.text()}")
            data: dict[str, Any] = await r.json()
            return data

    async def fetch_cards(self) -> None:
        for name, base in (("prefill", self.prefill), ("decode", self.decode)):
            ans = await self._complete(base, {
                "model": await self.model(base), "prompt": "w1 w2", "max_tokens": 1,
                "kv_transfer_params": {"kvlink_card_only": True}})
            self.cards[name] = ans["kv_transfer_params"]["kvlink"]["card"]
        log.info("cards of prefill (%s) and decode (%s) fetched",
                 self.cards["prefill"]["agent"], self.cards["decode"]["agent"])

    async def model(self, base: str) -> str:
        assert self.session is not None
        async with self.session.get(f"{base}/v1/models") as r:
            return str((await r.json())["data"][0]["id"])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.mode == "pull":
            pre = dict(body, max_tokens=1, stream=False,
                       kv_transfer_params={"do_remote_decode": True})
            pre.pop("stream_options", None)
            ans = await self._complete(self.prefill, pre)
            dec = dict(body, kv_transfer_params=ans.get("kv_transfer_params"))
            return await self._relay(request, dec)
        tid = uuid.uuid4().hex
        pre = dict(body, max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True,
            "kvlink_push": {"transfer_id": tid, "decode": self.cards["decode"]}})
        pre.pop("stream_options", None)
        dec = dict(body, kv_transfer_params={
            "do_remote_prefill": True,
            "kvlink_push": {"transfer_id": tid, "prefill": self.cards["prefill"]}})
        # Decode first: its offer (the destination blocks) then waits at prefill for the push.
        relay = asyncio.create_task(self._relay(request, dec))
        await asyncio.sleep(0)
        prefill = asyncio.create_task(self._complete(self.prefill, pre))
        try:
            ans = await prefill
            card = (ans.get("kv_transfer_params") or {}).get("kvlink", {}).get("card")
            if card:
                self.cards["prefill"] = card  # a restarted prefill has a new card
        except Exception as exc:  # decode recomputes or fails by its own policy
            log.warning("prefill failed for %s: %s", tid, exc)
        return await relay

    async def _relay(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        assert self.session is not None
        async with self.session.post(f"{self.decode}/v1/completions", json=body) as r:
            resp = web.StreamResponse(status=r.status, headers={
                "Content-Type": r.headers.get("Content-Type", "application/json")})
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--mode", choices=["pull", "push"], default="pull")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="proxy %(levelname)s %(message)s")
    proxy = Proxy(a.prefill, a.decode, a.mode, a.timeout_s)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.completions)
    web.run_app(app, host=a.host, port=a.port, print=None)


if __name__ == "__main__":
    main()
