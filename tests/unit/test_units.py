"""kvlink._units.parse_size: one reading of sizes everywhere."""

from __future__ import annotations

import pytest

from kvlink._units import parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        (4096, 4096),
        (0, 0),
        ("4096", 4096),
        ("64MiB", 64 << 20),
        ("1GiB", 1 << 30),
        ("1.5GB", 1_500_000_000),
        ("20MB", 20_000_000),
        ("4KiB", 4096),
        (" 2 gib ", 2 << 30),
        ("1G", 1 << 30),
        ("512B", 512),
    ],
)
def test_sizes_people_write(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "value,fragment",
    [
        ("lots", "not a size: 'lots'"),
        ("64 MiBs", "not a size"),
        ("", "not a size"),
        ("-1", "not a size"),
        (-1, "cannot be negative"),
        ("1.5B", "not a whole number of bytes"),
        (1.5, "must be an int or a string"),
        (True, "must be an int or a string"),
    ],
)
def test_what_is_not_a_size_is_named(value, fragment):
    with pytest.raises(ValueError) as ei:
        parse_size(value)
    assert fragment in str(ei.value)
