"""The JSON-lines protocol between a benchmark driver and a worker.

One request per line, ``{"cmd": NAME, ...arguments}``; one answer per line, ``{"ok": true, ...}``
or ``{"ok": false, "error": "<ExceptionClass>", "message": "..."}``. The same protocol runs over
a child's stdin/stdout (:class:`ChildProcess`) and over a TCP connection (``kvlink-bench serve``
and ``run``, :class:`Connection`). Every wait for an answer has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import time
import traceback
from typing import IO, Any

# How long an answer may take unless the caller says otherwise: long enough to fill or check
# a few GiB on a slow machine, short enough that a hung child is reported within minutes.
ANSWER_S = 120.0


class BenchError(RuntimeError):
    """A benchmark could not measure what it set out to (the message says what and why)."""


class WorkerError(BenchError):
    """A worker answered with an error, exited, or did not answer in time.

    ``error`` is the worker-side exception's class name ("" when the worker itself failed),
    ``message`` its text.
    """

    def __init__(self, text: str, error: str = "", message: str = "") -> None:
        super().__init__(text)
        self.error = error
        self.message = message or text


class WorkerTimeout(WorkerError, TimeoutError):
    """No answer came within the deadline."""


class Channel:
    """The driver side: requests out, answers in, over a readable fd and a writable file.

    Subclasses say how the other end is reached and add context to errors (:meth:`context`).
    """

    error: type[WorkerError] = WorkerError

    def __init__(self, tag: str, rfd: int, wfile: IO[bytes]) -> None:
        self.tag = tag
        self._rfd = rfd
        self._wfile = wfile
        self._buf = b""

    def context(self) -> str:
        """Text appended to every error (a child's stderr tail)."""
        return ""

    def error_text(self, answer: dict[str, Any]) -> str:
        """The reason a failed answer gives."""
        return f"{answer.get('error', 'error')}: {answer.get('message', answer)}"

    def send(self, cmd: str, **args: Any) -> None:
        """Sends one request without waiting for its answer (see :meth:`recv`).

        Raises:
            WorkerError: the other end is gone.
        """
        try:
            self._wfile.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
            self._wfile.flush()
        except (BrokenPipeError, ConnectionError, OSError, ValueError):
            raise self.error(f"{self.tag}: worker is gone{self.context()}") from None

    def _gone(self) -> str:
        return f"{self.tag}: worker closed the connection"

    def recv(self, answer_s: float = ANSWER_S) -> dict[str, Any]:
        """The next answer.

        Raises:
            WorkerTimeout: none came in ``answer_s`` seconds.
            WorkerError: the answer is an error, or the other end went away.
        """
        deadline = time.monotonic() + answer_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeout(f"{self.tag}: no answer in {answer_s:.0f} s{self.context()}")
            r, _, _ = select.select([self._rfd], [], [], left)
            if r:
                try:
                    data = os.read(self._rfd, 1 << 20)
                except ConnectionError:
                    data = b""
                if not data:
                    raise self.error(f"{self._gone()}{self.context()}")
                self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        if not answer.pop("ok"):
            raise self.error(
                f"{self.tag}: {self.error_text(answer)}{self.context()}",
                str(answer.get("error", "")),
                str(answer.get("message", "")),
            )
        return answer

    def call(self, cmd: str, answer_s: float = ANSWER_S, **args: Any) -> dict[str, Any]:
        """:meth:`send` then :meth:`recv`."""
        self.send(cmd, **args)
        return self.recv(answer_s)


class ChildProcess(Channel):
    """A started child (``p``, with ``stdin``/``stdout`` pipes) and its stderr file ``err``.

    The tail of the child's stderr is quoted in every error.
    """

    def __init__(self, tag: str, p: subprocess.Popen[bytes], err: IO[bytes]) -> None:
        assert p.stdin is not None and p.stdout is not None
        super().__init__(tag, p.stdout.fileno(), p.stdin)
        self.p = p
        self.pid = p.pid
        self.err = err

    def _gone(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(5)
        return f"{self.tag}: worker exited (rc={self.p.returncode})"

    def context(self) -> str:
        return self.stderr_tail()

    def stderr_tail(self, n: int = 1500) -> str:
        with contextlib.suppress(ValueError, OSError):
            self.err.seek(0)
            text = self.err.read().decode(errors="replace")
            lines = [ln for ln in text.splitlines() if ln.strip()]
            tail = "\n".join(lines[-12:])[-n:]
            return f"\n--- {self.tag} stderr (tail) ---\n{tail}" if tail else ""
        return ""

    def kill(self) -> None:
        """SIGKILL: the child vanishes without closing anything."""
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)

    def close(self) -> None:
        """Asks the child to exit, kills it after 10 s, and closes the pipes and the file."""
        if self.p.poll() is None:
            with contextlib.suppress(Exception):
                self.call("exit", answer_s=10)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        for f in (self.p.stdin, self.p.stdout):
            if f:
                with contextlib.suppress(OSError):
                    f.close()
        self.err.close()


class Connection(Channel):
    """A worker served on a TCP port (``kvlink-bench serve``).

    Raises:
        WorkerError: nothing accepted the connection within ``connect_s`` (the message names
            the address and what to do).
    """

    def __init__(self, endpoint: str, connect_s: float = 3.0) -> None:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise WorkerError(f"--connect: expected HOST:PORT, got {endpoint!r}")
        deadline = time.monotonic() + connect_s
        while True:
            try:
                self.sock = socket.create_connection((host, int(port)), timeout=connect_s)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise WorkerError(
                        f"cannot reach kvlink-bench serve at {host}:{port}: {exc.strerror or exc}"
                        f" (tried for {connect_s:.0f} s); start `kvlink-bench serve` on that "
                        "host first, and pass the address it prints as `endpoint`"
                    ) from exc
                time.sleep(0.1)
        self.sock.settimeout(None)
        super().__init__(f"serve {endpoint}", self.sock.fileno(), self.sock.makefile("wb"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._wfile.close()
        self.sock.close()


# ---- the worker side ---------------------------------------------------------------------


def answer(worker: Any, req: dict[str, Any]) -> dict[str, Any]:
    """Runs one request against ``worker`` (a public method per command) and words the answer."""
    cmd = str(req.pop("cmd", ""))
    try:
        if cmd.startswith("_") or not callable(getattr(worker, cmd, None)):
            raise ValueError(f"unknown command {cmd!r}")
        return {"ok": True, **getattr(worker, cmd)(**req)}
    except Exception as exc:  # reported to the driver, which decides
        return {
            "ok": False,
            "error": type(exc).__name__,
            "message": str(exc),
            "trace": traceback.format_exc(),
        }


def serve_lines(worker: Any, rfile: IO[str], wfile: IO[str]) -> bool:
    """Answers requests from ``rfile`` until "exit" (returns True) or end of input (False)."""
    for line in rfile:
        if not line.strip():
            continue
        req = json.loads(line)
        cmd = req.get("cmd")
        wfile.write(json.dumps(answer(worker, req)) + "\n")
        wfile.flush()
        if cmd == "exit":
            return True
    return False
