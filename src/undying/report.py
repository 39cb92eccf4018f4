"""What happened in a run, read back from its event log (``RUN_DIR/events.jsonl``).

Turns the events into a ``RunSummary`` (outcome, restarts, and per fault: steps lost
and time until training resumed) and into a hand-written SVG timeline with one lane
per rank. Runs in the CLI process (``undying report``, ``undying demo``), never in the job.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from undying.events import (
    CHECKPOINT_CORRUPT,
    CHECKPOINT_LOAD,
    CHECKPOINT_SAVE,
    CONTROLLER_LEADER,
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
    RESTART_BEGIN,
    WORKER_DONE,
    WORKER_EXIT,
    WORKER_STARTED,
    Event,
    read_events,
)

TIMELINE_FILE = "timeline.svg"

# Events whose ``step`` is the committed step of their rank at that time.
_PROGRESS_KINDS = (HEARTBEAT, FIRST_STEP, CHECKPOINT_SAVE, CHECKPOINT_LOAD, WORKER_DONE)


@dataclass
class Recovery:
    """One fault and what the job did about it.

    Several ``fault_detected`` events in the same generation (a kill seen both as a
    worker exit and as missed heartbeats) are one fault: the first one is kept.
    Fields are ``None`` where the log does not say (a run cut short, or ended by
    the decision ``exit``).
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


@dataclass
class RunSummary:
    """The run in numbers; every field tolerates a log that stops midway."""

    outcome: str | None
    exit_code: int | None
    message: str | None
    world_size: int | None
    generations: int
    restarts: int
    final_step: int | None
    recoveries: list[Recovery] = field(default_factory=list)
    checkpoints_saved: int = 0
    checkpoints_corrupt: int = 0
    duration_seconds: float | None = None
    world_changes: list[str] = field(default_factory=list)  # elastic shrinks and grows, in order
    takeovers: list[str] = field(default_factory=list)  # controller failovers, in order


# ----------------------------------------------------------------------------- summary


def summarize(events: list[Event]) -> RunSummary:
    """Reduce a run's events (in log order) to a ``RunSummary``."""
    job_start = _first(events, JOB_START)
    job_end = _last(events, JOB_END)
    end_details = job_end.details if job_end else {}

    generation_starts = [e for e in events if e.kind == GENERATION_START]
    restart_counts = [int(e.details.get("restart_count") or 0) for e in generation_starts]
    restarts = max([sum(1 for e in events if e.kind == RESTART_BEGIN), *restart_counts])

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
        generations=len(_generation_start_times(events)),
        restarts=restarts,
        final_step=_final_step(events),
        recoveries=_recoveries(events),
        checkpoints_saved=len(saved),
        checkpoints_corrupt=len(corrupt),
        duration_seconds=duration,
        world_changes=[_world_change_label(e) for e in events if e.kind in (ELASTIC_SHRINK, ELASTIC_GROW)],
        takeovers=[_takeover_label(e) for e in events if _is_takeover(e)],
    )


def _is_takeover(event: Event) -> bool:
    return event.kind == CONTROLLER_LEADER and bool(event.details.get("resumed"))


def _takeover_label(event: Event) -> str:
    return f"controller failover: node {event.node} took over"


def _world_change_label(event: Event) -> str:
    kind = "shrink" if event.kind == ELASTIC_SHRINK else "grow"
    text = f"{kind} {event.details.get('old_world_size')} -> {event.details.get('new_world_size')}"
    return text + (f" at step {event.step}" if event.step is not None else "")


def _first(events: list[Event], kind: str) -> Event | None:
    return next((e for e in events if e.kind == kind), None)


def _last(events: list[Event], kind: str) -> Event | None:
    return next((e for e in reversed(events) if e.kind == kind), None)


def _world_size(events: list[Event]) -> int | None:
    for kind in (JOB_START, GENERATION_START):
        for event in events:
            if event.kind == kind and event.details.get("world_size") is not None:
                return int(event.details["world_size"])
    ranks = {e.rank for e in events if e.rank is not None}
    return len(ranks) or None


