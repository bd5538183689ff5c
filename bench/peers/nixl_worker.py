"""NIXL worker (UCX backend): a host-memory WRITE between two agents.

    .venvs/nixl/bin/python nixl_worker.py --role target|initiator --size N

Protocol: see _common.py. Public API only, as in NIXL's Python examples: ``nixl_agent(name,
nixl_agent_config(backends=["UCX"]))``, ``register_memory([(ptr, n, 0, "")], "DRAM")``,
``get_agent_metadata`` / ``add_remote_agent``, ``get_xfer_descs``, ``initialize_xfer("WRITE",
...)``, ``transfer`` and ``check_xfer_state`` polled until "DONE"; the target learns of completion
from the WRITE's notification (``check_remote_xfer_done``), which ends the clock.
``initialize_xfer`` (request preparation) runs before the clock starts.

UCX is configured only through its environment, which kvlink/bench/peers.py sets (for
compare.py and kvlink-bench): ``UCX_TLS=tcp`` (else UCX would use shared memory between two
processes on one host, which is not a network),
``UCX_NET_DEVICES`` (lo, or this side's four testbed veths), ``UCX_MODULES=^ib,...`` (peers.md:
without it the process segfaults at exit) and, on the testbed, the multi-rail limits
UCX_MAX_RMA_RAILS / UCX_MAX_RNDV_RAILS / UCX_MAX_EAGER_RAILS raised to the number of links.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _common as c

try:  # the `nixl` meta package's name; the nixl-cu12 wheel alone installs `nixl_cu12`
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]
except ImportError:
    from nixl_cu12 import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("target", "initiator"), required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--host", help="unused: UCX finds the peer through the agent metadata")
    ap.add_argument(
        "--poll-sleep-us",
        type=float,
        default=200.0,
        help="sleep between check_xfer_state polls; NIXL's examples spin (0), which on this "
        "2-core machine takes a core from UCX's progress thread and the kernel: measured "
        "slower (1.9 vs 2.4-3.2 GB/s on loopback), so the default sleeps",
    )
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    c.quiet_stdout()

    name = f"kvlbench-{args.role}"
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    buf = c.touched(args.size)
    ptr = buf.ctypes.data
    reg = agent.register_memory([(ptr, args.size, 0, "")], "DRAM")
    state: dict[str, Any] = {}

    def write(nbytes: int, tag: bytes) -> tuple[int, int]:
        local = agent.get_xfer_descs([(ptr, nbytes, 0)], "DRAM")
        remote = agent.get_xfer_descs([(state["remote"], nbytes, 0)], "DRAM")
        handle = agent.initialize_xfer("WRITE", local, remote, state["peer"], tag)
        sleep_s = args.poll_sleep_us / 1e6
        t0 = c.now_ns()
        st = agent.transfer(handle)
        deadline = time.monotonic() + args.timeout_s
        while st not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"WRITE of {nbytes} B not DONE in {args.timeout_s} s")
            if sleep_s:
                time.sleep(sleep_s)
            st = agent.check_xfer_state(handle)
        t1 = c.now_ns()
        agent.release_xfer_handle(handle)
        if st != "DONE":
            raise RuntimeError(f"WRITE of {nbytes} B ended in state {st}")
        return t0, t1

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        cmd = req["cmd"]
        if args.role == "target" and cmd == "await_done":
            # The initiator's WRITE carries a notification; NIXL delivers it after the data.
            # Its arrival is when the bytes are known to be in this process's memory.
            tag = req["tag"].encode()
            deadline = time.monotonic() + args.timeout_s
            while not agent.check_remote_xfer_done(req["peer"], tag, tag_is_prefix=False):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no notification {tag!r} in {args.timeout_s} s")
                time.sleep(args.poll_sleep_us / 1e6)
            return {"t_ns": c.now_ns(), "cpu_s": c.cpu_s()}
        if args.role == "target" and cmd == "verify":
            bad = c.first_mismatch(buf, req["seed"])
            return {"verified": bad is None, "bad_at": bad}
        if args.role == "initiator" and cmd == "connect":
            info = req["info"]
            state["peer"] = agent.add_remote_agent(bytes.fromhex(info["metadata"]))
            state["remote"] = int(info["addr"])
            # Untimed: the first WRITE wires up the UCX endpoint(s) and lanes.
            n = min(int(req["warm_bytes"]), args.size)
            c.fill(buf[:n], 0xFE)
            t0, t1 = write(n, b"warm")
            return {"warm_s": (t1 - t0) / 1e9}
        if args.role == "initiator" and cmd == "fill":  # before "run", outside its clock
            c.fill(buf, req["seed"])
            return {}
        if args.role == "initiator" and cmd == "run":
            cpu0 = c.cpu_s()
            t0, t1 = write(args.size, req["tag"].encode())
            cpu1 = c.cpu_s()
            return c.timed_result(args.size, t0, t1, cpu0, cpu1)
        raise ValueError(f"{args.role}: unknown command {cmd!r}")

    info: dict[str, Any] = {}
    if args.role == "target":
        info = {"metadata": agent.get_agent_metadata().hex(), "addr": ptr, "name": name}
    else:
        info = {"name": name}
    c.reply({"ok": True, "event": "ready", "info": info})
    c.serve(handle)
    agent.deregister_memory(reg)


if __name__ == "__main__":
    main()
