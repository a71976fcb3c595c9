"""Tests for server/startup/memory_size.py: sizes as operators write them, parsed exactly."""

import pytest

from server.startup.memory_size import parse_memory_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("4GiB", 4 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("1.1GB", 1_100_000_000),
        ("1000000", 1_000_000),
        ("2 kib", 2048),
        ("0.5KiB", 512),
        ("1KB", 1000),
        ("7B", 7),
        (" 3TiB ", 3 * 2**40),
    ],
)
def test_parse_memory_size(text: str, expected: int) -> None:
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "abc", "-1GiB", "1.5XB", "1e9", "4 G", "1,000"])
def test_parse_memory_size_rejects_with_a_clear_message(text: str) -> None:
    with pytest.raises(ValueError, match=r"invalid memory size .*KiB, MiB, GiB"):
        parse_memory_size(text)
