"""Runs tests/sglang/inproc (SGLang's KVPoll state machine with kvlink's classes, prefill and
decode in one process) in .venv-sglang, where SGLang is installed."""

from __future__ import annotations

import os
import subprocess

from tests.conftest import unavailable
from tests.sglang import harness


def test_kvpoll_state_machine_in_sglang() -> None:
    problem = harness.venv_problem()
    if problem:
        unavailable(problem)
    inproc = harness.ROOT / "tests" / "sglang" / "inproc"
    run = subprocess.run(
        [str(harness.PYTHON), "-m", "pytest", "-c", str(inproc / "pytest.ini"), str(inproc),
         "-q"],
        cwd=inproc, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    summary = run.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert run.returncode == 0, f"{summary[0]}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    assert " passed" in summary[0] and "skipped" not in summary[0], summary[0]
