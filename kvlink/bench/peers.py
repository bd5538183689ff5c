"""Running the peer libraries (Mooncake, NIXL, ucxx) the way kvlink-bench and
bench/peers/compare.py both do: the same 1-process-per-side host-memory write.

Each peer lives in its own virtual environment, made by ``bench/peers/setup.sh`` in a kvlink
checkout, and is driven through ``bench/peers/<peer>_worker.py`` (JSON lines over stdin and
stdout; the protocol is in ``bench/peers/_common.py``).  That directory is the *peers
directory*: found from ``--peers-dir``, else ``$KVLINK_PEERS_DIR``, else ``bench/peers`` of the
checkout this kvlink runs from or of the current directory.

A run (:func:`run_peer`) starts a target and an initiator in fresh processes, makes one
untimed warm-up write of min(size, 256 MiB), waits :data:`QUIET_S`, then times one write from
the initiator's start to the target knowing the data is in its memory (Mooncake's public API
gives the target no such signal: its clock ends when ``transfer_sync_write`` returns), and
checks the target's buffer word by word.

Where the two processes run is a :class:`Where`: loopback, or the two namespaces of a
:class:`kvlink.testbed.Testbed` (:class:`TestbedWhere`), which also says how each peer is
given the links (UCX: every device named and the rail limits raised to the number of links).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .protocol import ChildProcess, WorkerError

MiB = 1 << 20
PEERS = ("mooncake", "nixl", "ucxx")
# Contrast configurations: the same worker and venv as the peer before the "-".
#   nixl-defrails: UCX_NET_DEVICES names the links but UCX's rail limits stay at their
#   defaults (UCX_MAX_RMA_RAILS=1, UCX_MAX_RNDV_RAILS=2, UCX_MAX_EAGER_RAILS=1).
#   nixl-spin: check_xfer_state polled back to back, as NIXL's examples do (the nixl row
#   sleeps 200 us between polls, which is faster on a 2-core machine).
PEER_VARIANTS = ("nixl-defrails", "nixl-spin")
WARM_BYTES = 256 * MiB
QUIET_S = 1.0  # before every timed write: kvlink's NIC monitor counts earlier traffic as load
# A link that carried less than this share of a run's bytes is not counted as used.
LINK_USED_SHARE = 0.05
# Slowest rate any tool is expected to reach (one 2gbit link, with margin), for timeouts.
SLOWEST_BPS = 0.1e9


class PeerError(WorkerError):
    """A peer run failed; the message says which peer, which side and why."""


class PeerUnavailable(PeerError):
    """The peer cannot run here at all (not installed, does not import)."""


def transfer_timeout_s(size: int) -> float:
    return size / SLOWEST_BPS + 60


def find_peers_dir(explicit: str | None = None) -> Path | None:
    """The bench/peers directory holding the workers and setup.sh's ``.venvs``, or None."""
    if explicit:
        return Path(explicit)
    if env := os.environ.get("KVLINK_PEERS_DIR"):
        return Path(env)
    here = Path(__file__).resolve()
    for root in (here.parents[2], Path.cwd()):  # the checkout kvlink runs from; the cwd
        cand = root / "bench" / "peers"
        if (cand / "setup.sh").exists():
            return cand
    return None


def base_peer(tool: str) -> str:
    """The venv and worker a tool runs with: "nixl" for "nixl-defrails"."""
    return tool.split("-", 1)[0]


def unavailable_reason(peers_dir: Path | None, peer: str) -> str | None:
    """Why ``peer`` cannot run from ``peers_dir``, or None when it is installed."""
    if peers_dir is None:
        return (
            "no peers directory: run from a kvlink checkout, or pass --peers-dir "
            "(or set KVLINK_PEERS_DIR) to its bench/peers"
        )
    peer = base_peer(peer)
    if not (peers_dir / f"{peer}_worker.py").exists():
        return f"{peers_dir} has no {peer}_worker.py: pass the bench/peers of a kvlink checkout"
    status = peers_dir / ".venvs" / f"{peer}.status"
    if status.exists() and (text := status.read_text().strip()) != "ok":
        return f"setup.sh: {text}"
    if not (peers_dir / ".venvs" / peer / "bin" / "python").exists():
        return f"not installed: run `bash {peers_dir}/setup.sh {peer}`"
    return None


# ---- where the two processes run -------------------------------------------------------


