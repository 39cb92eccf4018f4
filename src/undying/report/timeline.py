"""The timeline picture of a run: one lane per rank, committed step over time, faults across all lanes.

``render_timeline_svg`` draws a run's events as a standalone SVG; ``write_report`` writes it to
``RUN_DIR/timeline.svg``. Runs in the CLI process (``undying report``, ``undying demo``), never
in the job.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from undying.events import (
    CHECKPOINT_SAVE,
    CONTROLLER_LEADER,
    ELASTIC_GROW,
    ELASTIC_SHRINK,
    FAULT_DETECTED,
    FIRST_STEP,
    INJECTION,
    JOB_END,
    JOB_START,
    RESTART_BEGIN,
    WORKER_STARTED,
    Event,
    read_events,
)
from undying.report.summary import (
    PROGRESS_KINDS,
    RunSummary,
    first_event,
    generation_start_times,
    is_takeover,
    last_event,
    summarize,
    takeover_label,
    with_generations,
    world_change_label,
)
from undying.report.svg import SvgDrawing, fmt
from undying.report.text import plural

TIMELINE_FILE = "timeline.svg"

_WIDTH = 1200
_LEFT = 150  # rank labels
_RIGHT = 40
_TOP = 96  # title, legend, fault/injection labels
_LANE = 80
_LANE_GAP = 8
_BOTTOM = 40  # time axis
_PLOT_WIDTH = _WIDTH - _LEFT - _RIGHT
_FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
_BAND_COLORS = ("#e8f0fb", "#e9f6ea", "#fbf1e1", "#f1e8f8")
_STEP_COLOR = "#333333"
_FAULT_COLOR = "#d62728"
_INJECTION_COLOR = "#ff7f0e"
_CHECKPOINT_COLOR = "#1f5fbf"
_FIRST_STEP_COLOR = "#2ca02c"
_ELASTIC_COLOR = "#7b3fbf"
_FAILOVER_COLOR = "#b8860b"


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


@dataclass(frozen=True)
class _Plot:
    """What every lane is drawn against: the run's events, the shared time and step scales."""

    events: list[Event]
    tagged: list[tuple[Event, int | None]]  # each event with its generation
    origin: float  # the time at x = _LEFT
    span: float  # seconds across the plot
    max_step: int  # the step at the top of every lane
    bands: list[tuple[int, float, float]]  # (generation, start, stop)
    nodes: dict[int, list[int]]  # the nodes each rank ran on

    def x_of(self, time: float) -> float:
        return _LEFT + (time - self.origin) / self.span * _PLOT_WIDTH


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
    svg = SvgDrawing()
    svg.add("rect", x=0, y=0, width=_WIDTH, height=height, fill="white")
    svg.text(_LEFT, 24, _title(summary), size=16, font_weight="bold")
    if not events:
        svg.text(_LEFT, _TOP, "no events", size=14, fill="#777777")
        return svg.document(_WIDTH, height, _FONT)

    job_start = first_event(events, JOB_START)
    origin = job_start.time if job_start else events[0].time
    end = max(e.time for e in events)
    plot_top, plot_bottom = _TOP, _TOP + len(ranks) * (_LANE + _LANE_GAP)
    tagged = with_generations(events)
    max_step = max([e.step for e, _ in tagged if e.kind in PROGRESS_KINDS and e.step is not None] or [0])
    plot = _Plot(events=events, tagged=tagged, origin=origin, span=max(end - origin, 1.0),
                 max_step=max(max_step, 1), bands=_generation_bands(events, end), nodes=_rank_nodes(events))

    _legend(svg)
    _axis(svg, plot.span, plot.x_of, origin, plot_top, plot_bottom)
    for lane, rank in enumerate(ranks):
        _draw_lane(svg, plot, lane, rank, lane_top=plot_top + lane * (_LANE + _LANE_GAP))
    _vertical_markers(svg, events, plot.x_of, plot_top, plot_bottom)
    return svg.document(_WIDTH, height, _FONT)


def _draw_lane(svg: SvgDrawing, plot: _Plot, lane: int, rank: int, lane_top: int) -> None:
    """One rank's lane: its background and generation bands, its label, its committed steps and markers."""
    lane_bottom = lane_top + _LANE

    def y_of(step: float) -> float:
        return lane_top + _LANE - 6 - step / plot.max_step * (_LANE - 18)

    svg.add("rect", class_="lane", x=_LEFT, y=lane_top, width=_PLOT_WIDTH, height=_LANE, fill="#fafafa",
            stroke="#dddddd")
    _draw_bands(svg, plot, lane, lane_top)
    node_label = "/".join(str(n) for n in plot.nodes.get(rank, [])) or "?"
    svg.text(10, lane_top + _LANE / 2, f"rank {rank} / node {node_label}", size=13, font_weight="bold",
             class_="lane-label")
    svg.text(10, lane_top + _LANE / 2 + 16, f"step 0-{plot.max_step}", size=10, fill="#777777")

    lines: dict[int | None, list[tuple[float, float]]] = {}
    for event, event_generation in plot.tagged:
        if event.rank == rank and event.kind in PROGRESS_KINDS and event.step is not None:
            lines.setdefault(event_generation, []).append((plot.x_of(event.time), y_of(event.step)))
    for points in lines.values():
        if len(points) == 1:
            svg.add("circle", cx=points[0][0], cy=points[0][1], r=1.5, fill=_STEP_COLOR)
        else:
            svg.add("polyline", class_="steps", points=" ".join(f"{fmt(x)},{fmt(y)}" for x, y in points),
                    fill="none", stroke=_STEP_COLOR, stroke_width=1.6)
    for event in plot.events:
        if event.rank != rank and event.rank is not None:
            continue
        x = plot.x_of(event.time)
        if event.kind == CHECKPOINT_SAVE:
            svg.add("line", class_="checkpoint", x1=x, y1=lane_bottom - 12, x2=x, y2=lane_bottom,
                    stroke=_CHECKPOINT_COLOR, stroke_width=2)
        elif event.kind == FIRST_STEP and event.step is not None and event.rank == rank:
            svg.add("circle", class_="first-step", cx=x, cy=y_of(event.step), r=4.5, fill=_FIRST_STEP_COLOR,
                    stroke="white")
        elif event.kind == FAULT_DETECTED and event.rank == rank and event.step is not None:
            svg.add("circle", class_="fault", cx=x, cy=y_of(event.step), r=4.5, fill="none",
                    stroke=_FAULT_COLOR, stroke_width=2)


