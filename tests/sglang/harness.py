"""Drives real SGLang servers (sglang 0.5.23 on CPU, in .venv-sglang) for the tests and
bench/sglang_ttft.py. Standard library and kvlink.bench.ports only: the caller runs in kvlink's
own venv. Every wait has a timeout; close() ends the server's whole process group for sure."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from kvlink.bench.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-sglang"
PYTHON = VENV / "bin" / "python"
MAKE_MODEL = ROOT / "examples" / "vllm_disagg" / "make_model.py"

# What SGLang needs to serve on these CPU-only machines (tests/sglang/README facts): its CPU
# engine (the sgl_kernel helper ops come from tests/sglang/shim), one thread per server, no hub.
BASE_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    # no cwd or script folder on sys.path (and the servers start outside the checkout): kvlink is
    # the wheel installed in the venv, as for a user
    "PYTHONSAFEPATH": "1",
}
BASE_ARGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
    "--host", "127.0.0.1", "--max-total-tokens", "4096", "--context-length", "2048",
    "--max-running-requests", "4", "--grammar-backend", "none", "--dtype", "float32",
    "--random-seed", "0", "--skip-server-warmup",
    # an idle scheduler waits on its sockets instead of keeping its core busy (0.70 of one here),
    # so that servers waiting for the next test leave the cores to the ones working
    "--sleep-on-idle",
]


def venv_problem() -> str | None:
    """Why the SGLang venv cannot be used, or None when it can."""
    why = VENV / ".unavailable"
    if why.exists():
        return "the SGLang virtualenv could not be built: " + why.read_text().strip()
    why = VENV / ".wheel-unavailable"
    if why.exists():
        return "kvlink's wheel could not be installed into it: " + why.read_text().strip()
    if not (VENV / ".kvlink-sglang").exists() or not PYTHON.exists():
        return f"{VENV} is missing: run `make sglang-venv` (make test does)"
    if not (VENV / ".kvlink-wheel").exists():
        return f"kvlink's wheel is not installed in {VENV}: run `make sglang-venv` (make test does)"
    return None


def make_model(path: Path, *args: str, timeout_s: float = 300) -> Path:
    subprocess.run([str(PYTHON), str(MAKE_MODEL), str(path), *args], check=True,
                   timeout=timeout_s, stdout=subprocess.DEVNULL)
    return path


class ServerError(RuntimeError):
    pass


def pin_session(sid: int, cpu: int) -> None:
    """Pins every thread of every process of session ``sid`` (a server and the scheduler and
    detokenizer it spawned) to core ``cpu``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):  # a process that just ended
            if os.getsid(int(entry)) != sid:
                continue
            for tid in os.listdir(f"/proc/{entry}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), {cpu})


class Server:
    """One ``python -m sglang.launch_server`` in its own session (process group)."""

    def __init__(
        self,
        name: str,
        model: Path,
        *,
        log_dir: Path,
        mode: str | None = None,          # "prefill", "decode" or None (monolithic)
        backend: str = "kvlink",
        bootstrap_port: int | None = None,
        cpu: int | None = None,           # the core it serves on (it starts on all of them)
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        prefix: list[str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        """``prefix`` runs the server under another command (``ip netns exec NS``); it must exec
        the server so that the pid is the server's."""
        self.name = name
        self.port = free_port()
        self.host = host
        self.mode = mode
        self.bootstrap_port = bootstrap_port
        self.log_path = log_dir / f"{name}.log"
        cmd = [str(PYTHON), "-m", "sglang.launch_server", "--model-path", str(model),
               *BASE_ARGS, "--port", str(self.port), "--nccl-port", str(free_port())]
        cmd[cmd.index("--host") + 1] = host
        if mode is not None:
            cmd += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend,
                    "--disaggregation-bootstrap-port", str(bootstrap_port)]
            if mode == "decode":
                cmd += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        cmd += args or []
        self.cpu = cpu
        if prefix:
            cmd = [*prefix, *cmd]
        self._log: IO[str] = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **BASE_ENV, **(env or {})}, start_new_session=True,
            cwd=log_dir,
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 300) -> Server:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited with {self.proc.returncode}:\n"
                                  f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        if self.cpu is not None:
                            pin_session(self.proc.pid, self.cpu)
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise ServerError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to the whole group: the server and its scheduler/detokenizer children."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def close(self) -> None:
        close_all([self])

    def _terminate(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def _end(self, deadline: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        # SGLang's children may outlive the launcher: end the group whatever happened.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log.close()


def close_all(servers: list[Server], grace_s: float = 20) -> None:
    """Ends every server: SIGTERM to all at once (each takes ~5 s to shut down), up to
    ``grace_s`` for them to exit, then SIGKILL to every group."""
    for s in servers:
        s._terminate()
    deadline = time.monotonic() + grace_s
    for s in servers:
        s._end(deadline)


def start_all(servers: list[Server], timeout_s: float = 400) -> list[Server]:
    """Waits for every server (they start in parallel); closes them all if one fails."""
    try:
        deadline = time.monotonic() + timeout_s
        for s in servers:
            s.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        close_all(servers)
        raise
    return servers


def generate(url: str, body: dict[str, Any], timeout_s: float = 120) -> tuple[int, Any, float]:
    """POST /generate: (HTTP status, parsed JSON or text, seconds)."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    dt = time.perf_counter() - t0
    try:
        return status, json.loads(raw), dt
    except ValueError:
        return status, raw.decode(errors="replace"), dt


def request_body(prompt: str, max_new_tokens: int = 8) -> dict[str, Any]:
    return {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                "ignore_eos": True}}


def pd_generate(prefill: Server, decode: Server, prompt: str, *, max_new_tokens: int = 8,
                timeout_s: float = 120, bootstrap_host: str | None = None
                ) -> dict[str, Any]:
    """What SGLang's router does for a P/D pair: the same request, tagged with a bootstrap room,
    to prefill and decode at once; decode's answer carries the text. Returns both answers."""
    body = request_body(prompt, max_new_tokens)
    body.update(bootstrap_host=bootstrap_host or prefill.host,
                bootstrap_port=prefill.bootstrap_port,
                bootstrap_room=random.randint(0, 2**63 - 1))
    with cf.ThreadPoolExecutor(2) as ex:
        fp = ex.submit(generate, prefill.url, body, timeout_s)
        fd = ex.submit(generate, decode.url, body, timeout_s)
        (sp, jp, tp), (sd, jd, td) = fp.result(), fd.result()
    return {"prefill_status": sp, "prefill": jp, "prefill_s": tp,
            "decode_status": sd, "decode": jd, "decode_s": td}


def output_ids(answer: Any) -> list[int] | None:
    return answer.get("output_ids") if isinstance(answer, dict) else None


def prompt_of(n_words: int, seed: int) -> str:
    """A prompt of ``n_words`` tokens of the tiny model's word-level vocabulary."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(1000)}" for _ in range(n_words))
