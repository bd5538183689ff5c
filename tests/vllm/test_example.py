"""examples/vllm_disagg's client and proxy as a new user runs them, against stand-in OpenAI
servers (stdlib HTTP on loopback, in this process; the client and the proxy run in .venv-vllm,
which has aiohttp): the decode-alone comparison sends the very prompts that went through the
proxy and says when a text differs; the client says what to do when /v1/models is not there;
the push proxy started before its servers waits for them instead of dying, and answers
/v1/models.
run.sh with real servers is what `examples/vllm_disagg/run.sh pull|push` does (slow)."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvlink.bench.ports import free_port
from tests.conftest import unavailable
from tests.vllm import harness

EXAMPLE = harness.ROOT / "examples" / "vllm_disagg"


@pytest.fixture(autouse=True)
def _venv() -> None:
    problem = harness.venv_problem()
    if problem:
        unavailable(problem)


class FakeServer:
    """A vLLM OpenAI server stand-in: /v1/models, and /v1/completions whose text is a function
    of the prompt (``salt`` changes it), streamed or not; prompts it saw are kept."""

    def __init__(self, models: bool = True, salt: str = "",
                 sock: socket.socket | None = None) -> None:
        self.prompts: list[str] = []
        self.salt = salt
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/v1/models" and models:
                    self._send(200, json.dumps({"data": [{"id": "m"}]}).encode(),
                               "application/json")
                else:
                    self._send(404, b'{"detail":"Not Found"}', "application/json")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.prompts.append(body["prompt"])
                text = f" t{abs(hash(fake.salt + body['prompt'])) % 10**6}"
                params = {"kvlink": {"card": {"agent": "fake", "at": fake.url}}}
                if not body.get("stream"):
                    self._send(200, json.dumps({"choices": [{"text": text}],
                                                "kv_transfer_params": params}).encode(),
                               "application/json")
                    return
                chunks = [f"data: {json.dumps({'choices': [{'text': w}]})}\n\n"
                          for w in text.split(" ") if w] + ["data: [DONE]\n\n"]
                self._send(200, "".join(chunks).encode(), "text/event-stream")

            def log_message(self, *args: object) -> None:
                pass

        if sock is None:
            self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        else:  # a port bound (and connected to) before the server answered, as vLLM's is
            self.srv = http.server.ThreadingHTTPServer(sock.getsockname(), Handler,
                                                       bind_and_activate=False)
            self.srv.socket.close()
            self.srv.socket = sock
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()
        self.thread.join(5)


@pytest.fixture
def servers() -> Iterator[list[FakeServer]]:
    made: list[FakeServer] = []
    yield made
    for s in made:
        s.close()


def client(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(harness.PYTHON), str(EXAMPLE / "client.py"), *args],
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def rows(out: str) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def test_decode_alone_gets_the_same_prompts_and_says_so(servers: list[FakeServer],
                                                         tmp_path: Path) -> None:
    proxy, decode = FakeServer(), FakeServer()
    servers += [proxy, decode]
    saved = tmp_path / "through-proxy.jsonl"
    common = ["--lengths", "8,32,64", "--repeat", "2", "--max-tokens", "4"]
    first = client("--url", proxy.url, "--save", str(saved), *common)
    assert first.returncode == 0, first.stderr
    assert [r["prompt"] for r in rows(first.stdout)] == [
        "8#0", "8#1", "32#0", "32#1", "64#0", "64#1"]
    second = client("--url", decode.url, "--against", str(saved), *common)
    assert second.returncode == 0, second.stdout + second.stderr
    assert decode.prompts == proxy.prompts  # every prompt, not only the first
    assert all(r["same_text"] for r in rows(second.stdout))
    assert "all 6 prompts: the same text" in second.stdout
    # a server whose texts differ (KV that was not the prompt's) is caught and named
    wrong = FakeServer(salt="other")
    servers.append(wrong)
    third = client("--url", wrong.url, "--against", str(saved), *common)
    assert third.returncode == 1
    assert "texts differ" in third.stdout and "64#1" in third.stdout


def test_client_without_models_endpoint_says_what_to_give(servers: list[FakeServer]) -> None:
    bare = FakeServer(models=False)  # a proxy that serves /v1/completions only
    servers.append(bare)
    out = client("--url", bare.url, "--lengths", "8")
    assert out.returncode != 0
    assert "/v1/models answered 404" in out.stderr and "--models-url" in out.stderr, out.stderr
    dec = FakeServer()
    servers.append(dec)
    out = client("--url", bare.url, "--models-url", dec.url, "--lengths", "8")
    assert out.returncode == 0, out.stderr


def listening() -> socket.socket:
    """A bound, listening socket that accepts nothing yet: a vLLM server while it starts (it
    binds its port first, then loads the model for minutes)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_push_proxy_started_before_its_servers_waits_for_them(servers: list[FakeServer],
                                                               tmp_path: Path) -> None:
    p_sock, d_sock = listening(), listening()
    port = free_port()
    log_path = tmp_path / "proxy.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed below)
    proxy = subprocess.Popen(
        [str(harness.PYTHON), str(EXAMPLE / "proxy.py"), "--mode", "push", "--port", str(port),
         "--prefill", f"http://127.0.0.1:{p_sock.getsockname()[1]}",
         "--decode", f"http://127.0.0.1:{d_sock.getsockname()[1]}"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while "waiting for" not in log_path.read_text() and time.monotonic() < end:
            assert proxy.poll() is None, log_path.read_text()
            time.sleep(0.5)
        assert "waiting for" in log_path.read_text()
        # a request meanwhile is told what is missing, not left hanging
        status, text = post(f"{url}/v1/completions", {"model": "m", "prompt": "w1 w2 w3"})
        assert status == 503 and "are both servers up?" in text, (status, text)
        servers += [FakeServer(sock=p_sock), FakeServer(sock=d_sock)]
        while "every instance's card fetched" not in log_path.read_text():
            assert time.monotonic() < end + 30, log_path.read_text()
            time.sleep(0.5)
        out = client("--url", url, "--lengths", "8,16")  # the model name from the proxy too
        assert out.returncode == 0, out.stderr + log_path.read_text()
        assert len(rows(out.stdout)) == 2
        assert proxy.poll() is None and "Traceback" not in log_path.read_text()
    finally:
        proxy.terminate()
        proxy.wait(30)
        log.close()
