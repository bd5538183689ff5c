"""Test-side handle of tests/peer_proc.py: a kvlink agent in another process."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class PeerError(Exception):
    """The peer process answered with an exception."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(f"{error}: {message}")
        self.error = error
        self.message = message


class PeerProcess:
    """Spawns the peer, initialises its agent and relays calls with a timeout."""

    def __init__(
        self, name: str, nics: str, config: dict[str, Any], prefix: list[str] | None = None
    ) -> None:
        self.name = name
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "tests.peer_proc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            text=True,
        )
        rep = self.call("init", name=name, nics=nics, config=config, timeout=30)
        self.metadata: bytes = rep["metadata"].encode()
        self.addresses = [tuple(a) for a in rep["addresses"]]

    def call(self, cmd: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"peer {self.name!r}: no answer to {cmd!r} within {timeout} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                break
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer {self.name!r} exited (rc={self.proc.poll()}) during {cmd!r}")
        rep: dict[str, Any] = json.loads(line)
        if not rep["ok"]:
            raise PeerError(rep["error"], rep["message"])
        return rep

    def kill(self) -> None:
        """SIGKILL: the peer vanishes without closing anything."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=10)
                self.proc.wait(10)
            except Exception:
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()
