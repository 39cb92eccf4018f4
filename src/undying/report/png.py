"""The PNG report of a run (matplotlib): committed steps per lane, start-up and recovery phases, loss, step rate.

Runs in the CLI process (``undying report``, ``undying demo``), never in the job (matplotlib is
imported here only). Draws ``figure_data.FigureData``: on top a strip of the start-up phases and of
each recovery's phases (numbered R1, R2, ...); then one lane per rank (up to 16 ranks) or per node
(group) with the committed step on a y-axis, every recovery shaded across the lanes, elastic resizes
and controller failovers as dashed lines; then the mean logged loss and the job's step rate; beneath,
one line per recovery with its fault, strategy, MTTR and phase times. Its size depends on the lanes
only (16 at most), so a 256-rank run renders as readably as a 4-rank one.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from undying.events import Event, read_events
from undying.report.figure_data import FigureData, RecoverySpan, Span, figure_data

PNG_FILE = "report.png"
WIDTH_IN, DPI = 14.0, 100
RECOVERY_LINES_SHOWN = 8
NOTE_WIDTH = 165  # characters of a note line (9 pt monospace across the figure's width)
_STARTUP_COLORS = ("#dfe7f3", "#cbd9ee", "#b8cbe8", "#a6bde2")
_PHASE_COLORS = {"detect": "#ececec", "decide": "#e3d3ef", "start processes": "#cfe0f3", "wait for plan": "#f6c6c1",
                 "restart": "#f6c6c1", "group rebuild": "#fbe7c4", "state transfer": "#f9dfae", "restore": "#f9dfae",
                 "first step": "#d4e9cf"}
_FAULT_COLOR, _ELASTIC_COLOR, _FAILOVER_COLOR = "#d62728", "#7b3fbf", "#b8860b"
_MARKER_COLORS = {"elastic": _ELASTIC_COLOR, "failover": _FAILOVER_COLOR, "incident": "#1f77b4"}
_LANE_COLORS = ("#1f4e9c", "#2a7f62", "#8c3b9e", "#b35900", "#3f3f3f", "#0f7c8c", "#9c1f4e", "#5c6b00")


def write_png(run_dir: str | Path, events: list[Event] | None = None, out: str | Path | None = None) -> Path:
    """Draw the report of ``run_dir`` (default ``RUN_DIR/report.png``) and return its path."""
    run_dir = Path(run_dir)
    if events is None:
        events = read_events(run_dir)
    out_path = Path(out) if out is not None else (run_dir if run_dir.is_dir() else run_dir.parent) / PNG_FILE
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure = render_figure(figure_data(events))
    FigureCanvasAgg(figure).print_png(str(out_path))
    return out_path


def render_figure(data: FigureData) -> Figure:
    lanes = data.lanes or []
    lane_height = 0.9 if len(lanes) <= 4 else 0.5
    notes = _notes(data)
    heights = [0.8, *([lane_height] * max(1, len(lanes))), 1.5, 1.3]
    top_margin, bottom_margin = 0.6, 0.75 + 0.2 * len(notes)  # the title; the time axis, then the notes
    total = top_margin + sum(heights) * 1.12 + bottom_margin
    figure = Figure(figsize=(WIDTH_IN, total), dpi=DPI)
    grid = figure.add_gridspec(len(heights), 1, height_ratios=heights, hspace=0.12, left=0.13, right=0.98,
                               top=1 - top_margin / total, bottom=bottom_margin / total)
    figure.suptitle(data.title, fontsize=13, fontweight="bold", x=0.13, ha="left", y=1 - 0.2 / total)
    strip = figure.add_subplot(grid[0])
    lane_axes = [figure.add_subplot(grid[1 + index], sharex=strip) for index in range(max(1, len(lanes)))]
    loss_axes = figure.add_subplot(grid[-2], sharex=strip)
    rate_axes = figure.add_subplot(grid[-1], sharex=strip)

    _draw_strip(strip, data)
    for index, axes in enumerate(lane_axes):
        _draw_lane(axes, data, index)
    _draw_loss(loss_axes, data)
    _draw_rate(rate_axes, data)
    for axes in [strip, *lane_axes, loss_axes]:
        axes.tick_params(labelbottom=False)
    rate_axes.set_xlabel("seconds since the job started")
    lanes_middle = (lane_axes[0].get_position().y1 + lane_axes[-1].get_position().y0) / 2
    figure.text(0.004, lanes_middle, f"committed step (0-{max(data.max_step, 1)})", rotation=90, va="center",
                fontsize=9, color="#555555")
    rate_axes.set_xlim(0, data.duration * 1.01)
    for index, line in enumerate(notes):
        figure.text(0.02, (bottom_margin - 0.7 - 0.2 * index) / total, line, fontsize=9, va="top", ha="left",
                    family="monospace")
    return figure


def _draw_strip(axes: Axes, data: FigureData) -> None:
    """Start-up phases (top row) and recovery phases (bottom row), labelled where they fit."""
    axes.set_ylim(0, 2)
    axes.set_yticks([0.5, 1.5], ["recoveries", "start-up"], fontsize=9)
    axes.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        axes.spines[side].set_visible(False)
    seconds_per_inch = data.duration * 1.01 / (WIDTH_IN * 0.85)
    for index, span in enumerate(data.startup):
        _bar(axes, span, 1.1, _STARTUP_COLORS[index % len(_STARTUP_COLORS)], seconds_per_inch)
    for recovery in data.recoveries:
        for phase in ([recovery.detect] if recovery.detect else []) + recovery.phases:
            _bar(axes, phase, 0.1, _PHASE_COLORS.get(phase.label, "#dddddd"), seconds_per_inch)
        axes.axvline(recovery.start, color=_FAULT_COLOR, linewidth=1.5)
        axes.text(recovery.start, 0.95, f"R{recovery.number}", color=_FAULT_COLOR, fontsize=9, fontweight="bold",
                  ha="center", va="bottom")
    for marker in data.markers:  # labelled here, where no line of a panel runs
        color = _MARKER_COLORS[marker.kind]
        axes.axvline(marker.time, color=color, linewidth=1.2, linestyle="--")
        axes.text(marker.time, 1.5, f" {marker.label}", color=color, fontsize=8, va="center", ha="left")


def _bar(axes: Axes, span: Span, bottom: float, color: str, seconds_per_inch: float) -> None:
    axes.broken_barh([(span.start, max(span.seconds, seconds_per_inch * 0.02))], (bottom, 0.8), facecolors=color,
                     edgecolors="#999999", linewidth=0.5)
    label = f"{span.label} {span.seconds:.2g} s" if span.seconds < 10 else f"{span.label} {span.seconds:.0f} s"
    if span.seconds / seconds_per_inch > 0.075 * len(label):  # ~0.075 in per character at 8 pt
        axes.text(span.start + span.seconds / 2, bottom + 0.4, label, fontsize=8, ha="center", va="center")


def _draw_lane(axes: Axes, data: FigureData, index: int) -> None:
    _shade(axes, data)
    if not data.lanes:
        axes.text(0.5, 0.5, "no step committed in this log", transform=axes.transAxes, ha="center", color="#777777")
        return
    lane = data.lanes[index]
    many = len(lane.ranks) > 1
    for order, rank in enumerate(lane.ranks):
        color = _LANE_COLORS[order % len(_LANE_COLORS)] if many else _LANE_COLORS[0]
        for segment in data.steps.get(rank, []):
            times, steps = zip(*segment, strict=True)
            axes.plot(times, steps, color=color, linewidth=0.7 if many else 1.4, alpha=0.6 if many else 1.0,
                      drawstyle="steps-post", marker="" if len(segment) > 1 else ".")
    top = max(data.max_step, 1)
    axes.set_ylim(0, top * 1.08)
    axes.set_yticks([0, top])
    axes.tick_params(axis="y", labelsize=8)
    axes.set_ylabel(lane.label, rotation=0, ha="right", va="center", fontsize=9, linespacing=1.1)
    axes.grid(axis="x", color="#000000", alpha=0.06)


def _shade(axes: Axes, data: FigureData) -> None:
    """Every recovery's phases and the resizes and failovers, across a lane or panel."""
    for recovery in data.recoveries:
        for phase in ([recovery.detect] if recovery.detect else []) + recovery.phases:
            axes.axvspan(phase.start, phase.stop, color=_PHASE_COLORS.get(phase.label, "#dddddd"), alpha=0.6,
                         linewidth=0)
        axes.axvline(recovery.start, color=_FAULT_COLOR, linewidth=1.0)
    for marker in data.markers:
        axes.axvline(marker.time, color=_MARKER_COLORS[marker.kind],
                     linewidth=1.2, linestyle="--")


