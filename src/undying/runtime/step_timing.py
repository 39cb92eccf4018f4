"""A rank's step times: its own compute, its wait inside collectives, and its data loading.

Runs in the worker. The runtime calls ``begin`` as a step starts and ``committed`` once the step
committed (before its checkpoint work, which differs by rank: the T2 writer copies the whole replica
into node memory). The wait inside
collectives is what the training thread spent in the group's waits (runtime/pg.py
``waited_seconds``: for a data-parallel rank, the wait for its slowest peer); the data loading is
what the loaders' ``next`` took; the compute is the rest of the step. The newest
``window`` committed steps (the median of each part: a step that a busy machine's scheduler or a
garbage collection stretched moves it little) ride on every heartbeat (protocol.Heartbeat), and the controller
compares the ranks' busy time (compute and data loading) to find a straggler
(controller/stragglers.py). A failed step is not timed, and after a restore or a recovery the window
starts again with its first step left out (a warm-up: allocations, a replacement's first pass).

Cost: three clock reads and a few additions per step.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from undying.runtime.pg import waited_seconds


@dataclass(frozen=True)
class StepTimes:
    """Over ``steps`` committed steps, the median of each part, in seconds (what a heartbeat carries)."""

    steps: int = 0
    compute: float = 0.0
    comm: float = 0.0
    data: float = 0.0


class StepTimer:
    """The newest ``window`` committed steps of this process, each as (compute, comm, data) seconds."""

    def __init__(self, window: int, data_seconds: Callable[[], float]) -> None:
        self._steps: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=window)
        self._data_seconds = data_seconds
        self._skip_next = True
        self._started: float | None = None
        self._waited_at_start = 0.0
        self._data_at_start = 0.0
        self._injected = 0.0  # an injected slowdown (inject.py ``slow``) in the step in flight
        self.own_compute = 0.0  # the newest timed step's compute without an injected slowdown

    def begin(self) -> None:
        self._started = time.perf_counter()
        self._waited_at_start = waited_seconds()
        self._data_at_start = self._data_seconds()
        self._injected = 0.0

    def injected(self, seconds: float) -> None:
        """An injected slowdown of this many seconds is part of the step in flight."""
        self._injected += seconds

    def committed(self) -> None:
        """The step begun last committed: time it (unless it is the warm-up after a (re)start)."""
        if self._started is None:
            return
        wall = time.perf_counter() - self._started
        self._started = None
        if self._skip_next:
            self._skip_next = False
            return
        comm = max(0.0, waited_seconds() - self._waited_at_start)
        data = max(0.0, self._data_seconds() - self._data_at_start)
        compute = max(0.0, wall - comm - data)
        self.own_compute = max(0.0, compute - self._injected)
        self._steps.append((compute, comm, data))

    def restart(self) -> None:
        """A restore or a recovery: the steps timed so far were another history; the next is a warm-up."""
        self._steps.clear()
        self._skip_next = True
        self._started = None

    def typical(self) -> StepTimes:
        """The window's typical step: the median of each part."""
        if not self._steps:
            return StepTimes()
        compute, comm, data = (statistics.median(values) for values in zip(*self._steps, strict=True))
        return StepTimes(len(self._steps), compute, comm, data)
