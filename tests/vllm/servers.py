"""vLLM OpenAI servers and vllm-router in child processes, for tests/vllm/test_router.py and
bench/vllm_router.py. Standard library and kvlink.bench.ports only (the caller runs in kvlink's
venv, the servers and the router in .venv-vllm). Every wait has a timeout; close() and kill()
end each child's whole process group (a vLLM server is three processes: API server, engine
core, worker)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from kvlink.bench.ports import free_port
from tests.vllm import harness

ROUTER = harness.VENV / "bin" / "vllm-router"
ROUTER_UNAVAILABLE = harness.VENV / "vllm-router.unavailable"

KVLINK = {"kv_connector": "KvlinkConnector", "kv_connector_module_path": "kvlink.integrations.vllm"}


def router_problem() -> str | None:
    """Why vllm-router cannot be run, or None when it can."""
    problem = harness.venv_problem()
    if problem:
        return problem
    if ROUTER_UNAVAILABLE.exists():
        return "vllm-router could not be installed: " + ROUTER_UNAVAILABLE.read_text().strip()
    if not ROUTER.exists():
        return f"{ROUTER} is missing: run `make vllm-venv` (make test does)"
    return None


def get(url: str, timeout_s: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return str(r.read().decode())


def post(url: str, body: dict[str, Any], timeout_s: float = 120) -> tuple[int, dict[str, Any]]:
    """(status, JSON answer) of a POST; an HTTP error's body is returned, not raised."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, {"error": text}


def post_stream(url: str, body: dict[str, Any], timeout_s: float = 120) -> tuple[int, str]:
    """(status, the streamed completion's text) of a POST with ``stream`` set; an HTTP
    error's body is returned as the text."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            text = []
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    text.append(json.loads(line[5:])["choices"][0]["text"])
            return r.status, "".join(text)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metrics(text: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


class Child:
    """A child process in its own session (so that its whole group can be killed)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[str] = open(log_path, "w")  # noqa: SIM115 (closed in close())
        # outside the checkout, no cwd on sys.path: the servers run the venv's installed kvlink
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT,
                                     env={**os.environ, **harness.OUTSIDE_ENV, **env},
                                     start_new_session=True, cwd=log_path.parent)

    def tail(self, n: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to the whole process group (what a crashed host looks like)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def close(self, grace_s: float = 15) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        # also the group's stragglers (vLLM's engine core and worker) when the leader is gone
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        self._log.close()


class Server(Child):
    """``python -m vllm.entrypoints.openai.api_server`` from .venv-vllm.

    ``kv`` is the --kv-transfer-config (None: no connector); ``cpu`` pins the worker's compute
    threads to that core (VLLM_CPU_OMP_THREADS_BIND)."""

    def __init__(self, name: str, model: Path, *, log_dir: Path, kv: dict[str, Any] | None,
                 cpu: int | str = "auto", max_model_len: int = 2048, port: int | None = None,
                 env: dict[str, str] | None = None, args: Iterable[str] = ()) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(harness.PYTHON), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--max-model-len", str(max_model_len), "--block-size", "32",
               "--enforce-eager", "--no-enable-prefix-caching",
               "--max-num-batched-tokens", str(max_model_len), "--seed", "0", *args]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        base = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        super().__init__(name, cmd, {**base, **(env or {})}, log_dir / f"{name}.log")

    def ready(self) -> bool:
        try:
            get(f"{self.url}/v1/models", timeout_s=2)
            return True
        except (OSError, ValueError):
            return False

    def metrics(self) -> str:
        return get(f"{self.url}/metrics", timeout_s=10)


class Router(Child):
    """vllm-router in P/D mode in front of ``prefill`` and ``decode`` servers, or, with
    ``workers``, in its regular mode (each request to one of them, computed there whole).
    ``bootstrap``: each prefill's bootstrap port (the push flow, ``kv_connector="mooncake"``)."""

    def __init__(self, prefill: list[str], decode: list[str], *, log_dir: Path,
                 kv_connector: str = "nixl", policy: str = "round_robin",
                 args: Iterable[str] = (), name: str = "router",
                 workers: list[str] | None = None, bootstrap: list[int] | None = None) -> None:
        self.port, self.prom_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(ROUTER), "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prom_port),
               "--policy", policy, "--worker-startup-check-interval", "1"]
        if workers:
            cmd += ["--worker-urls", *workers]
        else:
            cmd += ["--vllm-pd-disaggregation", "--kv-connector", kv_connector]
        for i, url in enumerate(prefill):
            # "--prefill URL PORT": that prefill's bootstrap server (--kv-connector mooncake)
            cmd += ["--prefill", url, *([str(bootstrap[i])] if bootstrap else [])]
        for url in decode:
            cmd += ["--decode", url]
        super().__init__(name, [*cmd, *args], {}, log_dir / f"{name}.log")

    def ready(self) -> bool:
        try:
            get(f"{self.url}/v1/models", timeout_s=2)
            return True
        except (OSError, ValueError):
            return False

    def metrics(self) -> str:
        return get(f"http://127.0.0.1:{self.prom_port}/metrics", timeout_s=10)


def wait_ready(children: list[Server] | list[Router] | list[Server | Router],
               timeout_s: float) -> None:
    """Waits until every child answers; raises (with its log's tail) when one exits or the
    time is up."""
    end = time.monotonic() + timeout_s
    left = list(children)
    while left:
        for c in list(left):
            if c.ready():
                left.remove(c)
            elif not c.alive():
                raise RuntimeError(f"{c.name} exited ({c.proc.returncode}):\n{c.tail()}")
        if left and time.monotonic() > end:
            raise TimeoutError(f"{', '.join(c.name for c in left)} not up within {timeout_s} s:"
                               f"\n{left[0].tail()}")
        if left:
            time.sleep(1)