def _draw_loss(axes: Axes, data: FigureData) -> None:
    _shade(axes, data)
    axes.set_ylabel("loss\n(mean over ranks)", rotation=0, ha="right", va="center", fontsize=9)
    axes.tick_params(axis="y", labelsize=8)
    if not data.loss:
        axes.text(0.5, 0.5, "no loss logged (ft.log(loss=...))", transform=axes.transAxes, ha="center",
                  va="center", color="#777777")
        return
    times, losses = zip(*data.loss, strict=True)
    axes.plot(times, losses, color="#1f4e9c", linewidth=1.2)
    axes.grid(color="#000000", alpha=0.06)


def _draw_rate(axes: Axes, data: FigureData) -> None:
    _shade(axes, data)
    axes.set_ylabel("steps/s", rotation=0, ha="right", va="center", fontsize=9)
    axes.tick_params(axis="y", labelsize=8)
    if data.step_rate:
        times, rates = zip(*data.step_rate, strict=True)
        axes.plot(times, rates, color="#2a7f62", linewidth=1.2)
        finite = [rate for rate in rates if math.isfinite(rate)]
        if finite:
            axes.set_ylim(0, max(finite) * 1.15 or 1)
    axes.grid(color="#000000", alpha=0.06)


def _notes(data: FigureData) -> list[str]:
    """Beneath the panels: the start-up phases, one line per recovery (fault, strategy, MTTR, phases), then
    one per incident (a straggler, a bad step, ...)."""
    lines = []
    if data.startup:
        phases = ", ".join(f"{span.label} {span.seconds:.2f} s" for span in data.startup)
        lines.append(f"start-up: {phases} (first step {data.startup[-1].stop:.1f} s after the start)")
    lines += [_recovery_line(recovery) for recovery in data.recoveries[:RECOVERY_LINES_SHOWN]]
    if len(data.recoveries) > RECOVERY_LINES_SHOWN:
        lines.append(f"... and {len(data.recoveries) - RECOVERY_LINES_SHOWN} more recoveries (undying report "
                     "prints every one)")
    if not data.recoveries:
        lines.append("no fault in this run")
    lines += data.incidents[:RECOVERY_LINES_SHOWN]
    if len(data.incidents) > RECOVERY_LINES_SHOWN:
        lines.append(f"... and {len(data.incidents) - RECOVERY_LINES_SHOWN} more incidents (undying report prints "
                     "every one)")
    return [part for line in lines for part in textwrap.wrap(line, NOTE_WIDTH, subsequent_indent="    ")]


def _recovery_line(recovery: RecoverySpan) -> str:
    text = f"R{recovery.number} at {recovery.start:.1f} s: {recovery.description}"
    if recovery.mttr is None:
        return text + "; not training again before the log ends"
    phases = ", ".join(f"{phase.label} {phase.seconds:.2f} s" for phase in recovery.phases)
    detected = f"; detected {recovery.detect.seconds:.2f} s after the injection" if recovery.detect else ""
    return text + f"{detected}; MTTR {recovery.mttr:.2f} s" + (f" ({phases})" if phases else "")
