"""A recovery's time cut into its phases, from a run's event log (bench/failover.py, bench/real_hosts.py).

``detect``: from the fault to the controller's first ``agent_lost`` or ``fault_detected``; then the
phases ``undying report`` draws (src/undying/report/recovery_phases.py: decide, start processes,
wait for plan, group rebuild, state transfer, first step; a job restart: restart, restore, first
step), each to the slowest rank's end of it. Their sum is the MTTR.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from undying import events as ev  # noqa: E402
from undying.events import Event  # noqa: E402
from undying.report.recovery_phases import phase_seconds  # noqa: E402


def recovery_phases(events: list[Event], fault_time: float) -> dict[str, float]:
    """Phase -> seconds of the first recovery after ``fault_time`` (empty if no step followed it)."""
    after = [e for e in events if e.time >= fault_time]
    detected = next((e for e in after if e.kind in (ev.AGENT_LOST, ev.FAULT_DETECTED)), None)
    if detected is None:
        return {}
    firsts = [e for e in after if e.kind == ev.FIRST_STEP and e.time >= detected.time]
    if not firsts:
        return {}
    stop = max(e.time for e in firsts if e.generation == firsts[0].generation)
    within = [e for e in after if e.time <= stop]
    return {"detect": round(detected.time - fault_time, 3),
            **{label.replace(" ", "_"): round(seconds, 3)
               for label, seconds in phase_seconds(within, detected.time, stop).items()}}
