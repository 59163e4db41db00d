"""pagedkv.units: the one size parser (engine options, CLIs, planner) and the byte formatter."""

from __future__ import annotations

import pytest

from pagedkv.errors import ConfigError
from pagedkv.units import GiB, KiB, MiB, TiB, format_bytes, parse_memory_size


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("1024", 1024),
        ("1G", GiB),
        ("1GiB", GiB),
        ("1gb", 10**9),
        ("1.5G", 3 * GiB // 2),
        ("512 MiB", 512 * MiB),
        (" 64KiB ", 64 * KiB),
        ("2T", 2 * TiB),
        (".5M", MiB // 2),
    ],
)
def test_parse_memory_size(text, num_bytes):
    assert parse_memory_size(text) == num_bytes


@pytest.mark.parametrize("text", ["", "lots", "12 parsecs", "-1G", "1 G B", "GiB"])
def test_parse_memory_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ConfigError, match="not a memory size"):
        parse_memory_size(text)


def test_format_bytes():
    assert format_bytes(53.8 * GiB) == "53.80 GiB"
    assert format_bytes(3 * MiB) == "3.00 MiB"
    assert format_bytes(2048) == "2.00 KiB"
    assert format_bytes(100) == "100 B"
