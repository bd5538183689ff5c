"""A real, local etcd server for tests and benchmarks: free ports, its own data folder.

Runs Debian's ``etcd`` (package ``etcd-server``; ``make sysdeps`` installs it) on loopback.
:meth:`EtcdServer.restart` stops and starts it on the same ports, keeping its data (a
plain restart: leases survive) or wiping it (``wipe=True``: every key and lease is lost, as
with a replaced etcd member). Every wait is bounded; :meth:`close` kills the process and
removes the folder.
"""

from __future__ import annotations

import contextlib
import shutil
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from .ports import free_port

START_TIMEOUT_S = 20.0  # etcd starts in ~1 s; a loaded 2-core host can take much longer


class EtcdServer:
    """One etcd member on 127.0.0.1; ``url(prefix)`` is what ``Config(discovery=...)`` takes."""

    def __init__(
        self, binary: str | None = None, tls: tuple[str, str, str] | None = None
    ) -> None:
        """``tls``: (CA file, server certificate file, its key file): clients then speak
        HTTPS (``url()`` gives ``etcds://``) and must trust the CA."""
        self.binary = binary or shutil.which("etcd") or "etcd"
        self.tls = tls
        self.dir = Path(tempfile.mkdtemp(prefix="kvl-etcd-"))
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str = "kvlink") -> str:
        return f"{'etcds' if self.tls else 'etcd'}://{self.endpoint}/{prefix}"

    def start(self) -> None:
        """Starts etcd and waits (bounded) until it answers /health.

        Raises:
            RuntimeError: it did not come up; the message has its log's tail.
        """
        assert self.proc is None
        client = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.starts += 1
        log = (self.dir / f"etcd-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--name",
                "kvl",
                "--data-dir",
                str(self.dir / "data"),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"kvl={peer}",
                "--log-level",
                "warn",
                *(["--cert-file", self.tls[1], "--key-file", self.tls[2]] if self.tls else []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(httpx.HTTPError):
                verify: Any = True
                if self.tls:
                    verify = ssl.create_default_context(cafile=self.tls[0])
                r = httpx.get(f"{client}/health", timeout=1.0, verify=verify)
                if r.status_code == 200 and r.json().get("health") == "true":
                    return
            time.sleep(0.05)
        tail = (self.dir / f"etcd-{self.starts}.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"etcd did not come up on {client} within {START_TIMEOUT_S} s:\n{tail}")

    def stop(self) -> None:
        """Stops etcd (SIGTERM, then SIGKILL after 5 s)."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def restart(self, *, wipe: bool = False, down_s: float = 0.0) -> None:
        """Stops etcd, stays down ``down_s``, starts it again on the same ports;
        ``wipe`` deletes its data first (every key and lease is lost)."""
        self.stop()
        if wipe:
            shutil.rmtree(self.dir / "data", ignore_errors=True)
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
