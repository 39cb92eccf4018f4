"""A recovery's time cut into its phases, from a run's event log (used by bench/failover.py and
bench/real_hosts.py).

The phases follow each other from the fault: ``detect`` (to the controller's first ``agent_lost`` or
``fault_detected``), ``decide`` (to its ``decision``), ``process_start`` (to the last ``worker_ready``
of the processes started for the recovery; 0 when none was), ``rebuild_and_transfer`` (to the last
rank's ``recovered``: the group rebuilt and the state moved; the slowest rank's ``rebuild`` and
``repair`` parts are given too, as it timed them), ``first_step`` (to the last rank's first
completed step). Their sum is the MTTR.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from undying import events as ev  # noqa: E402
from undying.events import Event  # noqa: E402


def recovery_phases(events: list[Event], fault_time: float) -> dict[str, Any]:
    """The phases of the first recovery after ``fault_time`` (seconds; an empty dict if it never
    reached a first step)."""
    after = [e for e in events if e.time >= fault_time]
    detected = next((e for e in after if e.kind in (ev.AGENT_LOST, ev.FAULT_DETECTED)), None)
    decision = next((e for e in after if e.kind == ev.DECISION), None)
    if detected is None or decision is None:
        return {}
    firsts = [e for e in after if e.kind == ev.FIRST_STEP and e.time >= decision.time]
    if not firsts:
        return {}
    generation = firsts[0].generation
    first_step = max(e.time for e in firsts if e.generation == generation)
    ready = [e.time for e in after if e.kind == ev.WORKER_READY and decision.time <= e.time <= first_step]
    recovered = [e for e in after if e.kind == ev.RECOVERED and decision.time <= e.time <= first_step]
    bounds = [("detect", detected.time), ("decide", decision.time), ("process_start", max(ready, default=None)),
              ("rebuild_and_transfer", max((e.time for e in recovered), default=None)), ("first_step", first_step)]
    phases: dict[str, Any] = {}
    previous = fault_time
    for name, time in bounds:
        if time is None or time < previous:
            phases[name] = 0.0
            continue
        phases[name] = round(time - previous, 3)
        previous = time
    if recovered:
        phases["slowest_rebuild"] = max(float(e.details.get("rebuild", 0.0)) for e in recovered)
        phases["slowest_repair"] = max(float(e.details.get("repair", 0.0)) for e in recovered)
    return phases