def _with_generations(events: list[Event]) -> list[tuple[Event, int | None]]:
    """Each event with its generation: its own, else the latest one started before it."""
    current: int | None = None
    tagged = []
    for event in events:
        if event.kind == GENERATION_START and event.generation is not None:
            current = event.generation
        tagged.append((event, event.generation if event.generation is not None else current))
    return tagged


def _generation_start_times(events: list[Event]) -> dict[int, float]:
    """When each generation began: its ``generation_start``, else its first event."""
    starts: dict[int, float] = {}
    for event in events:
        if event.kind == GENERATION_START and event.generation is not None:
            starts.setdefault(event.generation, event.time)
    for event in events:
        if event.generation is not None and event.generation not in starts:
            starts[event.generation] = event.time
    return dict(sorted(starts.items()))


def _final_step(events: list[Event]) -> int | None:
    """The highest committed step reached in the last generation that made progress."""
    progress = [
        (e.step, g) for e, g in _with_generations(events) if e.kind in _PROGRESS_KINDS and e.step is not None
    ]
    if not progress:
        return None
    last_generation = progress[-1][1]
    return max(step for step, generation in progress if generation == last_generation)


def _recoveries(events: list[Event]) -> list[Recovery]:
    tagged = _with_generations(events)
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

    steps_lost = None
    if fault.step is not None and resumed_from is not None:
        steps_lost = max(0, fault.step - resumed_from)

    return Recovery(
        fault_time=fault.time,
        fault_kind=str(details.get("reason") or "unknown"),
        node=fault.node,
        rank=fault.rank,
        fault_step=fault.step,
        strategy=strategy,
        resumed_from_step=resumed_from,
        first_step_time=first_step_time,
        steps_lost=steps_lost,
        recovery_seconds=None if first_step_time is None else first_step_time - fault.time,
        detect_seconds=_detect_seconds(fault, before),
        signal=signal,
        exitcode=exitcode,
    )


def _detect_seconds(fault: Event, before: list[Event]) -> float | None:
    """Seconds from the injection that caused ``fault`` (same rank, else same node, else latest)."""
    injections = [e for e in before if e.kind == INJECTION and e.time <= fault.time]
    if not injections:
        return None
    matching = [e for e in injections if fault.rank is not None and e.rank == fault.rank]
    matching = matching or [e for e in injections if fault.node is not None and e.node == fault.node]
    cause = (matching or injections)[-1]
    return fault.time - cause.time


# ----------------------------------------------------------------------------- text


def render_summary(summary: RunSummary) -> str:
    """Plain multi-line text for a terminal: outcome, size, steps, then one line per recovery."""
    if summary.outcome is None:
        outcome = "unknown (no job_end: the log stops before the job ended)"
    else:
        outcome = summary.outcome
        if summary.exit_code is not None:
            outcome += f" (exit code {summary.exit_code})"
    lines = [f"outcome: {outcome}"]
    if summary.message:
        lines.append(f"message: {summary.message}")
    world = "unknown" if summary.world_size is None else f"{summary.world_size} ranks"
    lines.append(f"world size: {world}")
    final_step = "none committed" if summary.final_step is None else f"{summary.final_step} committed"
    lines.append(
        f"steps: {final_step}; {_plural(summary.generations, 'generation')}, {_plural(summary.restarts, 'restart')}"
    )
    lines.append(f"checkpoints: {summary.checkpoints_saved} saved, {summary.checkpoints_corrupt} corrupt")
    if summary.duration_seconds is not None:
        lines.append(f"duration: {summary.duration_seconds:.1f} s")
    lines.append(f"faults: {len(summary.recoveries)}")
    lines.extend("  " + describe_recovery(recovery) for recovery in summary.recoveries)
    if summary.world_changes:
        lines.append("elastic: " + ", ".join(summary.world_changes))
    if summary.takeovers:
        lines.append("controller: " + ", ".join(label.removeprefix("controller ") for label in summary.takeovers))
    return "\n".join(lines)


