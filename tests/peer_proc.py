"""A kvlink agent in its own process, driven by JSON lines on stdin/stdout.

Tests use it (through tests/peer_client.py) so every transfer crosses a real
socket between two processes.  One request per line; one reply per line:
{"ok": true, ...} or {"ok": false, "error": "<ExceptionClass>", "message": "..."}.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback
from typing import Any

import numpy as np

import kvlink
from kvlink import kv

agent: kvlink.Agent | None = None
buffers: dict[str, np.ndarray[Any, Any]] = {}
regions: dict[str, kvlink.Region] = {}
transfers: dict[int, kvlink.Transfer] = {}


def pattern(nbytes: int, seed: int) -> np.ndarray[Any, Any]:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8).copy()


def handle(req: dict[str, Any]) -> dict[str, Any]:
    global agent
    cmd = req["cmd"]
    if cmd == "init":
        agent = kvlink.Agent(req["name"], kvlink.Config(nics=req["nics"], **req["config"]))
        return {"metadata": agent.metadata().decode(), "addresses": agent.addresses}
    assert agent is not None
    if cmd == "alloc":
        n = req["nbytes"]
        buf = pattern(n, req["seed"]) if req.get("seed") is not None else np.zeros(n, np.uint8)
        r = agent.register(
            buf,
            remote_read=req.get("remote_read", False),
            remote_write=req.get("remote_write", False),
            name=req.get("name"),
        )
        buffers[req["key"]] = buf
        regions[req["key"]] = r
        return {"region": r.id}
    if cmd == "digest":
        buf = buffers[req["key"]]
        off = req.get("offset", 0)
        n = req.get("nbytes", buf.nbytes - off)
        return {"digest": hashlib.blake2b(buf[off : off + n].data).hexdigest()}
    if cmd == "read":
        buf = buffers[req["key"]]
        off, n = req["offset"], req["nbytes"]
        return {"hex": buf[off : off + n].tobytes().hex()}
    if cmd == "layout":
        buf = buffers[req["key"]]
        layers = buf.reshape(req["layers"], req["planes"], req["num_blocks"], -1)
        lay = kv.PagedLayout.from_tensors(agent, list(layers), planes=req["planes"])
        return {"layout": lay.to_dict()}
    if cmd == "add_peer":
        return {"peer": agent.add_peer(req["metadata"].encode())}
    if cmd in ("push", "pull"):
        fn = agent.push if cmd == "push" else agent.pull
        kw: dict[str, Any] = {"notify": bytes.fromhex(req["notify"]) if req.get("notify") else None}
        if "segments" in req:
            kw["segments"] = [kvlink.Segment(*s) for s in req["segments"]]
        else:
            local = buffers[req["local"]]
            if cmd == "push":
                kw.update(src=local, dst=req["remote"])
            else:
                kw.update(src=req["remote"], dst=local)
            kw["nbytes"] = req.get("nbytes")
        h = fn(req["peer"], **kw)
        transfers[h.id] = h
        if req.get("wait") is not None:
            h.wait(req["wait"])
        return {"id": h.id, "state": h.state.name}
    if cmd == "wait":
        h = transfers[req["id"]]
        try:
            h.wait(req["wait_s"])
        finally:
            i = h.info()
        return {
            "t_submit_ns": i.t_submit_ns,
            "t_first_ns": i.t_first_byte_ns,
            "t_done_ns": i.t_done_ns,
            "retries": i.retries,
            "chunks": i.chunks_total,
        }
    if cmd == "chunks":
        h = transfers[req["id"]]
        return {
            "events": [
                [e.index, e.path, e.nbytes, e.layers.start, e.layers.stop, e.t_ns]
                for e in h.chunks(timeout_s=req["wait_s"])
            ],
            "t_submit_ns": h.info().t_submit_ns,
        }
    if cmd == "prepare":
        ps = agent.prepare(req["peer"], nbytes=req.get("nbytes"), timeout_s=req["wait_s"])
        return {"states": [p.state.name for p in ps]}
    if cmd == "now":
        return {"ns": time.monotonic_ns()}
    if cmd == "notifications":
        ns = agent.notifications(timeout_s=req.get("wait_s", 0.0))
        return {
            "notifications": [{"peer": n.peer, "tag": n.tag.hex(), "op": n.op.name} for n in ns]
        }
    if cmd == "paths":
        return {"paths": [p.__dict__ | {"state": p.state.name} for p in agent.paths()]}
    if cmd == "deregister":
        agent.deregister(regions.pop(req["key"]))
        return {}
    if cmd == "exit":
        agent.close()
        return {"bye": True}
    raise ValueError(f"unknown command {cmd!r}")


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        try:
            rep = {"ok": True, **handle(req)}
        except Exception as exc:
            rep = {
                "ok": False,
                "error": type(exc).__name__,
                "message": str(exc),
                "trace": traceback.format_exc(),
            }
        sys.stdout.write(json.dumps(rep) + "\n")
        sys.stdout.flush()
        if req.get("cmd") == "exit":
            return


if __name__ == "__main__":
    main()
