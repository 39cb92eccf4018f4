"""Straggler detection: a rank persistently slower than its peers, from the step times on its heartbeats.

Runs in the controller, inside the job machine (pure: no clock, no I/O). Every heartbeat carries the
rank's typical step (the medians) over its newest ``straggler_window`` committed steps (runtime/step_timing.py): its own
compute, its data loading, and its wait inside collectives. In a data-parallel step every rank waits
for the slowest, so the step time is the same everywhere and the wait is not: a straggler's busy
time (compute + data loading) is long and its wait short, its peers' the other way round. A rank
whose busy time is at least ``straggler_threshold`` times the median of its peers' (and longer by
more than ``MIN_EXCESS_S``, so jitter of a step of a few milliseconds is not a straggler), over a
full window, and whom its peers wait for (their median wait is longer than its own by half its
excess at least: on a machine whose cores are shared, a rank can compute slowly for a while without
holding anyone back, its peers slowed as much), is one. A sharded job's collectives inside forward
and backward (FSDP's) are not timed as waits, so its stragglers are not told from its peers. Each process is reported once. The job machine calls ``find`` as time passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from undying.protocol import Heartbeat

# A busy time this much longer than the peers' median at least: below it, a ratio is the jitter of a
# few-millisecond step (a busy machine's scheduler), not a straggler.
MIN_EXCESS_S = 0.01
# The ranks are judged at most this often (a sort of every rank's newest times: ~3 ms at 16k ranks).
JUDGE_EVERY_S = 0.1


@dataclass(frozen=True)
class Straggler:
    """A rank found slow: its busy time per step, its peers' median, and their ratio."""

    rank: int
    node: int
    busy: float
    peers_busy: float
    ratio: float
    compute: float
    data: float
    comm: float
    peers_comm: float

    def details(self) -> dict[str, float | int]:
        return {"ratio": round(self.ratio, 3), "busy_seconds": round(self.busy, 6),
                "peers_busy_seconds": round(self.peers_busy, 6), "compute_seconds": round(self.compute, 6),
                "data_seconds": round(self.data, 6), "comm_seconds": round(self.comm, 6),
                "peers_comm_seconds": round(self.peers_comm, 6)}


@dataclass(frozen=True)
class _Times:
    generation: int
    pid: int
    node: int
    busy: float
    compute: float
    data: float
    comm: float


class StragglerWatch:
    """The newest full-window step times of each rank (``observe``, every heartbeat: a dict write), and
    the stragglers among them (``find``: a sort of the ranks, at most every ``JUDGE_EVERY_S``)."""

    def __init__(self, threshold: float, window: int) -> None:
        self.threshold = threshold
        self.window = window
        self._times: dict[int, _Times] = {}
        self._reported: set[tuple[int, int]] = set()  # (rank, pid): each process once
        self._changed = False
        self._judged_at = float("-inf")

    def new_generation(self) -> None:
        """Every rank starts afresh (a job restart): earlier times compare with nothing now."""
        self._times.clear()

    def observe(self, beat: Heartbeat) -> None:
        """A rank's heartbeat: its newest step times, once its window is full."""
        if beat.timed_steps < self.window:
            self._times.pop(beat.rank, None)  # not full yet (a new process, a recovery): not comparable
            return
        self._times[beat.rank] = _Times(beat.generation, beat.pid, beat.node, beat.compute_seconds + beat.data_seconds,
                                        beat.compute_seconds, beat.data_seconds, beat.comm_seconds)
        self._changed = True

    def find(self, now: float) -> list[Straggler]:
        """The stragglers not reported before, among the ranks of the newest generation heard."""
        if not self._changed or now - self._judged_at < JUDGE_EVERY_S:
            return []
        self._changed, self._judged_at = False, now
        generation = max((times.generation for times in self._times.values()), default=0)
        ranks = sorted((times.busy, rank) for rank, times in self._times.items() if times.generation == generation)
        if len(ranks) < 2:
            return []
        busy_times = [busy for busy, _ in ranks]
        waits = sorted(self._times[rank].comm for _, rank in ranks)
        found = []
        # From the slowest down: a rank faster than one that is not slow enough is not either.
        for index in range(len(ranks) - 1, -1, -1):
            busy, rank = ranks[index]
            median = _median_without(busy_times, index)
            if median <= 0 or busy < self.threshold * median or busy - median < MIN_EXCESS_S:
                break
            times = self._times[rank]
            peers_wait = _median_without(waits, waits.index(times.comm))
            if (rank, times.pid) in self._reported or peers_wait - times.comm < (busy - median) / 2:
                continue  # reported; or nobody waits for it: slowed with its peers (a shared machine)
            self._reported.add((rank, times.pid))
            found.append(Straggler(rank, times.node, busy, median, busy / median, times.compute, times.data,
                                   times.comm, peers_wait))
        return found


def _median_without(ordered: list[float], index: int) -> float:
    """The median of ``ordered`` (sorted) without its element at ``index``: a rank's peers' median."""
    count = len(ordered) - 1

    def at(position: int) -> float:  # the position-th element of the list without ``index``
        return ordered[position + 1 if position >= index else position]

    middle = count // 2
    return at(middle) if count % 2 else (at(middle - 1) + at(middle)) / 2