def describe_recovery(recovery: Recovery) -> str:
    """One line: what failed, what was decided, where training resumed and how soon."""
    text = f"fault: {_describe_fault(recovery)}"
    if recovery.fault_step is not None:
        text += f" at step {recovery.fault_step}"
    text += f" -> decision: {recovery.strategy or 'none logged'}"
    if recovery.resumed_from_step is not None:
        text += f" -> resumed from step {recovery.resumed_from_step}"
        if recovery.steps_lost is not None:
            text += f" ({_plural(recovery.steps_lost, 'step')} lost)"
        if recovery.recovery_seconds is not None:
            text += f", training again {recovery.recovery_seconds:.1f} s after the fault"
        else:
            text += ", not training again before the log ends"
    elif recovery.strategy not in (None, "exit"):
        text += " -> not resumed before the log ends"
    if recovery.detect_seconds is not None:
        text += f" (detected {recovery.detect_seconds:.1f} s after the injection)"
    return text


def _describe_fault(recovery: Recovery) -> str:
    where = []
    if recovery.rank is not None:
        where.append(f"rank {recovery.rank}")
    if recovery.node is not None:
        where.append(f"(node {recovery.node})" if where else f"node {recovery.node}")
    place = " ".join(where) or "unknown place"
    if recovery.fault_kind == "worker_exit":
        if recovery.signal:
            return f"{recovery.signal} of {place}"
        if recovery.exitcode is not None:
            return f"exit code {recovery.exitcode} of {place}"
        return f"exit of {place}"
    if recovery.fault_kind == "agent_lost":
        return f"agent lost on {place}"
    if recovery.fault_kind == "heartbeat_missed":
        return f"missed heartbeats from {place}"
    if recovery.fault_kind == "start_timeout":
        return f"start timeout of {place}"
    return f"{recovery.fault_kind} at {place}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


# ----------------------------------------------------------------------------- SVG

_WIDTH = 1200
_LEFT = 150  # rank labels
_RIGHT = 40
_TOP = 96  # title, legend, fault/injection labels
_LANE = 80
_LANE_GAP = 8
_BOTTOM = 40  # time axis
_FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
_BAND_COLORS = ("#e8f0fb", "#e9f6ea", "#fbf1e1", "#f1e8f8")
_STEP_COLOR = "#333333"
_FAULT_COLOR = "#d62728"
_INJECTION_COLOR = "#ff7f0e"
_CHECKPOINT_COLOR = "#1f5fbf"
_FIRST_STEP_COLOR = "#2ca02c"
_ELASTIC_COLOR = "#7b3fbf"
_FAILOVER_COLOR = "#b8860b"


