"""The one iperf3 runner: the limit every kvlink figure is compared with.

:func:`run` starts one ``iperf3 -s -1`` per stream, waits until each listens, starts every
client at once and reaps them all, with a deadline; each side may run under a prefix (a testbed
namespace's ``ip netns exec``, ``perf record ... --``). A result keeps iperf3's JSON report,
each side's CPU time (``wait4``: every thread, the kernel's precise resolution) and peak RSS.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from . import measure
from .ports import free_ports
from .protocol import BenchError

INSTALL_HINT = "apt-get install iperf3"
LISTEN_S = 10.0  # an iperf3 server that does not listen by then has failed to start


class Iperf3Error(BenchError):
    """iperf3 failed, printed no report, or did not finish in time (the message says which)."""


def available() -> bool:
    return shutil.which("iperf3") is not None


@dataclass
class Stream:
    """One client/server pair: ``nbytes`` (``-n``) or ``seconds`` (``-t``) over ``server``."""

    server: str
    bind: str | None = None  # the client's source address (-B)
    nbytes: int | None = None
    seconds: float | None = None
    parallel: int = 1  # -P
    server_prefix: Sequence[str] = ()
    client_prefix: Sequence[str] = ()


@dataclass
class Result:
    """One stream's report and what its two processes cost."""

    report: dict[str, Any]
    cpu_client_s: float
    cpu_server_s: float  # after it started listening
    sys_s: float  # of the two, the kernel's share
    hwm_client_kib: int
    hwm_server_kib: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sent_bytes(self) -> int:
        return int(self.report["end"]["sum_sent"]["bytes"])

    @property
    def received_bps(self) -> float:
        """The receiver's rate in bit/s (iperf3's yardstick)."""
        return float(self.report["end"]["sum_received"]["bits_per_second"])

    @property
    def seconds(self) -> float:
        """Bytes sent over the receiver's rate. sum_received stops short of -n by what is still
        in socket buffers when the sender ends, so its own byte count is not used. A transfer
        too short for the receiver to report a rate falls back to the sender's seconds."""
        if self.received_bps > 0:
            return self.sent_bytes * 8 / self.received_bps
        return max(float(self.report["end"]["sum_sent"]["seconds"]), 1e-9)

    @property
    def retransmits(self) -> int:
        return int(self.report["end"]["sum_sent"].get("retransmits", 0) or 0)


def aggregate_gbps(results: Sequence[Result]) -> float:
    """GB/s (1e9 bytes/s) of streams run at once: all bytes over the longest stream's time."""
    return sum(r.sent_bytes for r in results) / max(r.seconds for r in results) / 1e9


def listening(pid: int, port: int) -> bool:
    """Whether something in ``pid``'s network namespace listens on TCP ``port``."""
    for table in ("tcp6", "tcp"):  # /proc/PID/net/*: the table of PID's namespace
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def _tail(err: IO[bytes]) -> str:
    err.seek(0)
    return err.read().decode(errors="replace")[-600:]


def _wait4(
    p: subprocess.Popen[bytes], deadline: float, watch: Sequence[int]
) -> tuple[Any, list[int]]:
    """Reaps ``p``; its rusage and the last VmHWM seen of each pid in ``watch``."""
    hwm = [-1] * len(watch)
    while True:
        hwm = [max(h, measure.status_kib("VmHWM", w)) for h, w in zip(hwm, watch, strict=True)]
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            return ru, hwm
        if time.monotonic() > deadline:
            raise Iperf3Error(f"iperf3 (pid {p.pid}) did not finish in time")
        time.sleep(0.005)


def parse_report(text: str, what: str) -> dict[str, Any]:
    """An iperf3 --json report.

    Raises:
        Iperf3Error: it printed no JSON, or the JSON reports an error.
    """
    try:
        res: dict[str, Any] = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Iperf3Error(f"{what} printed no JSON: {text[:300]!r}") from exc
    if "error" in res:
        raise Iperf3Error(f"{what}: {res['error']}")
    return res


def run(streams: Sequence[Stream], timeout_s: float = 300.0) -> list[Result]:
    """Every stream at once; one :class:`Result` each, in order.

    Raises:
        Iperf3Error: iperf3 is missing, a server did not listen, a client failed or a stream
            did not finish within ``timeout_s``.
    """
    if not available():
        raise Iperf3Error(f"iperf3 is not installed ({INSTALL_HINT})")
    ports = free_ports(len(streams), "::")
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(tempfile.TemporaryFile()) for _ in streams]
        err = stack.enter_context(tempfile.TemporaryFile())

        @stack.callback
        def reap() -> None:  # runs first: no iperf3 outlives this call
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

        servers = []
        for s, port in zip(streams, ports, strict=True):
            argv = [*s.server_prefix, "iperf3", "-s", "-1", "-B", s.server, "-p", str(port)]
            servers.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err))
            procs.append(servers[-1])
        deadline = time.monotonic() + LISTEN_S
        for srv, port in zip(servers, ports, strict=True):
            while not listening(srv.pid, port):
                if srv.poll() is not None or time.monotonic() > deadline:
                    raise Iperf3Error(f"iperf3 -s did not listen on {port}: {_tail(err)!r}")
                time.sleep(0.01)
        base = []
        for srv in servers:
            try:
                base.append(measure.proc_cpu_s(srv.pid))
            except OSError:
                base.append(0.0)
        clients = []
        for s, port, out in zip(streams, ports, outs, strict=True):
            argv = [*s.client_prefix, "iperf3", "-c", s.server, "-p", str(port), "--json"]
            if s.bind:
                argv += ["-B", s.bind]
            if s.nbytes is not None:
                argv += ["-n", str(s.nbytes)]
            if s.seconds is not None:
                argv += ["-t", f"{s.seconds:g}"]
            if s.parallel > 1:
                argv += ["-P", str(s.parallel)]
            clients.append(subprocess.Popen(argv, stdout=out, stderr=err))
            procs.append(clients[-1])
        deadline = time.monotonic() + timeout_s
        results = []
        for i, (c, srv) in enumerate(zip(clients, servers, strict=True)):
            try:
                ru_c, (hwm_c, hwm_s) = _wait4(c, deadline, [c.pid, srv.pid])
                ru_s, _ = _wait4(srv, time.monotonic() + 30, [])
            except Iperf3Error:
                raise Iperf3Error(
                    f"iperf3 stream {i} did not finish in {timeout_s:.0f} s: {_tail(err)!r}"
                ) from None
            outs[i].seek(0)
            report = parse_report(outs[i].read().decode(), f"iperf3 -c (stream {i})")
            results.append(
                Result(
                    report=report,
                    cpu_client_s=ru_c.ru_utime + ru_c.ru_stime,
                    cpu_server_s=ru_s.ru_utime + ru_s.ru_stime - base[i],
                    sys_s=ru_c.ru_stime + ru_s.ru_stime,
                    hwm_client_kib=hwm_c,
                    hwm_server_kib=hwm_s,
                )
            )
        return results


def version() -> str | None:
    """iperf3's version line, None without iperf3 (for a run's meta record)."""
    if not available():
        return None
    out = subprocess.run(["iperf3", "--version"], capture_output=True, text=True, check=False)
    lines = out.stdout.splitlines()
    return lines[0] if lines else None
