"""Checks of caller arguments shared by the object API: each names the argument,
says what is wrong and what it takes."""

from __future__ import annotations

import math
from typing import Any

from ._errors import ArgumentTypeError, InvalidArgumentError


def bool_arg(name: str, value: Any) -> bool:
    """``value`` if it is a real bool: ``remote_write="no"`` must not grant write.

    Raises:
        ArgumentTypeError: anything but True or False.
    """
    if not isinstance(value, bool):
        raise ArgumentTypeError(
            f"{name}: expected True or False, got {value!r} ({type(value).__name__})"
        )
    return value


def timeout_arg(value: Any, name: str = "timeout_s", *, none_ok: bool = True) -> float | None:
    """``value`` as seconds to wait (None: no limit, where ``none_ok``).

    Raises:
        ArgumentTypeError: not a number (a string such as "5" included).
        InvalidArgumentError: negative or NaN.
    """
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        accepted = "seconds as an int or float" + (" or None (no limit)" if none_ok else "")
        raise ArgumentTypeError(
            f"{name}: expected {accepted}, got {value!r} ({type(value).__name__})"
        )
    if math.isnan(value) or value < 0:
        raise InvalidArgumentError(
            f"{name}: {value} is not a duration; pass 0 or more seconds (0 polls once)"
        )
    return float(value)


def int_error(name: str, value: Any, expected: str) -> InvalidArgumentError:
    """The error for an int argument ``value`` that is not ``expected``: ArgumentTypeError
    when it is not an int at all (bool included), InvalidArgumentError when it is out of
    range."""
    wrong_type = isinstance(value, bool) or not isinstance(value, int)
    cls = ArgumentTypeError if wrong_type else InvalidArgumentError
    return cls(f"{name}: expected {expected}, got {value!r}")
