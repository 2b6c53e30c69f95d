"""Sizes typed by users, and sizes shown to them."""

from __future__ import annotations

import pytest

from core.errors import InvalidSizeError
from core.units import format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 1024**3),
        ("8GB", 8 * 1024**3),  # binary, like drivers and ComfyUI count
        ("8 gb", 8 * 1024**3),
        ("1.5G", int(1.5 * 1024**3)),
        ("512MiB", 512 * 1024**2),
        ("100", 100),
        ("0", 0),
        (1024, 1024),
        (2.5, 2),
    ],
)
def test_parse_size_accepts_what_users_type(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("-1GB", "negative"),
        (-5, "negative"),
        ("nan", "not a memory size"),
        (float("nan"), "not a finite number"),
        (float("inf"), "not a finite number"),
        ("8 parsecs", "unknown unit"),
        ("lots", "not a memory size"),
        ("", "not a memory size"),
        (True, "not a memory size"),
    ],
)
def test_parse_size_names_the_problem(text, problem):
    with pytest.raises(InvalidSizeError, match=problem):
        parse_size(text)


def test_format_bytes_uses_binary_units_and_handles_unknown():
    assert format_bytes(None) == "n/a"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
    assert format_bytes(-2 * 1024**2) == "-2.00 MiB"
    assert format_bytes(5 * 1024**5) == "5120.00 TiB"
