"""A run's event log read back into a model: the outcome, the generations, and per fault its recovery.

``summarize`` turns the events of ``RUN_DIR/events.jsonl`` (in log order) into a ``RunSummary``
that the text and the timeline draw from. Runs in the CLI process (``undying report``,
``undying demo``), never in the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from undying.events import (
    CHECKPOINT_CORRUPT,
    CHECKPOINT_LOAD,
    CHECKPOINT_SAVE,
    CONTROLLER_LEADER,
    CRASH_LOOP,
    DECISION,
    ELASTIC_GROW,
    ELASTIC_SHRINK,
    FAULT_DETECTED,
    FIRST_STEP,
    GENERATION_START,
    HEARTBEAT,
    INJECTION,
    JOB_END,
    JOB_START,
    NUMERICS_CHANGED,
    RESTART_BEGIN,
    STEP_FAILED,
    WORKER_DONE,
    WORKER_EXIT,
    Event,
)
from undying.faults import describe_fault
from undying.incidents import INCIDENT_KINDS, describe_incident

# Events whose ``step`` is the committed step of their rank at that time.
PROGRESS_KINDS = (HEARTBEAT, FIRST_STEP, CHECKPOINT_SAVE, CHECKPOINT_LOAD, WORKER_DONE)


@dataclass
class Recovery:
    """One fault and what the job did about it.

    Several ``fault_detected`` events in the same generation (a kill seen both as a
    worker exit and as missed heartbeats) are one fault: the first one is kept.
    Fields are ``None`` where the log does not say (a run cut short, or ended by
    the decision ``exit``). ``description`` is the fault in words, the one
    ``undying.faults.describe_fault`` gives: as the controller logged it, else
    (an older log) rebuilt from the event's fields.
    """

    fault_time: float
    fault_kind: str
    node: int | None
    rank: int | None
    fault_step: int | None
    strategy: str | None
    resumed_from_step: int | None
    first_step_time: float | None
    steps_lost: int | None
    recovery_seconds: float | None
    detect_seconds: float | None
    signal: str | None = None
    exitcode: int | None = None
    description: str = ""


@dataclass
class RunSummary:
    """The run in numbers; every field tolerates a log that stops midway."""

    outcome: str | None
    exit_code: int | None
    message: str | None
    world_size: int | None
    generations: int
    restarts: int  # job-level restarts
    final_step: int | None
    recoveries: list[Recovery] = field(default_factory=list)
    checkpoints_saved: int = 0
    checkpoints_corrupt: int = 0
    duration_seconds: float | None = None
    world_changes: list[str] = field(default_factory=list)  # elastic shrinks and grows, in order
    takeovers: list[str] = field(default_factory=list)  # controller failovers, in order
    numerics_changes: list[str] = field(default_factory=list)  # restores under other numerics, in order
    crash_loop: dict[str, Any] | None = None
    # Stragglers, switches, bad steps, failed health checks, a restart's wait for a commit (incidents.py)
    incidents: list[str] = field(default_factory=list)
    recoveries_total: int = 0  # recoveries of every kind (what max_restarts bounds)  # why a crash loop stopped the job, and its root cause


def summarize(events: list[Event]) -> RunSummary:
    """Reduce a run's events (in log order) to a ``RunSummary``."""
    job_start = first_event(events, JOB_START)
    job_end = last_event(events, JOB_END)
    end_details = job_end.details if job_end else {}

    # Job-level restarts: as the controller counted them at the end, else (a log cut short) as logged.
    restarts = int(end_details["job_restarts"]) if "job_restarts" in end_details else \
        sum(1 for e in events if e.kind == RESTART_BEGIN)
    crash_loop = last_event(events, CRASH_LOOP)

    # A checkpoint written by several ranks is still one checkpoint.
    saved = {(e.generation, e.step) for e in events if e.kind == CHECKPOINT_SAVE}
    corrupt = {e.details.get("path") for e in events if e.kind == CHECKPOINT_CORRUPT}

    duration = None
    if events:
        start_time = job_start.time if job_start else events[0].time
        end_time = job_end.time if job_end else max(e.time for e in events)
        duration = max(0.0, end_time - start_time)

    return RunSummary(
        outcome=end_details.get("outcome"),
        exit_code=end_details.get("exit_code"),
        message=end_details.get("message"),
        world_size=_world_size(events),
        generations=len(generation_start_times(events)),
        restarts=restarts,
        final_step=_final_step(events),
        recoveries=_recoveries(events),
        checkpoints_saved=len(saved),
        checkpoints_corrupt=len(corrupt),
        duration_seconds=duration,
        world_changes=[world_change_label(e) for e in events if e.kind in (ELASTIC_SHRINK, ELASTIC_GROW)],
        takeovers=[takeover_label(e) for e in events if is_takeover(e)],
        numerics_changes=[numerics_change_label(e) for e in events if e.kind == NUMERICS_CHANGED],
        crash_loop=crash_loop.details if crash_loop else None,
        incidents=[describe_incident(e.kind, e.step, e.rank, e.node, e.details) for e in events
                   if e.kind in INCIDENT_KINDS],
        # A log cut short (or written before job_end counted them): every decision to recover.
        recoveries_total=int(end_details["recoveries"]) if "recoveries" in end_details else
        sum(1 for e in events if e.kind == DECISION and e.details.get("strategy") != "exit"),
    )


