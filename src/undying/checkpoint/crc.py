"""CRC-32 of checkpoint bytes: zlib-ng's where it is installed, else the standard library's.

Imported by every process that writes or verifies checkpoint files and peer copies (workers, the
persister thread, ``undying`` commands that read checkpoints). Both compute the same CRC-32
(``zlib.crc32``'s polynomial and chaining), so checkpoints written with either verify with the
other; zlib-ng's is several times faster on large buffers (SIMD: 7.2 against 1.37 GB/s here,
docs/benchmarks.md), which is CPU every T2 write, T2 load and peer copy no longer spends. Both
release the GIL on large buffers.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

__all__ = ["FAST_CRC", "crc32"]

_crc32: Callable[[Any, int], int] = zlib.crc32
FAST_CRC = False  # True: zlib-ng's; False: a machine without its wheel, the same values, slower
try:
    from zlib_ng import zlib_ng
except ImportError:
    pass
else:
    _crc32 = zlib_ng.crc32
    FAST_CRC = True


def crc32(data: Any, value: int = 0) -> int:
    """The CRC-32 of ``data`` (any buffer) continuing from ``value`` (0: a new one), as ``zlib.crc32``."""
    return _crc32(data, value)
