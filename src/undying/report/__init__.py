"""What happened in a run, read back from its event log (``RUN_DIR/events.jsonl``).

``summary`` turns the events into a ``RunSummary`` (outcome, restarts, and per fault: steps
lost and time until training resumed), ``text`` prints it, ``timeline`` draws the SVG with one
lane per rank (``svg`` is its element writer). Runs in the CLI process (``undying report``,
``undying demo``), never in the job.
"""

from __future__ import annotations

from undying.report.summary import Recovery, RunSummary, summarize
from undying.report.text import describe_recovery, render_summary
from undying.report.timeline import TIMELINE_FILE, render_timeline_svg, write_report

__all__ = [
    "TIMELINE_FILE",
    "Recovery",
    "RunSummary",
    "describe_recovery",
    "render_summary",
    "render_timeline_svg",
    "summarize",
    "write_report",
]