def is_takeover(event: Event) -> bool:
    """A ``controller_leader`` event of a controller that took over a running job (not the first election)."""
    return event.kind == CONTROLLER_LEADER and bool(event.details.get("resumed"))


def takeover_label(event: Event) -> str:
    return f"controller failover: node {event.node} took over"


def numerics_change_label(event: Event) -> str:
    """``step 40 restored under other numerics (device: A -> B)``: each differing key, recorded -> current."""
    recorded, current = event.details.get("recorded") or {}, event.details.get("current") or {}

    def value(record: object, dotted: str) -> object:
        for part in dotted.split("."):
            record = record.get(part) if isinstance(record, dict) else None
        return record

    changes = [f"{key}: {value(recorded, key)} -> {value(current, key)}" for key in event.details.get("differs", [])]
    return f"step {event.step} restored under other numerics ({'; '.join(changes)})"


def world_change_label(event: Event) -> str:
    kind = "shrink" if event.kind == ELASTIC_SHRINK else "grow"
    text = f"{kind} {event.details.get('old_world_size')} -> {event.details.get('new_world_size')}"
    return text + (f" at step {event.step}" if event.step is not None else "")


def first_event(events: list[Event], kind: str) -> Event | None:
    return next((e for e in events if e.kind == kind), None)


def last_event(events: list[Event], kind: str) -> Event | None:
    return next((e for e in reversed(events) if e.kind == kind), None)


def with_generations(events: list[Event]) -> list[tuple[Event, int | None]]:
    """Each event with its generation: its own, else the latest one started before it."""
    current: int | None = None
    tagged = []
    for event in events:
        if event.kind == GENERATION_START and event.generation is not None:
            current = event.generation
        tagged.append((event, event.generation if event.generation is not None else current))
    return tagged


def generation_start_times(events: list[Event]) -> dict[int, float]:
    """When each generation began: its ``generation_start``, else its first event."""
    starts: dict[int, float] = {}
    for event in events:
        if event.kind == GENERATION_START and event.generation is not None:
            starts.setdefault(event.generation, event.time)
    for event in events:
        if event.generation is not None and event.generation not in starts:
            starts[event.generation] = event.time
    return dict(sorted(starts.items()))


def _world_size(events: list[Event]) -> int | None:
    for kind in (JOB_START, GENERATION_START):
        for event in events:
            if event.kind == kind and event.details.get("world_size") is not None:
                return int(event.details["world_size"])
    ranks = {e.rank for e in events if e.rank is not None}
    return len(ranks) or None


def _final_step(events: list[Event]) -> int | None:
    """The highest committed step reached in the last generation that made progress."""
    progress = [
        (e.step, g) for e, g in with_generations(events) if e.kind in PROGRESS_KINDS and e.step is not None
    ]
    if not progress:
        return None
    last_generation = progress[-1][1]
    return max(step for step, generation in progress if generation == last_generation)


