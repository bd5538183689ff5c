"""Mooncake Transfer Engine worker: a host-memory WRITE over its TCP transport.

    .venvs/mooncake/bin/python mooncake_worker.py --role target|initiator --size N --host IP

Protocol: see _common.py. Public API only (mooncake.engine.TransferEngine, as in Mooncake's
doc/en/transfer-engine-python.md): ``initialize(host, "P2PHANDSHAKE", "tcp", "")`` (no metadata
server: peers are named "host:rpc_port"), ``register_memory(ptr, n)``,
``transfer_sync_write(target, src_ptr, remote_ptr, n)``.

Links: Mooncake's documented multi-NIC features (NIC pooling, the priority matrix, topology
auto-discovery, ``device_name``) apply to its RDMA transport; for TCP its docs say no device
needs naming. Its TCP transport connects to the one address the target registered
(``--host``), so on the testbed it moves data over one link whatever else is configured;
compare.py records per-link byte counters to show which links each tool used.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _common as c
import numpy as np
from mooncake.engine import TransferEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("target", "initiator"), required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--host", required=True, help="this side's address (the target's is dialed)")
    args = ap.parse_args()
    c.quiet_stdout()

    engine = TransferEngine()
    rc = engine.initialize(args.host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"TransferEngine.initialize({args.host!r}, P2PHANDSHAKE, tcp) = {rc}")
    buf = c.touched(args.size)
    ptr = buf.ctypes.data
    rc = engine.register_memory(ptr, args.size)
    if rc != 0:
        raise SystemExit(f"register_memory = {rc}")
    state: dict[str, Any] = {}

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        cmd = req["cmd"]
        if args.role == "target" and cmd == "verify":
            bad = c.first_mismatch(buf, req["seed"])
            return {"verified": bad is None, "bad_at": bad}
        if args.role == "initiator" and cmd == "connect":
            info = req["info"]
            state["target"], state["remote"] = info["session"], int(info["addr"])
            # Untimed: the first write opens the connection and handshakes.
            n = min(int(req["warm_bytes"]), args.size)
            c.fill(buf[:n], 0xFE)
            t0 = time.monotonic()
            rc = engine.transfer_sync_write(state["target"], ptr, state["remote"], n)
            if rc != 0:
                raise RuntimeError(f"warm-up transfer_sync_write = {rc}")
            return {"warm_s": time.monotonic() - t0}
        if args.role == "initiator" and cmd == "fill":  # before "run", outside its clock
            c.fill(buf, req["seed"])
            return {}
        if args.role == "initiator" and cmd == "run":
            cpu0, t0 = c.cpu_s(), c.now_ns()
            rc = engine.transfer_sync_write(state["target"], ptr, state["remote"], args.size)
            t1, cpu1 = c.now_ns(), c.cpu_s()
            if rc != 0:
                raise RuntimeError(f"transfer_sync_write = {rc}")
            return c.timed_result(args.size, t0, t1, cpu0, cpu1)
        raise ValueError(f"{args.role}: unknown command {cmd!r}")

    info: dict[str, Any] = {}
    if args.role == "target":
        info = {"session": f"{args.host}:{engine.get_rpc_port()}", "addr": ptr}
    c.reply({"ok": True, "event": "ready", "info": info, "numpy": np.__version__})
    c.serve(handle)
    engine.unregister_memory(ptr)


if __name__ == "__main__":
    main()