def _draw_bands(svg: SvgDrawing, plot: _Plot, lane: int, lane_top: int) -> None:
    """The generations as shaded bands, labelled where there is room, and the restarts between them."""
    bands = plot.bands
    for index, (generation, start, stop) in enumerate(bands):
        left, right = plot.x_of(start), plot.x_of(stop)
        svg.add("rect", x=left, y=lane_top, width=max(right - left, 1.0), height=_LANE,
                fill=_BAND_COLORS[index % len(_BAND_COLORS)])
        if lane == 0 or right - left > 40:
            svg.text(left + 3, lane_top + 11, f"gen {generation}", size=9, fill="#888888")
        next_start = plot.x_of(bands[index + 1][1]) if index + 1 < len(bands) else right
        if next_start - right > 40:
            svg.text((right + next_start) / 2, lane_top + 11, "restart", size=9, fill="#888888",
                     text_anchor="middle")


def _title(summary: RunSummary) -> str:
    outcome = summary.outcome or "unfinished (no job_end)"
    if summary.exit_code is not None:
        outcome += f" (exit {summary.exit_code})"
    world = "?" if summary.world_size is None else str(summary.world_size)
    return (
        f"undying run: {outcome}; {world} ranks, {plural(summary.generations, 'generation')}, "
        f"{plural(summary.restarts, 'restart')}, {plural(len(summary.recoveries), 'fault')}"
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
    starts = generation_start_times(events)
    job_end = last_event(events, JOB_END)
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


def _axis(svg: SvgDrawing, span: float, x_of: Callable[[float], float], origin: float, plot_top: float,
          plot_bottom: float) -> None:
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
    svg.text(_WIDTH - _RIGHT, plot_bottom + 34, "seconds since job start", size=11, text_anchor="end",
             fill="#555555")


def _legend(svg: SvgDrawing) -> None:
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


def _vertical_markers(svg: SvgDrawing, events: list[Event], x_of: Callable[[float], float], plot_top: float,
                      plot_bottom: float) -> None:
    """Faults and injections cross every lane; their labels sit above the lanes, one row each.

    Injection labels end at their line and fault labels start at theirs, so an injection
    and the fault it causes a moment later do not cover each other. A label that would
    overlap the previous one in its row is left out (the line stays).
    """
    rows: dict[str, float] = {INJECTION: plot_top - 22, FAULT_DETECTED: plot_top - 8, ELASTIC_SHRINK: plot_top - 36,
            ELASTIC_GROW: plot_top - 36}
    rows[CONTROLLER_LEADER] = plot_top - 36  # a takeover shares the elastic row
    row_end = {kind: -math.inf for kind in rows}
    for event in events:
        if event.kind not in rows or (event.kind == CONTROLLER_LEADER and not is_takeover(event)):
            continue
        x = x_of(event.time)
        if event.kind == CONTROLLER_LEADER:
            color = _FAILOVER_COLOR
            svg.add("line", class_="failover", x1=x, y1=plot_top - 44, x2=x, y2=plot_bottom, stroke=color,
                    stroke_width=1.5, stroke_dasharray="6,2")
            label = takeover_label(event)
            prefer_left = False
        elif event.kind in (ELASTIC_SHRINK, ELASTIC_GROW):
            color = _ELASTIC_COLOR
            svg.add("line", class_="elastic", x1=x, y1=plot_top - 44, x2=x, y2=plot_bottom, stroke=color,
                    stroke_width=1.5, stroke_dasharray="2,2")
            label = world_change_label(event)
            prefer_left = False
        elif event.kind == INJECTION:
            color = _INJECTION_COLOR
            svg.add("line", class_="injection", x1=x, y1=plot_top - 30, x2=x, y2=plot_bottom, stroke=color,
                    stroke_width=1.5, stroke_dasharray="5,3")
            label = _shorten(f"inject {event.details.get('spec') or ''}".strip(), 40)
            prefer_left = True
        else:
            color = _FAULT_COLOR
            svg.add("line", class_="fault", x1=x, y1=plot_top - 20, x2=x, y2=plot_bottom, stroke=color,
                    stroke_width=2)
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
    """The short label above a fault's line: its signal or exit code, else its reason.

    Kept terse so labels in one row rarely overlap; the summary text has the full description.
    """
    reason = str(event.details.get("reason") or "fault")
    cause = event.details.get("signal") or (
        f"exit {event.details['exitcode']}" if event.details.get("exitcode") is not None else reason
    )
    where = f"rank {event.rank}" if event.rank is not None else f"node {event.node}"
    step = f" @ step {event.step}" if event.step is not None else ""
    return f"{cause} {where}{step}"


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
