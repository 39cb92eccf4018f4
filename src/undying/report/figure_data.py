"""What the PNG report draws, computed from a run's events: plain data the tests check directly.

Runs in the CLI process (``undying report``, ``undying demo``), never in the job. ``figure_data``
turns the events into: each rank's committed step over time as monotone segments (a new segment
where a restart rolled the step back), the lanes they are drawn in (one per rank up to 16 ranks,
else grouped by node), the start-up phases, each recovery with its phases and its time to recover
(MTTR: fault detected -> first step committed after it), the elastic resizes and controller
failovers, the mean logged loss and the job's step rate. Times are seconds since the job started.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from undying import events as ev
from undying.events import Event, heartbeat_scalars
from undying.protocol import Phase
from undying.report.recovery_phases import phase_bounds
from undying.report.summary import (
    RunSummary,
    first_event,
    is_takeover,
    summarize,
    takeover_label,
    world_change_label,
)

MAX_LANES = 16  # more ranks than this: a lane per node (or per few nodes), never more lanes
# A rank's committed step when the event was logged (checkpoint_save names the checkpoint's step, which
# the background persister reports steps later: not the rank's step then).
STEP_KINDS = frozenset({ev.HEARTBEAT, ev.FIRST_STEP, ev.WORKER_DONE, ev.CHECKPOINT_LOAD})
LOSS_POINTS = 240  # the loss panel averages the ranks' samples into at most this many time bins
LOSS_GAP_S = 2.0  # no loss sampled for longer than this (a restart; samples come every 0.5 s): a break in the line


@dataclass(frozen=True)
class Span:
    """A stretch of time, labelled: a start-up phase, or one phase of a recovery."""

    start: float
    stop: float
    label: str

    @property
    def seconds(self) -> float:
        return self.stop - self.start


@dataclass(frozen=True)
class RecoverySpan:
    """One fault until the first step committed after it, cut into the phases the log shows."""

    number: int  # 1, 2, ... in the order of the faults
    start: float  # the fault detected
    stop: float | None  # the first step committed after it (None: not training again before the log ends)
    description: str  # the fault in words, its step, the strategy
    phases: list[Span] = field(default_factory=list)  # fault detected -> first step, in order
    detect: Span | None = None  # an injected fault: from the injection until it was detected

    @property
    def mttr(self) -> float | None:
        return None if self.stop is None else self.stop - self.start


@dataclass(frozen=True)
class Marker:
    """A moment across every lane: an elastic shrink or grow, a controller failover, an incident
    (a straggler, a switch, a bad step, a failed health check: incidents.py)."""

    time: float
    kind: str  # "elastic", "failover" or "incident"
    label: str


@dataclass(frozen=True)
class Lane:
    label: str
    ranks: list[int]


@dataclass
class FigureData:
    title: str
    duration: float
    max_step: int
    lanes: list[Lane]
    steps: dict[int, list[list[tuple[float, int]]]]  # rank -> monotone segments of (time, step)
    startup: list[Span]
    recoveries: list[RecoverySpan]
    markers: list[Marker]
    incidents: list[str]  # the report's lines for them (summary.incidents)
    loss: list[tuple[float, float]]  # (time, mean loss over the ranks sampled then)
    step_rate: list[tuple[float, float]]  # (time, steps per second), NaN between segments


# An incident's marker reads this (the report's text and the notes beneath the panels say the whole line).
INCIDENT_LABELS: dict[str, str] = {ev.STRAGGLER: "straggler", ev.SWITCH_BEGIN: "switch", ev.BAD_STEP: "bad step",
                   ev.NODE_CHECK_FAILED: "check failed", ev.COMMIT_DRAIN: "commit kept"}


def figure_data(events: list[Event]) -> FigureData:
    summary = summarize(events)
    start = first_event(events, ev.JOB_START)
    origin = start.time if start is not None else (events[0].time if events else 0.0)

    def at(event: Event) -> float:
        return event.time - origin

    steps = rank_segments(events, origin)
    nodes = _rank_nodes(events)
    max_step = max((step for segments in steps.values() for segment in segments for _, step in segment), default=0)
    duration = max((at(e) for e in events), default=0.0)
    markers = [Marker(at(e), "elastic", world_change_label(e)) for e in events
               if e.kind in (ev.ELASTIC_SHRINK, ev.ELASTIC_GROW)]
    markers += [Marker(at(e), "failover", takeover_label(e)) for e in events if is_takeover(e)]
    markers += [Marker(at(e), "incident", INCIDENT_LABELS[e.kind]) for e in events if e.kind in INCIDENT_LABELS]
    return FigureData(
        title=_title(summary), duration=max(duration, 1e-3), max_step=max_step,
        lanes=lanes_for(sorted(set(steps) | set(nodes)), nodes), steps=steps,
        startup=startup_phases(events, origin), recoveries=recovery_spans(events, summary, origin),
        markers=sorted(markers, key=lambda m: m.time), incidents=summary.incidents,
        loss=mean_loss(events, origin, duration),
        step_rate=step_rate(steps))


def rank_segments(events: list[Event], origin: float) -> dict[int, list[list[tuple[float, int]]]]:
    """Each rank's committed step over time, cut where it goes back (a restart from a checkpoint):
    every segment rises monotonically in time and step."""
    points: dict[int, list[tuple[float, int]]] = {}
    for event in events:
        if event.kind in STEP_KINDS and event.rank is not None and event.step is not None \
                and event.details.get("phase") != Phase.STARTING:  # a process not restored yet holds no step
            points.setdefault(event.rank, []).append((event.time - origin, event.step))
    segments: dict[int, list[list[tuple[float, int]]]] = {}
    for rank, rank_points in points.items():
        rank_points.sort()
        runs: list[list[tuple[float, int]]] = [[rank_points[0]]]
        for time, step in rank_points[1:]:
            if step < runs[-1][-1][1]:
                runs.append([(time, step)])
            else:
                runs[-1].append((time, step))
        segments[rank] = runs
    return segments


def lanes_for(ranks: list[int], nodes: dict[int, int]) -> list[Lane]:
    """One lane per rank up to ``MAX_LANES`` ranks; else one per node, or per run of nodes."""
    if len(ranks) <= MAX_LANES:
        return [Lane(f"rank {rank}" + (f"\nnode {nodes[rank]}" if rank in nodes else ""), [rank]) for rank in ranks]
    by_node: dict[int, list[int]] = {}
    for rank in ranks:
        by_node.setdefault(nodes.get(rank, -1), []).append(rank)
    node_ids = sorted(by_node)
    per_lane = math.ceil(len(node_ids) / MAX_LANES)
    lanes = []
    for index in range(0, len(node_ids), per_lane):
        group = node_ids[index:index + per_lane]
        lane_ranks = sorted(rank for node in group for rank in by_node[node])
        which = f"node {group[0]}" if len(group) == 1 else f"nodes {group[0]}-{group[-1]}"
        lanes.append(Lane(f"{which}\nranks {lane_ranks[0]}-{lane_ranks[-1]}", lane_ranks))
    return lanes


def startup_phases(events: list[Event], origin: float) -> list[Span]:
    """From the job's start to its first committed step: agents join, workers start, (restore), first step."""
    generation_start = first_event(events, ev.GENERATION_START)
    if generation_start is None:
        return []
    first_generation = generation_start.generation
    ready = [e.time for e in events if e.kind == ev.WORKER_READY and e.generation == first_generation]
    loads = [e.time for e in events if e.kind == ev.CHECKPOINT_LOAD and e.generation == first_generation]
    restored = min((e.step or 0 for e in events if e.kind == ev.CHECKPOINT_LOAD and e.generation == first_generation),
                   default=0)
    committed = next((e.time for e in events if e.kind in (ev.HEARTBEAT, ev.FIRST_STEP, ev.WORKER_DONE)
                      and e.generation == first_generation and (e.step or 0) > restored), None)
    bounds: list[tuple[float, str]] = [(generation_start.time, "agents join")]
    if ready:
        bounds.append((max(ready), "workers start"))
    if loads:
        bounds.append((max(loads), "restore"))
    if committed is not None:
        bounds.append((committed, "first step"))
    spans, previous = [], origin
    for time, label in bounds:
        if time >= previous:
            spans.append(Span(previous - origin, time - origin, label))
            previous = time
    return spans


