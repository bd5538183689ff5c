"""ucxx worker: 1 GiB from the initiator's host memory into the target's, over UCX tag messages.

    .venvs/ucxx/bin/python ucxx_worker.py --role target|initiator --size N [--host IP]

Protocol: see _common.py. ucxx's public Python API (``ucxx.create_listener``,
``ucxx.create_endpoint``, ``Endpoint.send`` / ``Endpoint.recv``) has no one-sided put, so the
"write" here is two-sided: the target posts a receive into its pre-faulted buffer and the
initiator sends its buffer; for a message this size UCX uses its rendezvous protocol, which
moves the data zero-copy into the posted buffer. The clock starts at the initiator's
``send()`` of the data (an 8-byte size header goes first, outside the clock) and the driver
stops it when the target's receive completes ("await_done").

UCX is configured only through its environment, which kvlink/bench/peers.py sets (for
compare.py and kvlink-bench): ``UCX_TLS=tcp`` (no shared memory between the two processes),
``UCX_NET_DEVICES``, ``UCX_PROTO_ENABLE=n`` (peers.md: 1.50 GB/s instead of 0.68 on loopback)
and, on the testbed, UCX_MAX_RNDV_RAILS / UCX_MAX_EAGER_RAILS raised to the number of links.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import _common as c
import numpy as np
import ucxx


async def amain(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    buf = c.touched(args.size)
    state: dict[str, Any] = {"received": 0}
    recv_cond = asyncio.Condition()
    ep_ready = asyncio.Event()

    async def on_connect(ep: Any) -> None:
        # Target: one connection; each message is an 8-byte size, then that many bytes.
        state["ep"] = ep
        ep_ready.set()
        header = np.empty(1, dtype=np.uint64)
        try:
            while True:
                await ep.recv(header)
                n = int(header[0])
                await ep.recv(buf[:n])
                t_done = c.now_ns()
                async with recv_cond:
                    state["received"] += 1
                    state["t_done_ns"] = t_done
                    recv_cond.notify_all()
        except Exception as exc:  # the initiator went away (exit), or a real error
            state["recv_error"] = f"{type(exc).__name__}: {exc}"
            async with recv_cond:
                recv_cond.notify_all()

    async def send(nbytes: int) -> tuple[int, int]:
        ep = state["ep"]
        await asyncio.wait_for(ep.send(np.array([nbytes], dtype=np.uint64)), args.timeout_s)
        t0 = c.now_ns()
        await asyncio.wait_for(ep.send(buf[:nbytes]), args.timeout_s)
        return t0, c.now_ns()

    async def handle(req: dict[str, Any]) -> dict[str, Any]:
        cmd = req["cmd"]
        if cmd == "cpu":
            return {"cpu_s": c.cpu_s()}
        if args.role == "target" and cmd in ("await_done", "verify"):
            async with recv_cond:
                await asyncio.wait_for(
                    recv_cond.wait_for(
                        lambda: state["received"] >= req["messages"] or "recv_error" in state
                    ),
                    args.timeout_s,
                )
            if state["received"] < req["messages"]:
                raise RuntimeError(f"receive failed: {state.get('recv_error')}")
            if cmd == "await_done":  # when the data was in this process's buffer
                return {"t_ns": state["t_done_ns"], "cpu_s": c.cpu_s()}
            bad = c.first_mismatch(buf, req["seed"])
            return {"verified": bad is None, "bad_at": bad}
        if args.role == "initiator" and cmd == "connect":
            info = req["info"]
            state["ep"] = await asyncio.wait_for(
                ucxx.create_endpoint(info["host"], int(info["port"])), args.timeout_s
            )
            n = min(int(req["warm_bytes"]), args.size)
            c.fill(buf[:n], 0xFE)
            t0, t1 = await send(n)  # untimed: wires up the endpoint and its lanes
            return {"warm_s": (t1 - t0) / 1e9}
        if args.role == "initiator" and cmd == "fill":  # before "run", outside its clock
            c.fill(buf, req["seed"])
            return {}
        if args.role == "initiator" and cmd == "run":
            cpu0 = c.cpu_s()
            t0, t1 = await send(args.size)
            cpu1 = c.cpu_s()
            return c.timed_result(args.size, t0, t1, cpu0, cpu1)
        raise ValueError(f"{args.role}: unknown command {cmd!r}")

    info: dict[str, Any] = {}
    listener = None
    if args.role == "target":
        listener = ucxx.create_listener(on_connect, port=0)
        info = {"host": args.host, "port": listener.port}
    c.reply({"ok": True, "event": "ready", "info": info, "ucx": ucxx.get_ucx_version()})
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            rep = {} if req["cmd"] == "exit" else await handle(req)
            c.reply({"ok": True, **rep})
        except Exception as exc:
            c.reply(c.error_reply(exc))
        if req["cmd"] == "exit":
            break
    if "ep" in state:
        ep = state["ep"]
        if args.role == "initiator":
            await asyncio.wait_for(ep.close(), 5)
    del listener


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("target", "initiator"), required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="the address the initiator dials")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    c.quiet_stdout()
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
