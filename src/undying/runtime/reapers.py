"""Dropping a process group without blocking the training thread: reaper threads.

Runs in the worker. A group abandoned after a fault may have a destructor that waits on a dead
peer (gloo joins its threads, NCCL its communicators); its last references are handed to a
reaper thread here, which lets them go once the training thread holds none (an exception being
unwound may still), so the group's sockets close at the drop and the training thread never waits
in the destructor. ``reapers_alive`` tells the exit hook (runtime/process_exit.py) whether a
teardown is still running.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

REAP_DELAY_S = 2.0  # the longest a reaper waits for the training thread to let go of a dropped group
REAP_POLL_S = 0.01

_reapers: list[threading.Thread] = []


def start_reaper(reap: Callable[..., None], *doomed: object) -> None:
    """Run ``reap(*doomed)`` on a thread that ``reapers_alive`` counts: the thread's arguments are
    the last references to a dropped group, whose teardown may wait on a dead peer."""
    reaper = threading.Thread(target=reap, args=doomed, name="undying-reaper", daemon=True)
    _reapers.append(reaper)
    reaper.start()


def reapers_alive() -> bool:
    """Is an abandoned group still being torn down (its destructor waiting on a dead peer)?"""
    return any(thread.is_alive() for thread in _reapers)


def release_last_references(doomed: list[object]) -> None:
    await_last_references(doomed)
    doomed.clear()  # the works first (a list lets its items go from the last), then the group


def await_last_references(doomed: list[Any], limit: float = REAP_DELAY_S) -> None:
    """Return once the list ``doomed`` (a reaper's) holds the only references to its items, or after
    ``limit`` seconds.

    The training thread may still hold a dropped group, in the frames of an exception being unwound;
    were its reference the last, the group's destructor (which can wait on a dead peer) would run on
    that thread. Python's reference counts say when the reaper is the only holder, so it lets the
    group go at once, and its sockets close (every peer still in one of its collectives fails) at the
    drop, not a fixed pause later. Not seen: references held from C++ (a DDP reducer's); such a group
    lives until its holder goes, as it would have anyway."""
    deadline = time.monotonic() + limit
    while not _held_only_by(doomed) and time.monotonic() < deadline:
        time.sleep(REAP_POLL_S)


def _held_only_by(items: list[Any]) -> bool:
    probe = object()  # counted the same way as the items, plus its own name here
    items.append(probe)
    try:
        counts = [sys.getrefcount(item) for item in items]
    finally:
        items.pop()
    ours = counts[-1] - 1
    return all(count <= ours for count in counts[:-1])


def abort_quietly(group: object) -> None:
    """Abort a backend group's communicators (NCCL) if it has the call; a group being dropped
    either way, its errors are of no interest."""
    abort = getattr(group, "abort", None)
    if abort is None:
        return
    try:
        abort()
    except Exception:  # noqa: BLE001, S110 - the group is being dropped either way
        pass
