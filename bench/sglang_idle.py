"""CPU that SGLang's own processes use on this machine while idle and while decode waits for a
request's KV: what kvlink's threads share each server's core with in bench/sglang_ttft.py.

    .venv/bin/python bench/sglang_idle.py --seconds 3

A tiny-model prefill/decode pair with kvlink (prefill pinned to core 0, decode to core 1), one
warm-up request, then per process of each server its cores (user + system CPU seconds per
second) over ``--seconds``: both idle, then decode holding a request whose prefill has not run
yet. One JSON row per phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.sglang import harness


def cores(server: harness.Server, seconds: float) -> dict[str, float]:
    top = psutil.Process(server.proc.pid)
    procs = [top, *top.children(recursive=True)]
    before = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
    time.sleep(seconds)
    out = {}
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            used = sum(p.cpu_times()[:2]) - before[p.pid]
            out[f"{p.pid}:{p.name()}"] = round(used / seconds, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    problem = harness.venv_problem()
    if problem:
        sys.exit(problem)
    work = Path(tempfile.mkdtemp(prefix="kvlink-sglang-idle-"))
    model = harness.make_model(work / "tiny-llama")
    env = {"KVLINK_NICS": "loopback:2"}
    bport = harness.free_port()
    p = harness.Server("prefill", model, log_dir=work, mode="prefill", bootstrap_port=bport,
                       cpu=0, env=env)
    d = harness.Server("decode", model, log_dir=work, mode="decode", bootstrap_port=bport,
                       cpu=1, env=env)
    try:
        harness.start_all([p, d])
        r = harness.pd_generate(p, d, harness.prompt_of(40, 1))
        assert r["decode_status"] == 200, r
        for name, s in (("decode", d), ("prefill", p)):
            print(json.dumps({"bench": "sglang_idle", "phase": "idle", "server": name,
                              "cores": cores(s, a.seconds)}), flush=True)
        body = harness.request_body(harness.prompt_of(300, 2))
        body.update(bootstrap_host=p.host, bootstrap_port=bport, bootstrap_room=12345)
        t = threading.Thread(target=harness.generate, args=(d.url, body, 120), daemon=True)
        t.start()
        time.sleep(2)
        print(json.dumps({"bench": "sglang_idle", "phase": "decode waits for KV",
                          "server": "decode", "cores": cores(d, a.seconds)}), flush=True)
        harness.generate(p.url, body, 120)
        t.join(60)
    finally:
        harness.close_all([p, d])


if __name__ == "__main__":
    main()