def recovery_spans(events: list[Event], summary: RunSummary, origin: float) -> list[RecoverySpan]:
    """Each fault of the summary, from its detection to the first step after it, in phases
    (report/recovery_phases.py)."""
    spans = []
    for number, recovery in enumerate(summary.recoveries, start=1):
        start, stop = recovery.fault_time, recovery.first_step_time
        within = [e for e in events if start <= e.time <= (stop if stop is not None else math.inf)]
        phases: list[Span] = []
        if stop is not None:
            previous = start
            for time, label in phase_bounds(within, start, stop):
                phases.append(Span(previous - origin, time - origin, label))
                previous = time
        description = recovery.description
        if recovery.fault_step is not None:
            description += f" at step {recovery.fault_step}"
        description += f" -> {recovery.strategy or 'no decision logged'}"
        detect = None
        if recovery.detect_seconds is not None:
            detect = Span(start - origin - recovery.detect_seconds, start - origin, "detect")
        spans.append(RecoverySpan(number, start - origin, None if stop is None else stop - origin, description,
                                  phases, detect))
    return spans


def mean_loss(events: list[Event], origin: float, duration: float) -> list[tuple[float, float]]:
    """The ranks' logged loss (``ft.log(loss=...)``), averaged into time bins."""
    width = max(duration, 1e-3) / LOSS_POINTS
    bins: dict[int, list[float]] = {}
    for event in events:
        if event.kind != ev.HEARTBEAT:
            continue
        loss = heartbeat_scalars(event.details).get("loss")
        if loss is not None and math.isfinite(loss):
            bins.setdefault(int((event.time - origin) / width), []).append(loss)
    points: list[tuple[float, float]] = []
    previous: int | None = None
    for index, values in sorted(bins.items()):
        if previous is not None and (index - previous) * width > LOSS_GAP_S:
            points.append(((previous + 1) * width, math.nan))  # no loss logged for a while: break the line
        points.append(((index + 0.5) * width, sum(values) / len(values)))
        previous = index
    return points


