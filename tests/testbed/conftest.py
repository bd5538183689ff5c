"""Fixtures for tests that build real network namespaces (marker ``root``).

Tests marked ``root`` are skipped when we are not root or iproute2 is missing, unless
KVLINK_REQUIRE_ALL=1 (as in CI), where that is a failure instead (tests/conftest.py decides
that, for every marker naming a system need). Every namespace a test
creates is removed in a finalizer even when the test fails, and each test gets a timeout
(pytest-timeout) so a hung transfer fails instead of stalling the run.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

import kvlink.testbed as kt

# The slowest test measures two 2 s iperf3 runs; 60 s only trips on a real hang.
TESTBED_TIMEOUT_S = 60


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("timeout"):
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TESTBED_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _cluster_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Testbed agents listen on 198.18.x addresses, which takes a secret: every
    agent of a test, in this process or a child, shares one."""
    monkeypatch.setenv("KVLINK_SECRET", secrets.token_hex(16))


def unique_tag() -> str:
    """A fresh 7-character tag, unused by any live namespace."""
    live = kt._list_netns()
    while True:
        tag = "t" + secrets.token_hex(3)
        if not any(ns.startswith(f"{kt.NAME_PREFIX}{tag}") for ns in live):
            return tag


class TestbedFactory:
    """Builds testbeds with unique tags and remembers every tag for teardown."""

    __test__ = False

    def __init__(self) -> None:
        self.tags: list[str] = []
        self._testbeds: list[kt.Testbed] = []

    def reserve_tag(self) -> str:
        """A unique tag that is torn down after the test (for testbeds made another way)."""
        tag = unique_tag()
        self.tags.append(tag)
        return tag

    def __call__(self, *, up: bool = True, **kwargs: Any) -> kt.Testbed:
        """``kt.Testbed(**kwargs)`` with a unique tag, brought up unless ``up=False``."""
        kwargs.setdefault("tag", self.reserve_tag())
        if kwargs["tag"] not in self.tags:
            self.tags.append(kwargs["tag"])
        tb = kt.Testbed(**kwargs)
        self._testbeds.append(tb)
        if up:
            tb.up()
        return tb

    def close(self) -> None:
        """Down every testbed (stopping their processes), then any tag still present."""
        errors: list[BaseException] = []
        for tb in reversed(self._testbeds):
            try:
                tb.down()
            except kt.TestbedError as exc:
                errors.append(exc)
        for tag in self.tags:
            try:
                kt.teardown(tag)
            except kt.TestbedError as exc:
                errors.append(exc)
        left = sorted(
            ns for ns in kt._list_netns() for tag in self.tags if ns.startswith(f"kvl{tag}")
        )
        if errors or left:
            pytest.fail(f"testbed teardown failed: {errors}; namespaces left: {left}")


@pytest.fixture
def testbed() -> Iterator[TestbedFactory]:
    """Factory: ``testbed(links=2, rate="1gbit")`` returns an up Testbed with a unique tag.

    ``testbed.reserve_tag()`` gives a tag for testbeds built outside the factory (the CLI);
    everything is torn down after the test, pass or fail.
    """
    factory = TestbedFactory()
    try:
        yield factory
    finally:
        factory.close()