class Where:
    """Loopback, or the two sides of a testbed: addresses, exec prefixes and link counters."""

    name = "loopback"
    links = 1

    def prefix(self, side: str) -> list[str]:
        return []

    def host(self, side: str) -> str:
        return "127.0.0.1"

    def kvlink_nics(self, side: str, one_path: bool = False) -> str:
        return "loopback:1" if one_path else "loopback:4"

    def ucx_env(self, side: str) -> dict[str, str]:
        return {"UCX_NET_DEVICES": "lo"}

    def link_tx_bytes(self) -> list[int]:
        # All of the host's loopback traffic, so other work adds to it: a sanity check that
        # a tool really went through TCP (UCX would use shared memory if allowed), no more.
        with open("/sys/class/net/lo/statistics/tx_bytes") as f:
            return [int(f.read())]


class TestbedWhere(Where):
    name = "testbed"

    def __init__(self, tb: Any) -> None:
        self.tb = tb
        self.links = int(tb.links)

    def prefix(self, side: str) -> list[str]:
        return list(self.tb.exec_prefix(side))

    def host(self, side: str) -> str:
        return str(self.tb.address(side, 0))

    def kvlink_nics(self, side: str, one_path: bool = False) -> str:
        return self.tb.address(side, 0) if one_path else ",".join(self.tb.addresses(side))

    def ucx_env(self, side: str) -> dict[str, str]:
        n = str(self.tb.links)
        return {
            # UCX's way to use several NICs: name them all, and raise the per-protocol rail
            # limits (defaults: 1 for RMA and eager, 2 for rendezvous) to the number of links.
            "UCX_NET_DEVICES": ",".join(self.tb.device(side, i) for i in range(self.tb.links)),
            "UCX_MAX_RMA_RAILS": n,
            "UCX_MAX_RNDV_RAILS": n,
            "UCX_MAX_EAGER_RAILS": n,
        }

    def link_tx_bytes(self) -> list[int]:
        out = subprocess.run(
            ["ip", "-n", self.tb.namespace("a"), "-s", "-j", "link", "show"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        by_name = {d["ifname"]: d for d in json.loads(out)}
        return [
            int(by_name[self.tb.device("a", i)]["stats64"]["tx"]["bytes"])
            for i in range(self.tb.links)
        ]


# ---- results ---------------------------------------------------------------------------


@dataclass
class Run:
    """One timed write by one tool."""

    tool: str
    where: str
    iteration: int
    size_bytes: int
    seconds: float
    cpu_s: float
    cpu_tx_s: float
    cpu_rx_s: float
    verified: bool
    warm_s: float | None = None
    link_bytes: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.size_bytes / self.seconds / 1e9

    def wire_ratio(self) -> float | None:
        """Bytes the network devices sent during the run over the payload (>= 1 with TCP)."""
        return None if self.link_bytes is None else sum(self.link_bytes) / self.size_bytes

    def links_used(self) -> int | None:
        if not self.link_bytes or len(self.link_bytes) < 2:
            return None
        total = sum(self.link_bytes)
        return sum(1 for b in self.link_bytes if total and b / total >= LINK_USED_SHARE)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": "run",
            "tool": self.tool,
            "where": self.where,
            "iteration": self.iteration,
            "size_bytes": self.size_bytes,
            "seconds": self.seconds,
            "gbps": self.gbps,
            "cpu_s": self.cpu_s,
            "cpu_tx_s": self.cpu_tx_s,
            "cpu_rx_s": self.cpu_rx_s,
            "verified": self.verified,
            "warm_s": self.warm_s,
            "link_bytes": self.link_bytes,
            "links_used": self.links_used(),
            "wire_ratio": self.wire_ratio(),
            **self.extra,
        }


# ---- peer workers ----------------------------------------------------------------------


class Worker(ChildProcess):
    """One <peer>_worker.py process (protocol: bench/peers/_common.py)."""

    error = PeerError

    def __init__(
        self,
        peers_dir: Path,
        peer: str,
        role: str,
        argv: list[str],
        env: dict[str, str],
        prefix: list[str],
    ) -> None:
        base = base_peer(peer)
        py = peers_dir / ".venvs" / base / "bin" / "python"
        cmd = [*prefix, str(py), str(peers_dir / f"{base}_worker.py"), "--role", role, *argv]
        err = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, **env},
            cwd=peers_dir,
        )
        super().__init__(f"{peer} {role}", p, err)


