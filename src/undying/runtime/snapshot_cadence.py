"""``checkpoint.snapshot_interval: auto``: how many steps apart T1 snapshots are, chosen from the
measured cost of a snapshot and the step time so that snapshots cost at most ``snapshot_budget``.

Runs in the worker; the ``CheckpointEngine`` (runtime/snapshots.py) owns one ``SnapshotCadence``,
feeds it its measurements at every commit and asks it which steps to snapshot.

Every rank must snapshot at the same steps: a restart from T1 restores the newest step that every
rank holds, so ranks that snapshot at different steps lose freshness (at worst they fall back to
the last checkpoint step, which every rank snapshots). The interval is therefore a function of
numbers every rank reads identically, never of a rank's own clock:

- Every ``round_steps`` committed steps (a *round boundary*), each rank adds its own estimates
  (the median stall of its recent snapshots, the median step time without one, its interval in
  force) to sums in the job's store, under keys named by generation and boundary step, and one to
  a count of reporters. ``add`` is atomic, and the sums are all the store holds: O(1) per rank.
- At the next boundary each rank reads the previous boundary's sums. They are complete by then
  without anyone waiting: a rank adds before it begins the next step, and no rank can commit that
  step before every rank has joined its commit vote. Every rank then holds the same sums and
  computes the same interval (``choose_interval`` on the means), applied from that step on.
- Read and report happen only within one generation: each rank knows the step its generation
  started from (all its members start from the same step), and a new generation starts over at
  an interval of 1, as does a replacement process. An incomplete count (a rank without
  estimates yet, a store that moved) decides nothing, on every rank alike.

Why not rank 0 deciding alone: it would need a second exchange (its decision to the others), and
its own stall stands for nobody else's. Why not the commit vote's all-reduce: it belongs to the
step transaction, and its cost is paid every step rather than once a round.

Not guaranteed: a store call that fails or times out on some ranks only (``CADENCE_STORE_TIMEOUT_S``)
leaves those ranks at their old interval until the next round that every rank reads; the mean of
the ranks' intervals, read by all, brings them back to one value then. Meanwhile a restart from T1
may restore an older step (the newest one every rank holds), never a wrong one.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from undying import events as ev

if TYPE_CHECKING:
    from undying.config.model import CheckpointSpec
    from undying.runtime.event_sink import EventSink
    from undying.runtime.membership import Membership

START_INTERVAL = 1  # every step until measured: the non-auto default
ROUND_STEPS_MAX = 20  # at most this many steps between two round boundaries (fewer with a shorter T2 interval)
LOWER_MARGIN = 0.5  # lower the interval only when the lower one costs half the budget: noise does not flap it
STALL_WINDOW = 8  # snapshots whose median stall stands for the next one
STEP_WINDOW = 32  # steps whose median time stands for the next one
CADENCE_STORE_TIMEOUT_S = 5.0  # each store call: milliseconds unless the store's host froze
MICROS = 1_000_000  # the store sums integers: seconds are added as microseconds
FIELDS = ("ranks", "stall_us", "step_us", "interval")


def choose_interval(current: int, stall_seconds: float, step_seconds: float, budget: float, most: int) -> int:
    """The snapshot interval (1..``most``) for a snapshot stall and a step time, starting from ``current``.

    Raised as soon as ``stall / (current x step)`` exceeds ``budget``, to the smallest interval within
    it; lowered only when a lower interval costs at most ``LOWER_MARGIN x budget``."""
    most = max(1, most)
    if step_seconds <= 0:
        return min(max(1, current), most)
    needed = max(1, math.ceil(stall_seconds / (budget * step_seconds)))
    if needed > current:
        return min(needed, most)
    relaxed = max(1, math.ceil(stall_seconds / (budget * LOWER_MARGIN * step_seconds)))
    return min(relaxed if relaxed < current else current, most)


def round_steps(checkpoint_interval: int) -> int:
    """Steps between round boundaries: aligned with the T2 checkpoints when they are close together."""
    return max(1, min(checkpoint_interval, ROUND_STEPS_MAX))


class CadenceStore(Protocol):
    """What the cadence needs of the job's store (runtime/bounded_store.py's ``BoundedStore``)."""

    def add(self, key: str, amount: int) -> int: ...

    def delete_key(self, key: str) -> bool: ...


@dataclass(frozen=True)
class IntervalChange:
    """A new interval, in force from ``step`` on, and the means it was chosen from."""

    step: int
    interval: int
    previous: int
    stall_seconds: float
    step_seconds: float

    @property
    def cost(self) -> float:
        """The fraction of training time snapshots take at the new interval."""
        return self.stall_seconds / (self.interval * self.step_seconds) if self.step_seconds > 0 else 0.0


class SnapshotCadence:
    """One rank's snapshot interval under ``auto``.

    Guarantees: every rank that reads a round's sums in full sets the same interval at the same step;
    the interval stays within 1..``most``; a new generation starts at ``START_INTERVAL`` on every rank.
    Not guaranteed: the budget holds only as well as the last round's medians predict the next steps.
    """

    def __init__(self, budget: float, most: int, store: Callable[[], CadenceStore], prefix: str,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget = budget
        self.most = max(1, most)
        self.round = round_steps(self.most)
        self.interval = START_INTERVAL
        self._store = store
        self._prefix = prefix
        self._clock = clock
        self._generation: int | None = None
        self._first_step = 0  # the generation's first committed step (every member's alike)
        self._committed_at: float | None = None  # when the previous step committed, by ``clock``
        self._stalls: deque[float] = deque(maxlen=STALL_WINDOW)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)

    @classmethod
    def for_job(cls, spec: CheckpointSpec, membership: Membership) -> SnapshotCadence:
        """The cadence of a job's rank: at most one snapshot per T2 checkpoint interval, its sums in
        the job's store (a bounded connection, made anew after a controller failover moved the store)."""
        connection: list[tuple[tuple[str, int] | None, CadenceStore]] = []

        def store() -> CadenceStore:
            if not connection or connection[0][0] != membership.store_address:
                connection[:] = [(membership.store_address,
                                  membership.bounded_store(CADENCE_STORE_TIMEOUT_S, name="snapshot cadence store"))]
            return connection[0][1]

        return cls(spec.snapshot_budget, spec.interval, store, membership.store_prefix)

    def due(self, step: int) -> bool:
        """Is ``step`` a snapshot step?"""
        return step % self.interval == 0

    def enter(self, generation: int, step: int) -> bool:
        """Called at every commit; True when ``step`` is the first commit of a new generation (the
        interval and the measurements start over)."""
        if generation == self._generation:
            return False
        self._generation, self._first_step = generation, step
        self.interval = START_INTERVAL
        self._stalls.clear()
        self._steps.clear()
        return True

    def committed(self, step: int, generation: int, group_rank: int, replicas: int, stall: float | None,
                  timed: bool = True) -> IntervalChange | None:
        """At every commit: time the step that just committed (less ``stall``, what the snapshot
        before it cost; None: there was none), unless ``timed`` is False or the step began a
        generation; then, at a round boundary, agree on the interval (``at_boundary``)."""
        now = self._clock()
        committed_at, self._committed_at = self._committed_at, now
        if not self.enter(generation, step) and committed_at is not None and timed:
            self.observe(now - committed_at - (stall or 0.0), stall)
        return self.at_boundary(step, group_rank, replicas)

    def pace(self, step: int, membership: Membership, reporter: EventSink, checkpoint_interval: int,
             timed: tuple[int, float, float] | None, copying: bool, last_stall: float) -> None:
        """The checkpoint engine, at every commit: hand the cadence the step that just committed
        (``committed``), and emit its change of interval.

        ``timed``: the snapshot taken at the previous commit, if any (its step, the call's seconds,
        the copy's part of them). What it cost the training thread: the call itself plus, overlapped,
        the optimizer step's wait for the copy (the engine's ``settle`` added it to ``last_stall``).
        The step after a checkpoint is not timed: its save may have waited for the persister, and a
        snapshot still ``copying`` (no optimizer step since) has no cost yet."""
        stall = None
        if timed is not None and not copying:
            stall = timed[1] + max(0.0, last_stall - timed[2])
        untimed = (step - 1) % checkpoint_interval == 0 or (timed is not None and stall is None)
        change = self.committed(step, membership.generation, membership.group_rank, membership.replicas,
                                stall=stall, timed=not untimed)
        if change is not None:
            reporter.emit(ev.SNAPSHOT_INTERVAL, step=step, interval=change.interval, previous=change.previous,
                          stall=round(change.stall_seconds, 6), step_seconds=round(change.step_seconds, 6),
                          cost=round(change.cost, 5), budget=self.budget)

    def observe(self, step_seconds: float, stall_seconds: float | None) -> None:
        """One step's time without snapshot, and the stall of the snapshot taken before it (None: none)."""
        if step_seconds > 0:
            self._steps.append(step_seconds)
        if stall_seconds is not None:
            self._stalls.append(stall_seconds)

    def estimates(self) -> tuple[float, float] | None:
        """(stall, step time) this rank expects, or None before it has measured both."""
        if not self._stalls or not self._steps:
            return None
        return statistics.median(self._stalls), statistics.median(self._steps)

    def at_boundary(self, step: int, group_rank: int, replicas: int) -> IntervalChange | None:
        """At a round boundary: decide from the previous round's sums, then add this rank's; the
        change, if the interval changed. Elsewhere nothing happens. A store error skips the round."""
        if self.most <= 1 or step % self.round or self._generation is None:
            return None
        change = None
        previous = step - self.round
        try:
            if previous >= self._first_step:
                change = self._decide(step, previous, replicas)
                if group_rank == 0 and previous - self.round >= self._first_step:
                    self._forget(previous - self.round)
            self._report(step)
        except (RuntimeError, OSError):
            return change
        return change

    def _key(self, boundary: int, field: str) -> str:
        return f"{self._prefix}/cadence/{self._generation}/{boundary}/{field}"

    def _decide(self, step: int, boundary: int, replicas: int) -> IntervalChange | None:
        store = self._store()
        sums = {field: store.add(self._key(boundary, field), 0) for field in FIELDS}  # add 0: an atomic read
        ranks = sums["ranks"]
        if ranks != replicas:
            return None  # someone had nothing to report: every rank sees the same count and keeps its interval
        stall, step_time = sums["stall_us"] / ranks / MICROS, sums["step_us"] / ranks / MICROS
        agreed = max(1, round(sums["interval"] / ranks))  # the ranks' interval (one value unless a round failed)
        chosen = choose_interval(agreed, stall, step_time, self.budget, self.most)
        previous, self.interval = self.interval, chosen
        if chosen == previous:
            return None
        return IntervalChange(step, chosen, previous, stall, step_time)

    def _report(self, step: int) -> None:
        estimates = self.estimates()
        if estimates is None:
            return
        stall, step_time = estimates
        store = self._store()
        # The count last: a reader that sees every rank counted sees every rank's numbers too.
        for field, value in (("stall_us", round(stall * MICROS)), ("step_us", round(step_time * MICROS)),
                             ("interval", self.interval), ("ranks", 1)):
            store.add(self._key(step, field), value)

    def _forget(self, boundary: int) -> None:
        """Rank 0: a boundary every rank has read (one round before the one read now)."""
        store = self._store()
        for field in FIELDS:
            store.delete_key(self._key(boundary, field))
