"""Importing kvlink (and its vLLM integration package) in vLLM's environment does not import
vLLM; looking up KvlinkConnector does, and leaves no abstract method unimplemented."""

from __future__ import annotations

import subprocess

from tests.conftest import unavailable
from tests.vllm import harness

CHECK = """
import sys
import kvlink, kvlink.integrations.vllm
assert "vllm" not in sys.modules, "importing kvlink imported vllm"
from kvlink.integrations.vllm import KvlinkConnector
assert "vllm" in sys.modules
assert not KvlinkConnector.__abstractmethods__, KvlinkConnector.__abstractmethods__
print("ok")
"""


def test_vllm_only_imported_for_the_connector() -> None:
    problem = harness.venv_problem()
    if problem:
        unavailable(problem)
    out = subprocess.run([str(harness.PYTHON), "-c", CHECK], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
