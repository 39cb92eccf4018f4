"""checkpoint/crc.py: the CRC-32 every checkpoint file and peer copy is checked with gives
``zlib.crc32``'s values, chained as it chains, so files written before (or on a machine without
zlib-ng) verify the same."""

from __future__ import annotations

import os
import zlib

import pytest

from undying.checkpoint import crc


@pytest.mark.parametrize("size", [0, 1, 15, 4096, (1 << 20) + 7])
def test_same_values_as_zlib_whole_and_chained(size: int) -> None:
    data = os.urandom(size)
    assert crc.crc32(data) == zlib.crc32(data)
    cut = size // 3
    assert crc.crc32(data[cut:], crc.crc32(data[:cut])) == zlib.crc32(data)
    assert crc.crc32(memoryview(data)) == zlib.crc32(data)


def test_zlib_ng_is_used_where_installed() -> None:
    """The package depends on zlib-ng; a test environment without it would measure the slow path."""
    pytest.importorskip("zlib_ng")
    assert crc.FAST_CRC
