"""A recovery cut into its phases, from the events logged between its detection and its first step.

Runs wherever a run's events are read (``undying report``, the benchmarks in bench/). The phases
follow each other, each ending at the last event that closes it, so that the slowest rank sets each:

- ``decide``: to the controller's ``decision`` (the strategy chosen);
- ``start processes``: to the last ``worker_ready`` of the processes started for it (absent when
  none was: the survivors recover in place);
- ``wait for plan``: to the ``recovery_plan`` (every rank of the generation checked in);
- ``group rebuild``: to the last rank's groups built (its ``recovered`` event less its repair);
- ``state transfer``: to the last rank's ``recovered`` (the state restored or received);
- ``first step``: to the last rank's first committed step after it.

A job restart: ``restart`` (to its generation's start) and ``restore`` (to the last checkpoint
load), then ``first step``. A phase whose closing event is missing is left out.
"""

from __future__ import annotations

from undying import events as ev
from undying.events import Event

FIRST_STEP = "first step"


def phase_bounds(within: list[Event], start: float, stop: float) -> list[tuple[float, str]]:
    """The phases between ``start`` (the fault's detection) and ``stop`` (the first step after it),
    as (end time, label), in order; ``within``: the events logged between them."""
    if any(e.kind == ev.RESTART_BEGIN for e in within):
        started = [e.time for e in within if e.kind == ev.GENERATION_START]
        restart = max(started) if started else None
        loads = [e.time for e in within if e.kind == ev.CHECKPOINT_LOAD and (restart is None or e.time >= restart)]
        return _ordered([(restart, "restart"), (max(loads, default=None), "restore"), (stop, FIRST_STEP)], start)
    decided = next((e.time for e in within if e.kind == ev.DECISION), None)
    after = decided if decided is not None else start
    ready = [e.time for e in within if e.kind == ev.WORKER_READY and e.time >= after]
    planned = [e.time for e in within if e.kind in (ev.RECOVERY_PLAN, ev.GENERATION_START) and e.time >= after]
    plan = max(planned, default=None)
    recovered = [e for e in within if e.kind == ev.RECOVERED and (plan is None or e.time >= plan)]
    rebuilt = max((e.time - float(e.details.get("repair", 0.0)) for e in recovered), default=None)
    return _ordered([(decided, "decide"), (max(ready, default=None), "start processes"), (plan, "wait for plan"),
                     (rebuilt, "group rebuild"), (max((e.time for e in recovered), default=None), "state transfer"),
                     (stop, FIRST_STEP)], start)


def phase_seconds(within: list[Event], start: float, stop: float) -> dict[str, float]:
    """Label -> seconds of each phase between ``start`` and ``stop`` (``phase_bounds``'s, as durations)."""
    seconds: dict[str, float] = {}
    previous = start
    for time, label in phase_bounds(within, start, stop):
        seconds[label] = time - previous
        previous = time
    return seconds


def _ordered(bounds: list[tuple[float | None, str]], start: float) -> list[tuple[float, str]]:
    """The bounds that exist, each no earlier than the one before."""
    kept: list[tuple[float, str]] = []
    previous = start
    for time, label in bounds:
        if time is not None and time >= previous:
            kept.append((time, label))
            previous = time
    return kept
