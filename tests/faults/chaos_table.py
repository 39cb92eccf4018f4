"""The chaos soak's table (tests/faults/chaos.py runs the soak): per kind of fault, the recoveries
it caused, the strategies that handled them, MTTR, detection and the MTTR's phases, read from the
job's event log.

Runs in the test (or benchmark) process, after the soak.
"""

from __future__ import annotations

from collections import Counter
from statistics import median
from typing import Any

from tests.faults.chaos import Soak
from undying import events as ev
from undying.report.recovery_phases import phase_seconds
from undying.report.summary import summarize

# The phases' short names in the table, in the order a recovery goes through them.
PHASE_NAMES = {"detect": "detect", "decide": "decide", "start processes": "start", "wait for plan": "plan",
               "group rebuild": "rebuild", "state transfer": "transfer", "restart": "restart",
               "restore": "restore", "first step": "first step"}


def fault_table(soak_run: Soak) -> list[dict[str, Any]]:
    """Per kind of fault: how many were planned, the recoveries they caused, the strategies the chain
    chose (its first answer to each), MTTR (from the fault, the injection claimed or the harness's
    SIGTERM or cut, to the job's first completed step after the recovery) median and max, and
    detection (from the fault to ``fault_detected``) median, and the median of each phase of the MTTR
    (``phases_median_s``: detect, then the phases ``undying report`` draws). A recovery is the
    fault's whose action came last before it was detected."""
    run, plan = soak_run.run, soak_run.plan
    claims = {event.details["spec"]: event.time for event in run.kinds(ev.INJECTION)}
    causes: list[tuple[float, str]] = []
    for position, fault in enumerate(plan):
        times = [claims[spec] for spec in fault.specs if spec in claims] or \
            ([soak_run.acted[position]] if position in soak_run.acted else [])
        if times:
            causes.append((min(times), fault.label()))
    causes.sort()
    rows: dict[str, dict[str, Any]] = {}
    for fault in plan:
        row = rows.setdefault(fault.label(), {"fault": fault.label(), "planned": 0, "recoveries": 0,
                                              "strategies": Counter(), "mttr": [], "detect": [], "phases": {}})
        row["planned"] += 1
    for recovery in summarize(run.events).recoveries:
        before = [label for when, label in causes if when <= recovery.fault_time]
        label = before[-1] if before else "(none)"
        row = rows.setdefault(label, {"fault": label, "planned": 0, "recoveries": 0, "strategies": Counter(),
                                      "mttr": [], "detect": [], "phases": {}})
        row["recoveries"] += 1
        row["strategies"][recovery.strategy or "-"] += 1
        cause = max((when for when, _ in causes if when <= recovery.fault_time), default=None)
        if cause is not None:
            row["detect"].append(recovery.fault_time - cause)
            if recovery.first_step_time is not None:
                row["mttr"].append(recovery.first_step_time - cause)
                within = [e for e in run.events if recovery.fault_time <= e.time <= recovery.first_step_time]
                phases = {"detect": recovery.fault_time - cause,
                          **phase_seconds(within, recovery.fault_time, recovery.first_step_time)}
                for name, seconds in phases.items():
                    row["phases"].setdefault(name, []).append(seconds)
    table = []
    for row in sorted(rows.values(), key=lambda r: r["fault"]):
        table.append({"fault": row["fault"], "planned": row["planned"], "recoveries": row["recoveries"],
                      "strategies": dict(row["strategies"]),
                      "mttr_median_s": round(median(row["mttr"]), 2) if row["mttr"] else None,
                      "mttr_max_s": round(max(row["mttr"]), 2) if row["mttr"] else None,
                      "detect_median_s": round(median(row["detect"]), 2) if row["detect"] else None,
                      "phases_median_s": {name: round(median(seconds), 2) for name, seconds in row["phases"].items()}})
    return table


def markdown(table: list[dict[str, Any]]) -> str:
    lines = ["| fault | planned | recoveries | strategies | MTTR median s | MTTR max s | detection median s | "
             "phases, median s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in table:
        strategies = ", ".join(f"{name} x{count}" for name, count in sorted(row["strategies"].items())) or "-"
        lines.append(f"| {row['fault']} | {row['planned']} | {row['recoveries']} | {strategies} | "
                     f"{row['mttr_median_s'] if row['mttr_median_s'] is not None else '-'} | "
                     f"{row['mttr_max_s'] if row['mttr_max_s'] is not None else '-'} | "
                     f"{row['detect_median_s'] if row['detect_median_s'] is not None else '-'} | "
                     f"{_phase_text(row['phases_median_s'])} |")
    return "\n".join(lines)


def _phase_text(phases: dict[str, float]) -> str:
    """The phases in the order a recovery goes through them: ``detect 0.07, decide 0.00, ...``."""
    named = [f"{PHASE_NAMES[name]} {phases[name]:.2f}" for name in PHASE_NAMES if name in phases]
    return ", ".join(named) or "-"


__all__ = ["fault_table", "markdown"]
