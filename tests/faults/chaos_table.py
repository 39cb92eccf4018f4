"""The chaos soak's table (tests/faults/chaos.py runs the soak): per kind of fault, the recoveries
it caused, the strategies that handled them, MTTR and detection, read from the job's event log.

Runs in the test (or benchmark) process, after the soak.
"""

from __future__ import annotations

from collections import Counter
from statistics import median
from typing import Any

from tests.faults.chaos import Soak
from undying import events as ev
from undying.report.summary import summarize


def fault_table(soak_run: Soak) -> list[dict[str, Any]]:
    """Per kind of fault: how many were planned, the recoveries they caused, the strategies the chain
    chose (its first answer to each), MTTR (from the fault, the injection claimed or the harness's
    SIGTERM or cut, to the job's first completed step after the recovery) median and max, and
    detection (from the fault to ``fault_detected``) median. A recovery is the fault's whose action
    came last before it was detected."""
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
                                              "strategies": Counter(), "mttr": [], "detect": []})
        row["planned"] += 1
    for recovery in summarize(run.events).recoveries:
        before = [label for when, label in causes if when <= recovery.fault_time]
        label = before[-1] if before else "(none)"
        row = rows.setdefault(label, {"fault": label, "planned": 0, "recoveries": 0, "strategies": Counter(),
                                      "mttr": [], "detect": []})
        row["recoveries"] += 1
        row["strategies"][recovery.strategy or "-"] += 1
        cause = max((when for when, _ in causes if when <= recovery.fault_time), default=None)
        if cause is not None:
            row["detect"].append(recovery.fault_time - cause)
            if recovery.first_step_time is not None:
                row["mttr"].append(recovery.first_step_time - cause)
    table = []
    for row in sorted(rows.values(), key=lambda r: r["fault"]):
        table.append({"fault": row["fault"], "planned": row["planned"], "recoveries": row["recoveries"],
                      "strategies": dict(row["strategies"]),
                      "mttr_median_s": round(median(row["mttr"]), 2) if row["mttr"] else None,
                      "mttr_max_s": round(max(row["mttr"]), 2) if row["mttr"] else None,
                      "detect_median_s": round(median(row["detect"]), 2) if row["detect"] else None})
    return table


def markdown(table: list[dict[str, Any]]) -> str:
    lines = ["| fault | planned | recoveries | strategies | MTTR median s | MTTR max s | detection median s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in table:
        strategies = ", ".join(f"{name} x{count}" for name, count in sorted(row["strategies"].items())) or "-"
        lines.append(f"| {row['fault']} | {row['planned']} | {row['recoveries']} | {strategies} | "
                     f"{row['mttr_median_s'] if row['mttr_median_s'] is not None else '-'} | "
                     f"{row['mttr_max_s'] if row['mttr_max_s'] is not None else '-'} | "
                     f"{row['detect_median_s'] if row['detect_median_s'] is not None else '-'} |")
    return "\n".join(lines)


__all__ = ["fault_table", "markdown"]
