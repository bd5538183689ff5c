"""Fixtures for the SGLang backend's tests: real SGLang servers (tests/sglang/harness.py, run
from .venv-sglang), started once per module and always closed. tests/sglang/inproc runs in
.venv-sglang itself (test_inproc.py starts it), so kvlink's own pytest does not collect it."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from tests.conftest import unavailable
from tests.sglang import harness

collect_ignore = ["inproc"]


@pytest.fixture(scope="session")
def sglang_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    problem = harness.venv_problem()
    if problem:
        unavailable(problem)
    return harness.make_model(tmp_path_factory.mktemp("sglang-model") / "tiny-llama")


@pytest.fixture(scope="session")
def other_model(tmp_path_factory: pytest.TempPathFactory, sglang_model: Path) -> Path:
    """The same architecture with other random weights: its KV is wrong for sglang_model."""
    return harness.make_model(tmp_path_factory.mktemp("sglang-model-b") / "tiny-llama-b",
                              "--seed", "7")


@pytest.fixture(scope="session")
def cluster_secret() -> str:
    return secrets.token_hex(16)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-logs")
