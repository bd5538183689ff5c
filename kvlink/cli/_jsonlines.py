"""A child process driven over JSON lines, as the benchmark workers are.

One request per line on the child's stdin, one answer per line on its stdout, each a JSON
object with ``"ok"``; the child's stderr goes to a temporary file whose tail is quoted in every
error. Every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import time
from typing import IO, Any


class JsonLinesProcess:
    """A started child (``p``, with ``stdin``/``stdout`` pipes) and its stderr file ``err``.

    Subclasses start the child, pass it here, and may change :attr:`error` (the exception
    raised) and :meth:`error_text` (how the child words a failed answer).
    """

    error: type[Exception] = RuntimeError

    def __init__(self, tag: str, p: subprocess.Popen[bytes], err: IO[bytes]) -> None:
        self.tag = tag
        self.p = p
        self.pid = p.pid
        self.err = err
        self._buf = b""

    def error_text(self, answer: dict[str, Any]) -> str:
        """The reason a failed answer gives; the default reads ``error`` and ``message``."""
        return f"{answer['error']}: {answer['message']}"

    def send(self, cmd: str, **args: Any) -> None:
        assert self.p.stdin is not None
        try:
            self.p.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
            self.p.stdin.flush()
        except BrokenPipeError:
            raise self.error(f"{self.tag}: worker exited{self.stderr_tail()}") from None

    def recv(self, answer_s: float = 120.0) -> dict[str, Any]:
        """The next answer; raises :attr:`error` if it failed, or none came in ``answer_s``."""
        assert self.p.stdout is not None
        fd = self.p.stdout.fileno()
        deadline = time.monotonic() + answer_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.error(f"{self.tag}: no answer in {answer_s:.0f} s{self.stderr_tail()}")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                data = os.read(fd, 1 << 20)
                if not data:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.p.wait(5)
                    raise self.error(
                        f"{self.tag}: worker exited (rc={self.p.returncode}){self.stderr_tail()}"
                    )
                self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        if not answer.pop("ok"):
            raise self.error(f"{self.tag}: {self.error_text(answer)}{self.stderr_tail()}")
        return answer

    def call(self, cmd: str, answer_s: float = 120.0, **args: Any) -> dict[str, Any]:
        self.send(cmd, **args)
        return self.recv(answer_s)

    def stderr_tail(self, n: int = 1500) -> str:
        self.err.seek(0)
        text = self.err.read().decode(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.strip()]
        tail = "\n".join(lines[-12:])[-n:]
        return f"\n--- {self.tag} stderr (tail) ---\n{tail}" if tail else ""

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