def _recoveries(events: list[Event]) -> list[Recovery]:
    tagged = with_generations(events)
    fault_indices: list[int] = []
    seen_generations: set[int] = set()
    for index, (event, generation) in enumerate(tagged):
        if event.kind != FAULT_DETECTED:
            continue
        if generation is not None:
            if generation in seen_generations:
                continue
            seen_generations.add(generation)
        fault_indices.append(index)

    recoveries = []
    for position, fault_index in enumerate(fault_indices):
        previous_index = fault_indices[position - 1] if position else -1
        next_index = fault_indices[position + 1] if position + 1 < len(fault_indices) else len(events)
        recoveries.append(
            _recovery(
                fault=events[fault_index],
                fault_generation=tagged[fault_index][1],
                before=events[previous_index + 1 : fault_index],
                after=tagged[fault_index + 1 : next_index],
            )
        )
    return recoveries


def _recovery(
    fault: Event,
    fault_generation: int | None,
    before: list[Event],
    after: list[tuple[Event, int | None]],
) -> Recovery:
    """One recovery from its fault, the events since the previous fault, and those up to the next."""
    details = fault.details
    signal, exitcode = details.get("signal"), details.get("exitcode")
    if signal is None and exitcode is None and fault.rank is not None:
        exit_event = next(
            (e for e in reversed(before) if e.kind == WORKER_EXIT and e.rank == fault.rank), None
        )
        if exit_event is not None:
            signal, exitcode = exit_event.details.get("signal"), exit_event.details.get("exitcode")

    decision = next((e for e, _ in after if e.kind == DECISION), None)
    strategy = decision.details.get("strategy") if decision else None

    later = [(e, g) for e, g in after if fault_generation is None or (g is not None and g > fault_generation)]
    first_step = next((e for e, _ in later if e.kind == FIRST_STEP), None)
    load = next((e for e, _ in later if e.kind == CHECKPOINT_LOAD and e.step is not None), None)
    resumed_from: int | None = None
    first_step_time: float | None = None
    if first_step is not None:
        resumed_from = first_step.details.get("resumed_from")
        if resumed_from is None:
            resumed_from = load.step if load else None
        first_step_time = first_step.time
    elif any(e.kind == GENERATION_START for e, _ in later):
        # No checkpoint to resume from: the new generation starts at its loaded step
        # (or 0); heartbeats are sampled, so this time may be late by one interval.
        start_step = load.step if load is not None and load.step is not None else 0
        resumed_from = start_step
        moved = next(
            (e for e, _ in later if e.kind == HEARTBEAT and e.step is not None and e.step > start_step),
            None,
        )
        first_step_time = moved.time if moved else None

    fault_step = _fault_step(fault, fault_generation, before, after)
    steps_lost = None
    if fault_step is not None and resumed_from is not None:
        steps_lost = max(0, fault_step - resumed_from)

    reason = str(details.get("reason") or "unknown")
    return Recovery(
        fault_time=fault.time,
        fault_kind=reason,
        node=fault.node,
        rank=fault.rank,
        fault_step=fault_step,
        strategy=strategy,
        resumed_from_step=resumed_from,
        first_step_time=first_step_time,
        steps_lost=steps_lost,
        recovery_seconds=None if first_step_time is None else first_step_time - fault.time,
        detect_seconds=_detect_seconds(fault, before),
        signal=signal,
        exitcode=exitcode,
        description=details.get("description")
        or describe_fault(reason, fault.rank, fault.node, exitcode, signal, details.get("detail") or ""),
    )


def _fault_step(fault: Event, fault_generation: int | None, before: list[Event],
                after: list[tuple[Event, int | None]]) -> int | None:
    """The step the job had reached when the fault struck: the fault's own, or a later one that a
    survivor reported committed when its step failed in the fault's generation (a fault's step may
    come from a sampled heartbeat, steps behind)."""
    nearby = [*before, *(event for event, _ in after)]
    reported = [e.step for e in nearby
                if e.kind == STEP_FAILED and e.step is not None and e.generation == fault_generation]
    steps = [step for step in (fault.step, *reported) if step is not None]
    return max(steps) if steps else None


def _detect_seconds(fault: Event, before: list[Event]) -> float | None:
    """Seconds from the injection that caused ``fault`` (same rank, else same node, else latest)."""
    injections = [e for e in before if e.kind == INJECTION and e.time <= fault.time]
    if not injections:
        return None
    matching = [e for e in injections if fault.rank is not None and e.rank == fault.rank]
    matching = matching or [e for e in injections if fault.node is not None and e.node == fault.node]
    cause = (matching or injections)[-1]
    return fault.time - cause.time
