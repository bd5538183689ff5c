"""Fixtures for the pytest-benchmark micro-benchmarks (bench/test_micro.py).

pytest-benchmark's table shows times only; the derived figures (GB/s of
crc32c, per-chunk overhead) live in ``extra_info``, which only reaches
``--benchmark-json``.  Tests also add them, one line each, to ``bench_report``,
and this conftest prints those lines after the table so one run shows both.
"""

from __future__ import annotations

import pytest

_REPORT = pytest.StashKey[list[str]]()


@pytest.fixture(scope="session")
def bench_report(pytestconfig: pytest.Config) -> list[str]:
    """Lines printed under "kvlink micro-benchmark summary" at the end of the run."""
    return pytestconfig.stash.setdefault(_REPORT, [])


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's table
def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    lines = config.stash.get(_REPORT, [])
    if lines:
        terminalreporter.section("kvlink micro-benchmark summary")
        for line in lines:
            terminalreporter.write_line(line)
