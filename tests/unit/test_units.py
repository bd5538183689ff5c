"""parse_size: one size syntax for the library, its config and its CLIs."""

from __future__ import annotations

import pytest

from kvlink._units import parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        (4096, 4096),
        (0, 0),
        ("4096", 4096),
        (" 4096 ", 4096),
        ("0x1000", 4096),
        ("64MiB", 64 << 20),
        ("64mib", 64 << 20),
        ("64 MiB", 64 << 20),
        ("1GiB", 1 << 30),
        ("16M", 16 << 20),
        ("1G", 1 << 30),
        ("20MB", 20_000_000),
        ("1.5GB", 1_500_000_000),
        ("1.1GB", 1_100_000_000),
        ("0.5KiB", 512),
        ("100B", 100),
        ("2TiB", 2 << 40),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad,match",
    [
        ("", "not a size"),
        ("lots", "not a size: 'lots'"),
        ("64 apples", "not a size"),
        ("-5", "not a size"),
        (-5, "negative"),
        ("1.5B", "whole number of bytes"),
        (1.5, "expected bytes as an int or text"),
        (True, "expected bytes"),
        (None, "expected bytes"),
    ],
)
def test_refused_with_the_accepted_forms(bad, match):
    with pytest.raises(ValueError, match=match) as ei:
        parse_size(bad)
    if isinstance(bad, str) and match.startswith("not a size"):
        assert "64MiB" in str(ei.value)
