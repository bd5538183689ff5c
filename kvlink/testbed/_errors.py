"""The testbed's exceptions (shared by every module of the package)."""

from __future__ import annotations

from .._errors import KvlinkError


class TestbedError(KvlinkError, RuntimeError):
    """A testbed operation failed; the message says what failed and what to do about it."""

    # Not a pytest test class despite the name: without this, importing it into a test module
    # makes pytest warn, which filterwarnings=error turns into a failure.
    __test__ = False


class TestbedConfigError(TestbedError, ValueError):
    """An argument given to the testbed is invalid; the message names the argument."""

    __test__ = False
