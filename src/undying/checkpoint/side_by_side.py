"""Calls run side by side on a few threads: the files of one checkpoint verified at once
(checkpoint/committed.py), the data files of one DCP checkpoint read at once (checkpoint/dcp_reader.py).

Runs in the worker (a restore's reads); the calls are file reads, checksums and copies, which
release the GIL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor


def side_by_side(calls: Sequence[Callable[[], None]], threads: int, name: str) -> None:
    """Run ``calls`` on up to ``threads`` threads named ``name`` (a single call on this thread); the
    first failure in their order is raised, once every call has ended."""
    if len(calls) < 2:
        for call in calls:
            call()
        return
    with ThreadPoolExecutor(min(len(calls), threads), thread_name_prefix=name) as pool:
        futures = [pool.submit(call) for call in calls]
        for future in futures:
            future.result()
