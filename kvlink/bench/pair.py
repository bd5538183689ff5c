"""A sender and a receiver benchmark worker on the two sides of a testbed, with one agent
pair per configuration under test (4 paths, 1 path, round-robin ...) sharing one buffer per
side: the sender's holds the pattern of :func:`kvlink.bench.measure.fill_pattern`, the
receiver's is zeroed before every measured push and checked byte by byte after it.

Used by bench/multinic.py and bench/soak.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .protocol import BenchError
from .worker import Worker

MiB = 1 << 20
WARM_BYTES = 512 * MiB  # one untimed push of min(size, this) before anything is measured
KV_LAYERS, KV_PLANES, KV_BLOCK_BYTES = 32, 2, 32 * 1024  # Llama-3-8B geometry
UP_TIMEOUT_S = 20.0  # a path not back UP this long after its link came back is a failure
# Quiet time before every measured run.  Each agent's NIC monitor counts traffic that is not
# its own (the previous run: another agent, or iperf3) as foreign load and discounts that NIC
# for ~1 s afterwards (EWMA, 0.3 per 100 ms tick); both tools start from quiet links.
QUIET_S = 1.0


@dataclass
class KvRun:
    """One kvlink transfer."""

    config: str
    size_bytes: int
    seconds: float  # engine t_done - t_submit
    retries: int
    chunks: int
    corrupt_bytes: int
    path_bytes: list[int]  # bytes_sent per path over this transfer (hedge copies included)
    path_hedges: list[int]
    path_reconnects: list[int]
    path_est_gbps: list[float]  # after the transfer
    path_states: list[str]
    t_submit_ns: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.size_bytes / self.seconds / 1e9


class Pair:
    """A sender (side a) and receiver (side b) worker with one agent pair per configuration."""

    def __init__(
        self, tb: Any, size: int, wait_s: float, base: dict[str, Any] | None = None
    ) -> None:
        self.tb = tb
        self.base = base or {}
        self.size = size
        self.wait_s = wait_s
        # Workers in the two namespaces; tb.down() stops them if close() is never reached.
        self.tx = Worker("tx", prefix=tb.exec_prefix("a"))
        self.rx = Worker("rx", prefix=tb.exec_prefix("b"))
        self.labels: list[str] = []
        # Both at once: filling and faulting 2 GiB takes seconds.
        self.tx.send("alloc", key="src", nbytes=size, fill="pattern", register=False)
        self.rx.send("alloc", key="dst", nbytes=size, fill="zero", register=False)
        self.tx.recv(300)
        self.rx.recv(300)

    def add(self, label: str, links: list[int], config: dict[str, Any]) -> None:
        cfg = {"transfer_timeout_s": self.wait_s, **self.base, **config}
        b = ",".join(self.tb.address("b", i) for i in links)
        a = ",".join(self.tb.address("a", i) for i in links)
        self.rx.call("agent", name=f"rx-{label}", nics=b, config=cfg)
        md = self.rx.call("register", agent=f"rx-{label}", key="dst", remote_write=True,
                          name="kv")["metadata"]  # fmt: skip
        self.tx.call("agent", name=f"tx-{label}", nics=a, config=cfg)
        self.tx.call("register", agent=f"tx-{label}", key="src")
        self.tx.call("add_peer", agent=f"tx-{label}", metadata=md)
        self.labels.append(label)

    def warm(self, label: str) -> float:
        """One untimed push; returns its seconds."""
        sub = self.tx.call(
            "push", agent=f"tx-{label}", peer=f"rx-{label}", local="src", remote="kv",
            nbytes=min(self.size, WARM_BYTES),
        )  # fmt: skip
        w = self.tx.call("wait", answer_s=self.wait_s + 30, id=sub["id"], wait_s=self.wait_s,
                         capture=True, events=True)  # fmt: skip
        if w["error"]:
            raise BenchError(f"warm-up push of {label} failed: {w['error']}")
        return float(w["t_done_ns"] - w["t_submit_ns"]) / 1e9

    def paths(self, label: str) -> list[dict[str, Any]]:
        paths: list[dict[str, Any]] = self.tx.call("paths", agent=f"tx-{label}")["paths"]
        return paths

    def wait_path_up(self, label: str, index: int) -> tuple[float, dict[str, Any]]:
        """Polls paths() until path ``index`` is UP (or DEGRADED: in service, just slower)."""
        t0 = time.monotonic()
        while True:
            p = self.paths(label)[index]
            if p["state"] in ("UP", "DEGRADED"):
                return time.monotonic() - t0, p
            if time.monotonic() - t0 > UP_TIMEOUT_S:
                raise BenchError(
                    f"{label}: path {index} not UP {UP_TIMEOUT_S:.0f} s after the link came "
                    f"back: {p}"
                )
            time.sleep(0.05)

    def run(
        self,
        label: str,
        *,
        kv_layout: dict[str, Any] | None = None,
        on_submit: Callable[[int], None] | None = None,
    ) -> tuple[KvRun, dict[str, Any]]:
        """One measured push of SIZE (or of the whole KV cache), checked afterwards.

        ``on_submit(t_submit_ns)`` runs as soon as the push is submitted (fault schedules)."""
        self.rx.call("zero", answer_s=120, key="dst")
        time.sleep(QUIET_S)
        if kv_layout is None:
            sub = self.tx.call(
                "push", agent=f"tx-{label}", peer=f"rx-{label}", local="src", remote="kv",
                nbytes=self.size,
            )  # fmt: skip
        else:
            sub = self.tx.call(
                "push_kv", agent=f"tx-{label}", peer=f"rx-{label}", key="src",
                dst_layout=kv_layout, **kv_geometry(self.size),
            )  # fmt: skip
        if on_submit is not None:
            on_submit(sub["t_submit_ns"])
        w = self.tx.call("wait", answer_s=self.wait_s + 30, id=sub["id"], wait_s=self.wait_s,
                         capture=True, events=True)  # fmt: skip
        if w["error"]:
            raise BenchError(f"{label}: transfer failed: {w['error']}; paths {w['paths']}")
        ver = self.rx.call("verify", answer_s=300, key="dst", nbytes=self.size)
        paths = w["paths"]
        run = KvRun(
            config=label,
            size_bytes=w["bytes_total"],
            seconds=(w["t_done_ns"] - w["t_submit_ns"]) / 1e9,
            retries=w["retries"],
            chunks=w["chunks"],
            corrupt_bytes=ver["corrupt_bytes"],
            path_bytes=[d["bytes_sent"] for d in w["path_delta"]],
            path_hedges=[d["hedges"] for d in w["path_delta"]],
            path_reconnects=[d["reconnects"] for d in w["path_delta"]],
            path_est_gbps=[round(p["est_gbps"], 4) for p in paths],
            path_states=[p["state"] for p in paths],
            t_submit_ns=w["t_submit_ns"],
            extra={"segments": sub.get("segments", 1), "first_bad_offset": ver["first_bad_offset"]},
        )
        return run, w

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


def kv_geometry(size: int) -> dict[str, int]:
    """[32 layers][2 planes][num_blocks][32 KiB] covering exactly ``size`` bytes."""
    per_block = KV_LAYERS * KV_PLANES * KV_BLOCK_BYTES
    if size % per_block:
        raise BenchError(
            f"kvlayers: --size {size} is not a multiple of {per_block} "
            f"({KV_LAYERS} layers x {KV_PLANES} planes x {KV_BLOCK_BYTES // 1024} KiB blocks)"
        )
    return {"layers": KV_LAYERS, "planes": KV_PLANES, "num_blocks": size // per_block}
