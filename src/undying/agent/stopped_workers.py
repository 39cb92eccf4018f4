"""Which of a node's workers are stopped (SIGSTOP, SIGTSTP): the agent's fast signal of a hang.

Runs in the agent. A stopped process runs nothing, its heartbeat thread included, until someone
sends it SIGCONT; the kernel says so exactly (state ``T`` in ``/proc/PID/stat``), so the agent can
report it within a fraction of a second instead of the controller waiting out ``heartbeat_timeout``.
A busy or starved process is never in that state: load cannot make this signal fire. Without
``/proc`` (not Linux) nothing is ever reported stopped and the heartbeat timeout alone applies.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["STOPPED_CHECK_EVERY", "STOPPED_CONFIRM", "StoppedWorkers", "process_stopped"]

# How often the agent looks at its workers' states (a read of one small /proc file per worker).
STOPPED_CHECK_EVERY = 0.25
# A worker counts as stopped once seen stopped at two looks at least this far apart: a stop and
# continue in quick succession (a job-control round trip, a tool pausing it for a moment) is not a hang.
STOPPED_CONFIRM = 0.5


def process_stopped(pid: int, proc: Path = Path("/proc")) -> bool:
    """Is ``pid`` stopped by a signal (``T``)? False when it runs, sleeps, is traced (``t``: a
    debugger holds it, which is someone's choice) or is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return False
    # "PID (COMM) STATE ...": COMM may hold spaces and parentheses, so the state follows the last ")".
    fields = stat[stat.rfind(")") + 1:].split()
    return bool(fields) and fields[0] == "T"


class StoppedWorkers:
    """The stopped state of each worker process, confirmed over ``STOPPED_CONFIRM`` seconds.

    ``observe`` is called with every live worker's (rank, pid) and the monotonic time; it returns
    the ranks whose confirmed state changed (newly stopped, or running again after SIGCONT), which
    the agent reports at once. ``is_stopped`` answers for a poll's status list."""

    def __init__(self, is_stopped_pid: Callable[[int], bool] = process_stopped,
                 confirm: float = STOPPED_CONFIRM) -> None:
        self._is_stopped_pid = is_stopped_pid
        self.confirm = confirm
        self._first_seen: dict[int, float] = {}  # pid -> when it was first seen stopped (this stop)
        self._confirmed: set[int] = set()  # pids confirmed stopped
        self._last_look: float | None = None

    def is_stopped(self, pid: int) -> bool:
        return pid in self._confirmed

    def observe(self, workers: dict[int, int], now: float) -> list[int]:
        """Look at each worker (rank -> pid) once; the ranks whose confirmed state changed."""
        if self._last_look is not None and now - self._last_look > 2 * self.confirm:
            # This agent did not run meanwhile (stopped with its workers, or starved): what it saw
            # before is stale, and a stop must be seen anew across ``confirm`` to count.
            self._first_seen.clear()
        self._last_look = now
        changed = []
        for rank, pid in workers.items():
            was = pid in self._confirmed
            if self._is_stopped_pid(pid):
                since = self._first_seen.setdefault(pid, now)
                if now - since >= self.confirm:
                    self._confirmed.add(pid)
            else:
                self._first_seen.pop(pid, None)
                self._confirmed.discard(pid)
            if (pid in self._confirmed) != was:
                changed.append(rank)
        live = set(workers.values())
        for pid in set(self._first_seen) - live:  # replaced or reaped: forget it
            del self._first_seen[pid]
        self._confirmed &= live
        return changed
