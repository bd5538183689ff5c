"""A small disaggregation proxy for vLLM OpenAI servers running KvlinkConnector: one prefill and
one decode server, or pools of each.

    python examples/vllm_disagg/proxy.py --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 --port 8000 --mode pull|push
    python examples/vllm_disagg/proxy.py --prefill http://p0:8100 --prefill http://p1:8100 \
        --decode http://d0:8200 --decode http://d1:8200 --port 8000

Clients talk to it as to one OpenAI server (POST /v1/completions or /v1/chat/completions,
streaming or not; GET /v1/models answers what a decode instance serves). GET /stats shows each
instance's outstanding work and counts.

Pools: each request goes to the prefill instance and the decode instance with the least
outstanding work, that is the prompt tokens of the requests it has in flight (so a 1900-token
prompt weighs as much as ~8 short ones), then the fewest requests in flight; ties rotate, so
that requests sent one at a time still spread. Prompt tokens are estimated before prefill (4
characters a token; token-id prompts are counted) and taken from prefill's answer (its
`usage`) for the decode choice in pull mode. An instance that refuses the connection is left
out for --down-s seconds and the request goes to the next one (prefill; and decode when the
request never reached it).

pull (NixlConnector's contract, so this proxy works with it too): the prompt goes to prefill with
max_tokens=1 and kv_transfer_params={"do_remote_decode": true}; prefill's answer carries
kv_transfer_params (its card, the block ids, a tag and the lease), passed unchanged to decode,
which pulls the blocks and generates.

push: every instance's card is fetched once (a one-token request with
{"kvlink_card_only": true}), as soon as it answers: started before its servers, the proxy asks
again every 2 s for up to --wait-s, and a request meanwhile is answered 503 saying which card
is missing. Each request gets a transfer id and goes to decode
({"do_remote_prefill": true, "kvlink_push": {"transfer_id", "prefill": <card>}}) and, at the same
time, to prefill ({"do_remote_decode": true, "kvlink_push": {"transfer_id", "decode": <card>}}).
Decode sends its block ids to prefill, which pushes every layer as it computes it. Prefill's
answer carries its current card: a restarted prefill is picked up by the next request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("proxy")

# Connection-level failures: the request did not reach the instance (or it died), so it is
# left out for a while and the request may go to another one.
UNREACHABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
               aiohttp.ClientOSError)


def estimate_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens of a completion or chat request, estimated without a tokenizer: token
    ids are counted, text is ~4 characters a token (only the relative sizes matter here)."""
    prompt = body.get("prompt")
    if prompt is None:  # chat: the messages' text
        prompt = [m.get("content") for m in body.get("messages") or [] if isinstance(m, dict)]
    items = prompt if isinstance(prompt, list) else [prompt]
    if items and all(isinstance(t, int) for t in items):
        return len(items)
    total = 0
    for item in items:
        if isinstance(item, str):
            total += len(item) // 4
        elif isinstance(item, list):  # token ids, or chat content parts
            total += sum(1 if isinstance(t, int) else len(str(t)) // 4 for t in item)
    return max(1, total)


class Instance:
    """One server of a pool and what the proxy has in flight there."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.work = 0  # prompt tokens of the requests in flight here
        self.in_flight = 0
        self.served = 0
        self.failed = 0
        self.down_until = 0.0
        self.card: Any = None  # push mode

    @contextlib.contextmanager
    def busy(self, tokens: int) -> Iterator[None]:
        self.work += tokens
        self.in_flight += 1
        try:
            yield
        finally:
            self.work -= tokens
            self.in_flight -= 1

    def stats(self) -> dict[str, Any]:
        return {"url": self.url, "work": self.work, "in_flight": self.in_flight,
                "served": self.served, "failed": self.failed,
                "down": self.down_until > time.monotonic()}


class Pool:
    """Prefill or decode instances; picks the one with the least outstanding work."""

    def __init__(self, role: str, urls: list[str], down_s: float) -> None:
        self.role = role
        self.instances = [Instance(u) for u in urls]
        self.down_s = down_s
        self._turn = 0

    def pick(self, exclude: set[Instance]) -> Instance | None:
        now = time.monotonic()
        n = len(self.instances)
        candidates = [i for i in self.instances if i not in exclude]
        up = [i for i in candidates if i.down_until <= now]
        candidates = up or candidates  # all down: try one anyway rather than fail at once
        if not candidates:
            return None
        turn, self._turn = self._turn, (self._turn + 1) % n
        return min(candidates, key=lambda i: (
            i.work, i.in_flight, (self.instances.index(i) - turn) % n))

    def mark_down(self, inst: Instance, exc: BaseException) -> None:
        inst.failed += 1
        inst.down_until = time.monotonic() + self.down_s
        log.warning("%s %s unreachable (%s); left out for %.0f s",
                    self.role, inst.url, exc, self.down_s)


# One try at an instance's card: a vLLM server that is still starting has bound its port but
# does not answer yet, so a try that waits longer only delays the next.
CARD_TRY_S = 5.0


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], mode: str, timeout_s: float,
                 down_s: float, wait_s: float = 600.0) -> None:
        self.prefill = Pool("prefill", prefill, down_s)
        self.decode = Pool("decode", decode, down_s)
        self.mode = mode
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.wait_s = wait_s
        self.session: aiohttp.ClientSession | None = None
        self._cards: asyncio.Task[None] | None = None

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout)
        if self.mode == "push":  # the proxy serves at once; the cards come as servers answer
            self._cards = asyncio.create_task(self.fetch_cards())

    async def stop(self, app: web.Application) -> None:
        if self._cards is not None:
            self._cards.cancel()
        if self.session is not None:
            await self.session.close()

    async def fetch_cards(self) -> None:
        """Push: every instance's card, asked for every 2 s until the instance answers or
        --wait-s is over (servers started with the proxy take minutes). A request that picks
        an instance whose card is missing asks for it itself."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.wait_s
        waiting: dict[Instance, str] = {}
        said = False
        while True:
            for inst in [*self.prefill.instances, *self.decode.instances]:
                if inst.card is not None:
                    waiting.pop(inst, None)
                    continue
                try:
                    await asyncio.wait_for(self.fetch_card(inst), CARD_TRY_S)
                    waiting.pop(inst, None)
                except Exception as exc:  # not up yet: refused, no answer, an error page
                    waiting[inst] = f"{type(exc).__name__} {exc}".strip()
            if not waiting:
                if said:
                    log.info("every instance's card fetched")
                return
            if not said:
                log.info("push mode: waiting for %s to answer (their cards), up to %.0f s",
                         ", ".join(i.url for i in waiting), self.wait_s)
                said = True
            if loop.time() > end:
                log.error("no card from %s within --wait-s %.0f s (%s); requests that pick "
                          "them ask again", ", ".join(i.url for i in waiting), self.wait_s,
                          "; ".join(waiting.values()))
                return
            await asyncio.sleep(2)

    async def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.post(url, json=body) as r:
            if r.status != 200:
                raise web.HTTPBadGateway(text=f"{url}: {r.status} {await r.text()}")
            data: dict[str, Any] = await r.json()
            return data

    async def fetch_card(self, inst: Instance) -> Any:
        ans = await self._post(f"{inst.url}/v1/completions", {
            "model": await self.model(inst.url), "prompt": "w1 w2", "max_tokens": 1,
            "kv_transfer_params": {"kvlink_card_only": True}})
        inst.card = ans["kv_transfer_params"]["kvlink"]["card"]
        log.info("card of %s fetched", inst.url)
        return inst.card

    async def model(self, base: str) -> str:
        assert self.session is not None
        async with self.session.get(f"{base}/v1/models") as r:
            if r.status != 200:
                raise web.HTTPBadGateway(text=f"{base}/v1/models: {r.status}")
            return str((await r.json())["data"][0]["id"])

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: a decode instance's answer, so that OpenAI clients (and
        client.py without --models-url) find the model name through the proxy."""
        assert self.session is not None
        tried: set[Instance] = set()
        while (d := self.decode.pick(tried)) is not None:
            tried.add(d)
            try:
                async with self.session.get(f"{d.url}/v1/models") as r:
                    return web.Response(status=r.status, body=await r.read(),
                                        content_type="application/json")
            except UNREACHABLE as exc:
                self.decode.mark_down(d, exc)
        raise web.HTTPBadGateway(text="no decode instance can be reached")

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({
            "prefill": [i.stats() for i in self.prefill.instances],
            "decode": [i.stats() for i in self.decode.instances]})

    async def _prefill(self, path: str, body: dict[str, Any],
                       tokens: int) -> tuple[Instance, dict[str, Any]]:
        """Prefill's answer to ``body``, from the least loaded prefill instance that can be
        reached."""
        tried: set[Instance] = set()
        while (inst := self.prefill.pick(tried)) is not None:
            tried.add(inst)
            try:
                with inst.busy(tokens):
                    ans = await self._post(f"{inst.url}{path}", body)
                inst.served += 1
                return inst, ans
            except UNREACHABLE as exc:
                self.prefill.mark_down(inst, exc)
        raise web.HTTPBadGateway(text="no prefill instance can be reached")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        path = request.path
        tokens = estimate_tokens(body)
        if self.mode == "pull":
            pre = dict(body, max_tokens=1, stream=False,
                       kv_transfer_params={"do_remote_decode": True})
            if "max_completion_tokens" in body:
                pre["max_completion_tokens"] = 1
            pre.pop("stream_options", None)
            _, ans = await self._prefill(path, pre, tokens)
            tokens = int((ans.get("usage") or {}).get("prompt_tokens") or tokens)
            dec = dict(body, kv_transfer_params=ans.get("kv_transfer_params"))
            return await self._relay(request, path, dec, tokens)
        return await self._push(request, path, body, tokens)

    async def _push(self, request: web.Request, path: str, body: dict[str, Any],
                    tokens: int) -> web.StreamResponse:
        p_inst = self.prefill.pick(set())
        d_inst = self.decode.pick(set())
        if p_inst is None or d_inst is None:
            raise web.HTTPBadGateway(text="no instance")
        try:
            p_card = p_inst.card or await asyncio.wait_for(self.fetch_card(p_inst), CARD_TRY_S)
            d_card = d_inst.card or await asyncio.wait_for(self.fetch_card(d_inst), CARD_TRY_S)
        except Exception as exc:  # not up yet, or gone
            raise web.HTTPServiceUnavailable(
                text=f"push mode needs the cards of {p_inst.url} and {d_inst.url}, and one "
                f"could not be fetched ({type(exc).__name__} {exc}): are both servers up?"
            ) from exc
        tid = uuid.uuid4().hex
        pre = dict(body, max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "kvlink_push": {"transfer_id": tid, "decode": d_card}})
        pre.pop("stream_options", None)
        dec = dict(body, kv_transfer_params={
            "do_remote_prefill": True, "kvlink_push": {"transfer_id": tid, "prefill": p_card}})
        # Decode first: its offer (the destination blocks) then waits at prefill for the push.
        relay = asyncio.create_task(self._relay(request, path, dec, tokens, d_inst))
        await asyncio.sleep(0)
        try:
            with p_inst.busy(tokens):
                ans = await self._post(f"{p_inst.url}{path}", pre)
            p_inst.served += 1
            card = (ans.get("kv_transfer_params") or {}).get("kvlink", {}).get("card")
            if card:
                p_inst.card = card  # a restarted prefill has a new card
        except Exception as exc:  # decode recomputes or fails by its own policy
            if isinstance(exc, UNREACHABLE):
                self.prefill.mark_down(p_inst, exc)
                p_inst.card = None
            log.warning("prefill %s failed for %s: %s", p_inst.url, tid, exc)
        return await relay

    async def _relay(self, request: web.Request, path: str, body: dict[str, Any], tokens: int,
                     inst: Instance | None = None) -> web.StreamResponse:
        """Decode's answer, streamed to the client; the least loaded decode instance unless
        ``inst`` is given (push: its card went to prefill already)."""
        assert self.session is not None
        tried: set[Instance] = set()
        while (d := inst or self.decode.pick(tried)) is not None:
            tried.add(d)
            try:
                with d.busy(tokens):
                    async with self.session.post(f"{d.url}{path}", json=body) as r:
                        resp = web.StreamResponse(status=r.status, headers={
                            "Content-Type": r.headers.get("Content-Type", "application/json")})
                        await resp.prepare(request)
                        async for chunk in r.content.iter_any():
                            await resp.write(chunk)
                        await resp.write_eof()
                d.served += 1
                return resp
            except aiohttp.ClientConnectorError as exc:  # never reached it: another may serve
                self.decode.mark_down(d, exc)
                if inst is not None:
                    break
        raise web.HTTPBadGateway(text="no decode instance can be reached")


def urls(values: list[str]) -> list[str]:
    return [u for v in values for u in v.split(",") if u]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", action="append", required=True,
                    help="a prefill server's URL; repeat it (or separate by commas) for a pool")
    ap.add_argument("--decode", action="append", required=True,
                    help="a decode server's URL; repeat it (or separate by commas) for a pool")
    ap.add_argument("--mode", choices=["pull", "push"], default="pull")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--down-s", type=float, default=5.0,
                    help="how long an instance that refused a connection is left out")
    ap.add_argument("--wait-s", type=float, default=600.0,
                    help="push: how long to keep asking servers that do not answer yet for "
                    "their cards (default 600 s; started with the proxy, they take minutes)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="proxy %(levelname)s %(message)s")
    proxy = Proxy(urls(a.prefill), urls(a.decode), a.mode, a.timeout_s, a.down_s, a.wait_s)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/stats", proxy.stats)
    web.run_app(app, host=a.host, port=a.port, print=None)


if __name__ == "__main__":
    main()