class _Svg:
    """Collects SVG elements; every number is rounded so the file stays small."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, tag: str, text: str | None = None, **attributes: object) -> None:
        rendered = " ".join(
            f"{name.rstrip('_').replace('_', '-')}={quoteattr(_fmt(value))}"
            for name, value in attributes.items()
            if value is not None
        )
        if text is None:
            self.parts.append(f"<{tag} {rendered}/>")
        else:
            self.parts.append(f"<{tag} {rendered}>{escape(text)}</{tag}>")

    def text(self, x: float, y: float, content: str, size: int = 12, **attributes: object) -> None:
        self.add("text", content, x=x, y=y, font_size=size, **attributes)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.1f}".rstrip("0").rstrip(".")
    return str(value)


def render_timeline_svg(events: list[Event]) -> str:
    """A standalone SVG of the run: one lane per rank, committed step over time.

    x is seconds since ``job_start``; each lane shows its rank's committed step
    (one line per generation, on a scale shared by all lanes), generation bands,
    checkpoint saves (blue ticks) and first steps after a resume (green dots);
    faults (red) and injections (orange) are vertical lines across all lanes.
    """
    summary = summarize(events)
    ranks = _lane_ranks(events, summary.world_size)
    height = _TOP + max(1, len(ranks)) * (_LANE + _LANE_GAP) + _BOTTOM
    svg = _Svg()
    svg.add("rect", x=0, y=0, width=_WIDTH, height=height, fill="white")
    svg.text(_LEFT, 24, _title(summary), size=16, font_weight="bold")
    if not events:
        svg.text(_LEFT, _TOP, "no events", size=14, fill="#777777")
        return _document(svg, height)

    job_start = _first(events, JOB_START)
    origin = job_start.time if job_start else events[0].time
    end = max(e.time for e in events)
    span = max(end - origin, 1.0)
    plot_width = _WIDTH - _LEFT - _RIGHT
    plot_top, plot_bottom = _TOP, _TOP + len(ranks) * (_LANE + _LANE_GAP)

    def x_of(time: float) -> float:
        return _LEFT + (time - origin) / span * plot_width

    _legend(svg)
    _axis(svg, span, x_of, origin, plot_top, plot_bottom)

    tagged = _with_generations(events)
    max_step = max([e.step for e, _ in tagged if e.kind in _PROGRESS_KINDS and e.step is not None] or [0])
    max_step = max(max_step, 1)
    bands = _generation_bands(events, end)
    nodes = _rank_nodes(events)

    for lane, rank in enumerate(ranks):
        lane_top = plot_top + lane * (_LANE + _LANE_GAP)
        lane_bottom = lane_top + _LANE

        def y_of(step: float, lane_top: float = lane_top) -> float:
            return lane_top + _LANE - 6 - step / max_step * (_LANE - 18)

        svg.add(
            "rect",
            class_="lane",
            x=_LEFT,
            y=lane_top,
            width=plot_width,
            height=_LANE,
            fill="#fafafa",
            stroke="#dddddd",
        )
        for index, (generation, start, stop) in enumerate(bands):
            left, right = x_of(start), x_of(stop)
            svg.add(
                "rect",
                x=left,
                y=lane_top,
                width=max(right - left, 1.0),
                height=_LANE,
                fill=_BAND_COLORS[index % len(_BAND_COLORS)],
            )
            if lane == 0 or right - left > 40:
                svg.text(left + 3, lane_top + 11, f"gen {generation}", size=9, fill="#888888")
            next_start = x_of(bands[index + 1][1]) if index + 1 < len(bands) else right
            if next_start - right > 40:
                svg.text(
                    (right + next_start) / 2,
                    lane_top + 11,
                    "restart",
                    size=9,
                    fill="#888888",
                    text_anchor="middle",
                )
        node_label = "/".join(str(n) for n in nodes.get(rank, [])) or "?"
        svg.text(
            10,
            lane_top + _LANE / 2,
            f"rank {rank} / node {node_label}",
            size=13,
            font_weight="bold",
            class_="lane-label",
        )
        svg.text(10, lane_top + _LANE / 2 + 16, f"step 0-{max_step}", size=10, fill="#777777")

        lines: dict[int | None, list[tuple[float, float]]] = {}
        for event, event_generation in tagged:
            if event.rank == rank and event.kind in _PROGRESS_KINDS and event.step is not None:
                lines.setdefault(event_generation, []).append((x_of(event.time), y_of(event.step)))
        for points in lines.values():
            if len(points) == 1:
                svg.add("circle", cx=points[0][0], cy=points[0][1], r=1.5, fill=_STEP_COLOR)
            else:
                svg.add(
                    "polyline",
                    class_="steps",
                    points=" ".join(f"{_fmt(x)},{_fmt(y)}" for x, y in points),
                    fill="none",
                    stroke=_STEP_COLOR,
                    stroke_width=1.6,
                )
        for event in events:
            if event.rank != rank and event.rank is not None:
                continue
            x = x_of(event.time)
            if event.kind == CHECKPOINT_SAVE:
                svg.add(
                    "line",
                    class_="checkpoint",
                    x1=x,
                    y1=lane_bottom - 12,
                    x2=x,
                    y2=lane_bottom,
                    stroke=_CHECKPOINT_COLOR,
                    stroke_width=2,
                )
            elif event.kind == FIRST_STEP and event.step is not None and event.rank == rank:
                svg.add(
                    "circle",
                    class_="first-step",
                    cx=x,
                    cy=y_of(event.step),
                    r=4.5,
                    fill=_FIRST_STEP_COLOR,
                    stroke="white",
                )
            elif event.kind == FAULT_DETECTED and event.rank == rank and event.step is not None:
                svg.add(
                    "circle",
                    class_="fault",
                    cx=x,
                    cy=y_of(event.step),
                    r=4.5,
                    fill="none",
                    stroke=_FAULT_COLOR,
                    stroke_width=2,
                )

    _vertical_markers(svg, events, x_of, plot_top, plot_bottom)
    return _document(svg, height)


def _document(svg: _Svg, height: int) -> str:
    body = "\n".join(svg.parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        f'viewBox="0 0 {_WIDTH} {height}" font-family="{_FONT}">\n{body}\n</svg>\n'
    )


def _title(summary: RunSummary) -> str:
    outcome = summary.outcome or "unfinished (no job_end)"
    if summary.exit_code is not None:
        outcome += f" (exit {summary.exit_code})"
    world = "?" if summary.world_size is None else str(summary.world_size)
    return (
        f"undying run: {outcome}; {world} ranks, {_plural(summary.generations, 'generation')}, "
        f"{_plural(summary.restarts, 'restart')}, {_plural(len(summary.recoveries), 'fault')}"
    )


def _lane_ranks(events: list[Event], world_size: int | None) -> list[int]:
    ranks = {e.rank for e in events if e.rank is not None}
    ranks.update(range(world_size or 0))
    return sorted(ranks)


def _rank_nodes(events: list[Event]) -> dict[int, list[int]]:
    """The nodes each rank ran on, in order of first appearance (ranks may move after a restart)."""
    nodes: dict[int, list[int]] = {}
    for event in events:
        if event.rank is None or event.node is None:
            continue
        placed = nodes.setdefault(event.rank, [])
        if event.node not in placed and (event.kind == WORKER_STARTED or not placed):
            placed.append(event.node)
    return nodes


def _generation_bands(events: list[Event], end: float) -> list[tuple[int, float, float]]:
    """(generation, start, stop): a generation lasts until its restart begins or the next starts."""
    starts = _generation_start_times(events)
    job_end = _last(events, JOB_END)
    stop_default = job_end.time if job_end else end
    bands = []
    ordered = list(starts.items())
    for index, (generation, start) in enumerate(ordered):
        stop = ordered[index + 1][1] if index + 1 < len(ordered) else stop_default
        restart = next((e for e in events if e.kind == RESTART_BEGIN and start <= e.time < stop), None)
        if restart is not None:
            stop = restart.time
        bands.append((generation, start, max(stop, start)))
    return bands


def _nice_step(span: float, target_ticks: int = 10) -> float:
    raw = span / target_ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    for multiple in (1, 2, 5, 10):
        if raw <= multiple * magnitude:
            return multiple * magnitude
    return 10 * magnitude


def _axis(
    svg: _Svg, span: float, x_of: Callable[[float], float], origin: float, plot_top: float, plot_bottom: float
) -> None:
    tick = _nice_step(span)
    svg.add("line", x1=_LEFT, y1=plot_bottom, x2=_WIDTH - _RIGHT, y2=plot_bottom, stroke="#555555")
    count = int(span / tick + 1e-9)
    for index in range(count + 1):
        seconds = index * tick
        x = x_of(origin + seconds)
        svg.add("line", x1=x, y1=plot_top, x2=x, y2=plot_bottom, stroke="#000000", stroke_opacity=0.08)
        svg.add("line", x1=x, y1=plot_bottom, x2=x, y2=plot_bottom + 5, stroke="#555555")
        label = f"{seconds:g}" if tick >= 1 else f"{seconds:.1f}"
        svg.text(x, plot_bottom + 18, label, size=11, text_anchor="middle", fill="#333333")
    svg.text(
        _WIDTH - _RIGHT,
        plot_bottom + 34,
        "seconds since job start",
        size=11,
        text_anchor="end",
        fill="#555555",
    )


def _legend(svg: _Svg) -> None:
    y = 46
    x = float(_LEFT)
    entries = [
        ("line", _STEP_COLOR, "committed step"),
        ("band", _BAND_COLORS[0], "generation"),
        ("vline", _FAULT_COLOR, "fault detected"),
        ("vline", _INJECTION_COLOR, "injection"),
        ("tick", _CHECKPOINT_COLOR, "checkpoint saved"),
        ("dot", _FIRST_STEP_COLOR, "first step after resume"),
    ]
    for shape, color, label in entries:
        if shape == "line":
            svg.add("line", x1=x, y1=y - 4, x2=x + 18, y2=y - 4, stroke=color, stroke_width=2)
        elif shape == "band":
            svg.add("rect", x=x, y=y - 11, width=18, height=12, fill=color, stroke="#bbbbbb")
        elif shape == "vline":
            svg.add("line", x1=x + 9, y1=y - 12, x2=x + 9, y2=y + 2, stroke=color, stroke_width=2)
        elif shape == "tick":
            svg.add("line", x1=x + 9, y1=y - 10, x2=x + 9, y2=y + 1, stroke=color, stroke_width=2)
        else:
            svg.add("circle", cx=x + 9, cy=y - 4, r=4.5, fill=color)
        svg.text(x + 24, y, label, size=12)
        x += 24 + 7.2 * len(label) + 22


def _vertical_markers(
    svg: _Svg, events: list[Event], x_of: Callable[[float], float], plot_top: float, plot_bottom: float
) -> None:
    """Faults and injections cross every lane; their labels sit above the lanes, one row each.

    Injection labels end at their line and fault labels start at theirs, so an injection
    and the fault it causes a moment later do not cover each other. A label that would
    overlap the previous one in its row is left out (the line stays).
    """
    rows = {INJECTION: plot_top - 22, FAULT_DETECTED: plot_top - 8, ELASTIC_SHRINK: plot_top - 36,
            ELASTIC_GROW: plot_top - 36}
    rows[CONTROLLER_LEADER] = plot_top - 36  # a takeover shares the elastic row
    row_end = {kind: -math.inf for kind in rows}
    for event in events:
        if event.kind not in rows or (event.kind == CONTROLLER_LEADER and not _is_takeover(event)):
            continue
        x = x_of(event.time)
        if event.kind == CONTROLLER_LEADER:
            color = _FAILOVER_COLOR
            svg.add("line", class_="failover", x1=x, y1=plot_top - 44, x2=x, y2=plot_bottom, stroke=color,
                    stroke_width=1.5, stroke_dasharray="6,2")
            label = _takeover_label(event)
            prefer_left = False
        elif event.kind in (ELASTIC_SHRINK, ELASTIC_GROW):
            color = _ELASTIC_COLOR
            svg.add("line", class_="elastic", x1=x, y1=plot_top - 44, x2=x, y2=plot_bottom, stroke=color,
                    stroke_width=1.5, stroke_dasharray="2,2")
            label = _world_change_label(event)
            prefer_left = False
        elif event.kind == INJECTION:
            color = _INJECTION_COLOR
            svg.add(
                "line",
                class_="injection",
                x1=x,
                y1=plot_top - 30,
                x2=x,
                y2=plot_bottom,
                stroke=color,
                stroke_width=1.5,
                stroke_dasharray="5,3",
            )
            label = _shorten(f"inject {event.details.get('spec') or ''}".strip(), 40)
            prefer_left = True
        else:
            color = _FAULT_COLOR
            svg.add(
                "line",
                class_="fault",
                x1=x,
                y1=plot_top - 20,
                x2=x,
                y2=plot_bottom,
                stroke=color,
                stroke_width=2,
            )
            label = _shorten(_fault_label(event), 40)
            prefer_left = False
        label_width = 6.6 * len(label)
        left = x - 4 - label_width if prefer_left else x + 4
        if left < 4 or left + label_width > _WIDTH - 4:
            left = x + 4 if prefer_left else x - 4 - label_width
        if left < row_end[event.kind] + 6:
            continue
        for kind, row in rows.items():  # shrink, grow and takeovers share a row
            if row == rows[event.kind]:
                row_end[kind] = left + label_width
        svg.text(left, rows[event.kind], label, size=11, fill=color, font_weight="bold")


def _fault_label(event: Event) -> str:
    reason = str(event.details.get("reason") or "fault")
    cause = event.details.get("signal") or (
        f"exit {event.details['exitcode']}" if event.details.get("exitcode") is not None else reason
    )
    where = f"rank {event.rank}" if event.rank is not None else f"node {event.node}"
    step = f" @ step {event.step}" if event.step is not None else ""
    return f"{cause} {where}{step}"


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ----------------------------------------------------------------------------- files


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the timeline SVG of ``run_dir`` (default ``RUN_DIR/timeline.svg``) and return its path."""
    run_dir = Path(run_dir)
    events = read_events(run_dir)
    if out is None:
        out = (run_dir if run_dir.is_dir() else run_dir.parent) / TIMELINE_FILE
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(render_timeline_svg(events), encoding="utf-8")
    return out_path
