"""What the controller learns from the job's event stream for the people watching it.

Runs in the controller: ``JobMetrics`` (metrics.py) feeds it every event the controller logs, in log
order, and ``/status`` and ``/metrics`` read it. It derives what no single observation says: the
job's pace (steps committed, step time, steps per second), the scalars each rank logged (``ft.log``),
the newest durable checkpoint, the time to recover from each fault (fault detected -> first step
committed after it), and the latest faults and recoveries in words. Pure: no locks, no clock (the
caller passes the wall time; event times are wall times).

The pace is read from one rank, the lowest that reports in the newest generation: the ranks of a
data-parallel job commit in lockstep, and following one keeps the cost per event constant at any
size.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from undying import events as ev
from undying.events import Event, heartbeat_scalars
from undying.incidents import INCIDENT_KINDS, describe_incident
from undying.strategy_names import StrategyName

# Events whose step is the committed step of their rank when it was logged (a checkpoint's event
# names the checkpoint's step, which the background persister reports steps later).
PACE_KINDS = frozenset({ev.HEARTBEAT, ev.FIRST_STEP, ev.WORKER_DONE})
RATE_WINDOW_S = 10.0  # steps per second: over the pace samples of the last this many seconds
RECENT_KEPT = 20  # latest faults and recoveries kept for /status
# Events worth a line among the latest faults and recoveries, and how each reads.
_NOTABLE = frozenset({ev.FAULT_DETECTED, ev.DECISION, ev.RECOVERY_FAILED, ev.ELASTIC_SHRINK, ev.ELASTIC_GROW,
                      ev.CONTROLLER_TAKEOVER, ev.PERSIST_FAILED, ev.CHECKPOINT_CORRUPT, ev.HANG_SUSPECTED,
                      ev.JOB_END, *INCIDENT_KINDS})
STEP_PARTS = ("compute", "comm", "data")  # a heartbeat's step times (runtime/step_timing.py)


@dataclass
class Measured:
    """What one event measured: the metrics module records these, nothing else."""

    steps: int = 0  # steps the job committed since the previous pace sample
    step_seconds: float | None = None  # mean time of those steps (None: not timed, e.g. a new pace rank)
    fault_reason: str | None = None
    recovery_strategy: str | None = None  # a recovery started (a decision other than exit)
    recovery_failed: str | None = None  # the strategy of a recovery that gave up
    recovery_phases: dict[str, float] = field(default_factory=dict)  # one rank's part of a recovery
    mttr_seconds: float | None = None  # fault detected -> first step committed after it
    checkpoint_stall: float | None = None  # seconds the training thread lost to a checkpoint's T1 copy
    persist_seconds: float | None = None  # seconds the T2 write of a checkpoint took in the background
    persist_failed: bool = False
    step_parts: dict[str, float] = field(default_factory=dict)  # one rank's mean compute, comm, data per step
    incident: str | None = None  # straggler, switch_begin, node_check_failed, or bad_step:<action>


@dataclass
class _Pace:
    rank: int
    generation: int
    time: float
    step: int


@dataclass
class _OpenFault:
    time: float
    generation: int | None


class JobView:
    """The job as its events tell it; ``observe`` each event in log order."""

    def __init__(self) -> None:
        self._pace: _Pace | None = None
        self._credited_step = 0  # the job's step the steps counter has counted up to
        self._samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._scalars: dict[int, tuple[int, dict[str, float]]] = {}  # rank -> (generation, newest scalars)
        self._newest_generation = 0
        self._durable: tuple[int, float] | None = None  # (step, wall time committed)
        self._open_fault: _OpenFault | None = None
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_KEPT)

    # ---------------------------------------------------------------- in

    def observe(self, event: Event) -> Measured:
        measured = Measured()
        if event.generation is not None:
            self._newest_generation = max(self._newest_generation, event.generation)
        kind, details = event.kind, event.details
        if kind in PACE_KINDS and event.rank is not None and event.step is not None \
                and event.generation is not None:
            self._pace_sample(event.rank, event.generation, event.time, event.step, measured)
        if kind == ev.HEARTBEAT and event.rank is not None and event.generation is not None:
            self._scalars[event.rank] = (event.generation, heartbeat_scalars(details))
            times = details.get("step_times")
            if isinstance(times, dict):
                measured.step_parts = {part: float(times[part]) for part in STEP_PARTS
                                       if isinstance(times.get(part), int | float)}
        elif kind in INCIDENT_KINDS:
            measured.incident = f"{kind}:{details.get('action')}" if kind == ev.BAD_STEP else kind
        elif kind == ev.CHECKPOINT_LOAD and event.step is not None and event.generation is not None \
                and (self._pace is None or event.generation > self._pace.generation):
            self._credited_step = event.step  # a restart restored this step: steps from here are new work
        elif kind == ev.STEP_FAILED and event.step is not None:
            self._credit(event.step, measured)  # a survivor's committed step, newer than a sampled beat
        elif kind == ev.FAULT_DETECTED:
            if event.step is not None:
                self._credit(event.step, measured)
            measured.fault_reason = str(details.get("reason") or "unknown")
            if self._open_fault is None:
                self._open_fault = _OpenFault(event.time, event.generation)
        elif kind == ev.DECISION and details.get("strategy") not in (None, StrategyName.EXIT):
            measured.recovery_strategy = str(details["strategy"])
        elif kind == ev.RECOVERY_FAILED:
            measured.recovery_failed = str(details.get("strategy") or "unknown")
        elif kind == ev.RECOVERED:
            measured.recovery_phases = {phase: float(details[phase]) for phase in ("wait_for_plan", "rebuild", "repair")
                                        if isinstance(details.get(phase), int | float)}
        elif kind == ev.FIRST_STEP:
            measured.mttr_seconds = self._recovered(event)
        elif kind in (ev.CHECKPOINT_SAVE, ev.DUMP_COMMITTED) and event.step is not None:
            if self._durable is None or event.time >= self._durable[1]:
                self._durable = (event.step, event.time)
            if kind == ev.CHECKPOINT_SAVE:
                measured.checkpoint_stall = _seconds(details.get("stall"))
                measured.persist_seconds = _seconds(details.get("seconds"))
        elif kind == ev.PERSIST_FAILED:
            measured.persist_failed = True
        elif kind == ev.JOB_END:
            self._open_fault = None
        if kind in _NOTABLE:
            self.recent.append(_line(event))
        return measured

    def _pace_sample(self, rank: int, generation: int, time: float, step: int, measured: Measured) -> None:
        pace = self._pace
        if pace is None or generation > pace.generation or (generation == pace.generation and rank < pace.rank):
            # Follow the lowest rank of the newest generation; a different rank is not timed against
            # the previous one's samples.
            self._pace = _Pace(rank, generation, time, step)
            self._samples.clear()
        elif rank != pace.rank or generation != pace.generation:
            return
        elif step > pace.step:
            measured.step_seconds = max(0.0, time - pace.time) / (step - pace.step)
            pace.time, pace.step = time, step
        self._credit(step, measured)
        self._samples.append((time, step))

    def _credit(self, step: int, measured: Measured) -> None:
        """The job has committed ``step``: count the steps up to it not counted yet."""
        if step > self._credited_step:
            measured.steps += step - self._credited_step
            self._credited_step = step

    def _recovered(self, event: Event) -> float | None:
        """The time to recover from the open fault, if ``event`` (a first step) ends it: the first
        step committed in a generation after the fault's."""
        fault = self._open_fault
        if fault is None or event.time < fault.time:
            return None
        if fault.generation is not None and event.generation is not None and event.generation <= fault.generation:
            return None
        self._open_fault = None
        mttr = event.time - fault.time
        self.recent.append({"time": event.time, "kind": "recovered", "generation": event.generation,
                            "step": event.step,
                            "text": f"training again at step {event.step}, {mttr:.2f} s after the fault"})
        return mttr

    # ---------------------------------------------------------------- out

    def steps_per_second(self, now: float) -> float | None:
        """The pace over the last ``RATE_WINDOW_S`` seconds (None: nothing committed yet)."""
        if not self._samples:
            return None
        newest_step = self._samples[-1][1]
        base_time, base_step = next(((t, s) for t, s in self._samples if t >= now - RATE_WINDOW_S),
                                    self._samples[-1])
        elapsed = now - base_time
        if elapsed <= 0:
            return None
        return (newest_step - base_step) / elapsed

    def durable_checkpoint(self, now: float) -> dict[str, Any] | None:
        """The newest checkpoint in storage (T2, or a dying checkpoint) this controller saw committed."""
        if self._durable is None:
            return None
        step, committed = self._durable
        return {"step": step, "age_seconds": round(max(0.0, now - committed), 3)}

    def scalars_by_rank(self) -> dict[int, dict[str, float]]:
        """Each rank's newest logged scalars, for the ranks heard from in the newest generation."""
        return {rank: scalars for rank, (generation, scalars) in self._scalars.items()
                if generation == self._newest_generation and scalars}

    def scalar_stats(self) -> dict[str, tuple[float, float, float]]:
        """Per scalar name: (mean, min, max) over the ranks of the newest generation."""
        by_name: dict[str, list[float]] = {}
        for scalars in self.scalars_by_rank().values():
            for name, value in scalars.items():
                by_name.setdefault(name, []).append(value)
        return {name: (sum(values) / len(values), min(values), max(values)) for name, values in by_name.items()}

    def live(self, now: float) -> dict[str, Any]:
        """What ``/status`` adds to the job machine's view."""
        rate = self.steps_per_second(now)
        return {"steps_per_second": None if rate is None else round(rate, 3),
                "durable_checkpoint": self.durable_checkpoint(now),
                "scalars": {name: {"mean": mean, "min": low, "max": high}
                            for name, (mean, low, high) in sorted(self.scalar_stats().items())},
                "recent": list(self.recent)}


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _line(event: Event) -> dict[str, Any]:
    """One of the latest faults and recoveries, in words."""
    details = event.details
    describers: dict[str, Callable[[], str]] = {
        ev.FAULT_DETECTED: lambda: f"FAULT {details.get('description') or details.get('reason')}",
        ev.DECISION: lambda: f"decision: {details.get('strategy')} ({details.get('reason')})",
        ev.RECOVERY_FAILED: lambda: f"recovery failed ({details.get('strategy')}): {details.get('why')}",
        ev.ELASTIC_SHRINK: lambda: f"elastic shrink: world {details.get('old_world_size')} -> "
                                   f"{details.get('new_world_size')}",
        ev.ELASTIC_GROW: lambda: f"elastic grow: world {details.get('old_world_size')} -> "
                                 f"{details.get('new_world_size')}",
        ev.CONTROLLER_TAKEOVER: lambda: f"controller failover: took over a {details.get('previous_state')} job",
        ev.PERSIST_FAILED: lambda: f"checkpoint of step {event.step} not persisted: {details.get('reason')}",
        ev.CHECKPOINT_CORRUPT: lambda: f"skipped corrupt checkpoint {details.get('path')}",
        ev.HANG_SUSPECTED: lambda: f"hang suspected on rank {event.rank} (not acted on)",
        ev.JOB_END: lambda: f"job {details.get('outcome')}: {details.get('message')}",
    }
    text = describers.get(event.kind, lambda: describe_incident(event.kind, event.step, event.rank, event.node,
                                                                details))()
    return {"time": event.time, "kind": event.kind, "generation": event.generation, "step": event.step,
            "rank": event.rank, "node": event.node, "text": text}