def step_rate(steps: dict[int, list[list[tuple[float, int]]]]) -> list[tuple[float, float]]:
    """Steps per second between consecutive samples, flat over each interval, NaN where a line
    breaks. Read from the lowest rank that covers each stretch of time (the ranks of a data-parallel
    job commit in lockstep: one rank's pace is the job's; a higher rank fills in where the lower
    ones were gone, e.g. dropped by an elastic shrink)."""
    covered: list[tuple[float, float]] = []
    rates: list[tuple[float, float]] = []
    for rank in sorted(steps):
        mine = []
        for segment in steps[rank]:
            drawn = False
            for (t0, s0), (t1, s1) in zip(segment, segment[1:], strict=False):
                if t1 > t0 and not any(t0 < end and start < t1 for start, end in covered):
                    rate = (s1 - s0) / (t1 - t0)
                    rates += [(t0, rate), (t1, rate)]
                    drawn = True
            if drawn:
                rates.append((segment[-1][0], math.nan))
            mine.append((segment[0][0], segment[-1][0]))
        covered.extend(mine)
    return sorted(rates, key=lambda point: (point[0], math.isnan(point[1])))


def _rank_nodes(events: list[Event]) -> dict[int, int]:
    """The node each rank first ran on."""
    nodes: dict[int, int] = {}
    for event in events:
        if event.rank is not None and event.node is not None:
            nodes.setdefault(event.rank, event.node)
    return nodes


def _title(summary: RunSummary) -> str:
    outcome = summary.outcome or "unfinished (no job_end)"
    world = "?" if summary.world_size is None else str(summary.world_size)
    faults = len(summary.recoveries)
    return (f"undying run: {outcome}, {world} ranks, {summary.final_step if summary.final_step is not None else '?'}"
            f" steps, {faults} fault{'s' if faults != 1 else ''}, {summary.generations} generations")