def peer_env(peer: str, where: Where, side: str) -> dict[str, str]:
    """The environment a peer's worker gets on ``side`` of ``where``."""
    env = {"PYTHONUNBUFFERED": "1"}
    if base_peer(peer) in ("nixl", "ucxx"):
        # TCP only: between two processes on one host UCX would otherwise pick shared memory.
        env.update(UCX_TLS="tcp", **where.ucx_env(side))
    if peer == "nixl-defrails":
        env = {k: v for k, v in env.items() if "_RAILS" not in k}
    if base_peer(peer) == "nixl":
        env["UCX_MODULES"] = "^ib,ib_mlx5,ib_mlx5_ext"  # peers.md: else a segfault at exit
    if peer == "ucxx":
        env["UCX_PROTO_ENABLE"] = "n"  # peers.md: 1.50 GB/s instead of 0.68 over TCP
    return env


def run_peer(peers_dir: Path | None, peer: str, where: Where, size: int, it: int) -> Run:
    """One timed ``size``-byte write by ``peer`` (a name of PEERS or PEER_VARIANTS).

    Raises:
        PeerUnavailable: the peer is not installed under ``peers_dir``.
        PeerError: a worker failed, exited or did not answer in time.
    """
    reason = unavailable_reason(peers_dir, peer)
    if reason:
        raise PeerUnavailable(reason)
    assert peers_dir is not None
    base = base_peer(peer)
    workers: list[Worker] = []
    try:
        argv = ["--size", str(size)]
        if peer == "nixl-spin":
            argv += ["--poll-sleep-us", "0"]
        target = Worker(
            peers_dir, peer, "target", [*argv, "--host", where.host("b")],
            peer_env(peer, where, "b"), where.prefix("b"),
        )  # fmt: skip
        workers.append(target)
        init = Worker(
            peers_dir, peer, "initiator", [*argv, "--host", where.host("a")],
            peer_env(peer, where, "a"), where.prefix("a"),
        )  # fmt: skip
        workers.append(init)
        info = target.recv(120)["info"]
        init_info = init.recv(120)["info"]  # its "ready": buffer allocated and registered
        warm = init.call(
            "connect", answer_s=transfer_timeout_s(WARM_BYTES) + 60, info=info,
            warm_bytes=min(size, WARM_BYTES),
        )  # fmt: skip
        init.call("fill", answer_s=120, seed=it + 1)
        time.sleep(QUIET_S)
        links0 = where.link_tx_bytes()
        rx0 = target.call("cpu")["cpu_s"]
        done_args: dict[str, Any] = {}
        if base == "ucxx":
            done_args = {"messages": 2}  # the warm-up and the timed one
        elif base == "nixl":
            done_args = {"tag": f"run{it + 1}", "peer": init_info["name"]}
        if done_args:
            # The target notes when the data is in its memory: the end of the clock.
            target.send("await_done", **done_args)
        # tag: the notification NIXL's WRITE carries (the other workers ignore it).
        res = init.call("run", answer_s=transfer_timeout_s(size) + 60, tag=f"run{it + 1}")
        if done_args:
            done = target.recv(transfer_timeout_s(size) + 60)
            rx1, t_end = done["cpu_s"], max(int(done["t_ns"]), int(res["t1_ns"]))
        else:
            # Mooncake's public API gives the target no completion signal: the initiator's
            # transfer_sync_write return ends the clock (its last bytes may still be in socket
            # buffers then: a few MB, under 1% of 1 GiB).
            rx1, t_end = target.call("cpu")["cpu_s"], int(res["t1_ns"])
        links1 = where.link_tx_bytes()
        ver = target.call("verify", answer_s=300, seed=it + 1, **done_args)
        seconds = (t_end - int(res["t0_ns"])) / 1e9
        return Run(
            tool=peer,
            where=where.name,
            iteration=it,
            size_bytes=size,
            seconds=seconds,
            cpu_s=float(res["cpu_s"]) + rx1 - rx0,
            cpu_tx_s=float(res["cpu_s"]),
            cpu_rx_s=rx1 - rx0,
            verified=bool(ver["verified"]),
            warm_s=float(warm["warm_s"]),
            link_bytes=[b - a for a, b in zip(links0, links1, strict=True)],
            extra={
                "bad_at": ver.get("bad_at"),
                "seconds_initiator": float(res["seconds"]),
                "end_at": "target" if done_args else "initiator",
                "env_a": peer_env(peer, where, "a"),
            },
        )
    finally:
        for w in reversed(workers):
            w.close()
