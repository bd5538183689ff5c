"""Prefill failures seen from a real SGLang decode server: a killed prefill, a prefill with the
wrong cluster secret, and a prefill restarted on the same bootstrap port afterwards. One decode
server lives through all of them; each prefill is started when its test needs it."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.sglang import harness

pytestmark = pytest.mark.timeout(600)
PROMPT = harness.prompt_of(300, seed=11)
# decode notices a dead prefill through SGLang's heartbeat to its bootstrap server (2 s, the
# floor SGLang allows, and one miss)
DECODE_ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
              "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1"}


class Cluster:
    def __init__(self, model: Path, log_dir: Path, secret: str) -> None:
        self.model, self.log_dir, self.secret = model, log_dir, secret
        self.bootstrap_port = harness.free_port()
        self.decode = harness.Server("decode", model, log_dir=log_dir, mode="decode",
                                     bootstrap_port=0, cpu=1,
                                     env={**self.env(secret), **DECODE_ENV})
        self.prefills: list[harness.Server] = []

    def env(self, secret: str) -> dict[str, str]:
        return {"KVLINK_NICS": "loopback:2", "KVLINK_SECRET": secret}

    def prefill(self, name: str, secret: str) -> harness.Server:
        p = harness.Server(name, self.model, log_dir=self.log_dir, mode="prefill",
                           bootstrap_port=self.bootstrap_port, cpu=0, env=self.env(secret))
        self.prefills.append(p)
        return p

    def close(self) -> None:
        harness.close_all([*self.prefills, self.decode])


def used_tokens(s: harness.Server) -> int:
    """KV tokens the server's scheduler holds (SGLang's /v1/loads), pages of requests that
    wait for their KV included."""
    with urllib.request.urlopen(s.url + "/v1/loads?include=core", timeout=10) as r:
        loads = json.loads(r.read())["loads"]
    return int(sum(load["num_used_tokens"] for load in loads))


@pytest.fixture(scope="module")
def cluster(sglang_model: Path, log_dir: Path, cluster_secret: str) -> Iterator[Cluster]:
    c = Cluster(sglang_model, log_dir, cluster_secret)
    try:
        harness.start_all([c.decode, c.prefill("prefill-1", cluster_secret)])
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def expected_ids(cluster: Cluster) -> list[int]:
    r = harness.pd_generate(cluster.prefills[0], cluster.decode, PROMPT)
    assert r["decode_status"] == 200, r
    ids = harness.output_ids(r["decode"])
    assert ids and len(ids) == 8
    return ids


def decode_failure(answer: Any) -> str:
    """What decode told the client about a failed request."""
    return json.dumps(answer)


def test_killed_prefill_fails_the_request_and_decode_lets_go_of_its_pages(
        cluster: Cluster, expected_ids: list[int]) -> None:
    prefill = cluster.prefills[0]
    body = harness.request_body(PROMPT)
    body.update(bootstrap_host=prefill.host, bootstrap_port=prefill.bootstrap_port,
                bootstrap_room=987654321)
    with cf.ThreadPoolExecutor(1) as ex:
        # decode alone: it allocates pages and tells prefill where they are, then waits
        fut = ex.submit(harness.generate, cluster.decode.url, body, 120)
        deadline = time.monotonic() + 30
        while used_tokens(cluster.decode) < 300 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert used_tokens(cluster.decode) >= 300   # the request's pages are allocated
        prefill.kill()
        status, answer, _took = fut.result(timeout=150)
    text = decode_failure(answer)
    assert status != 200 or "abort" in text.lower(), text
    assert "prefill" in text.lower(), text
    assert cluster.decode.alive()
    # decode holds a failed request's pages until prefill says no push can still land there,
    # or SGLang's deferred-release timeout (30 s) when prefill is gone
    deadline = time.monotonic() + 60
    while used_tokens(cluster.decode) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert used_tokens(cluster.decode) == 0


def test_prefill_with_another_secret_fails_saying_so(cluster: Cluster) -> None:
    wrong = cluster.prefill("prefill-wrong-secret", "0" * 32)
    harness.start_all([wrong])
    try:
        r = harness.pd_generate(wrong, cluster.decode, PROMPT, timeout_s=120)
        text = decode_failure(r["decode"])
        assert r["decode_status"] != 200 or "abort" in text.lower(), text
        assert "secret" in text, text
    finally:
        wrong.close()


def test_a_restarted_prefill_serves_again(cluster: Cluster, expected_ids: list[int]) -> None:
    again = cluster.prefill("prefill-2", cluster.secret)
    harness.start_all([again])
    deadline = time.monotonic() + 60
    while True:   # decode forgets the dead prefill's bootstrap entry on its next heartbeat
        r = harness.pd_generate(again, cluster.decode, PROMPT)
        if r["decode_status"] == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert r["decode_status"] == 200, r
    assert harness.output_ids(r["decode"]) == expected_ids
    # the answer comes before decode's scheduler frees the request's pages (its next step)
    deadline = time.monotonic() + 30
    while used_tokens(cluster.decode) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert used_tokens(cluster.decode) == 0
