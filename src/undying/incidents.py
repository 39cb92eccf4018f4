"""What slowed or endangered the job without failing it, in words: stragglers, switches, bad steps,
failed health checks, a job restart's wait for a checkpoint.

Shared by the processes that describe events: the console (launch/console.py, in ``undying run``), the
controller's recent lines for ``undying status`` (controller/job_view.py) and the report
(report/summary.py, in ``undying report``), so all three say the same thing. ``describe_incident``
is to these events what ``faults.describe_fault`` is to faults.
"""

from __future__ import annotations

from typing import Any

from undying import events as ev

INCIDENT_KINDS = frozenset({ev.STRAGGLER, ev.SWITCH_BEGIN, ev.BAD_STEP, ev.NODE_CHECK_FAILED, ev.COMMIT_DRAIN})
_BAD_STEP_ACTIONS = {
    "replay": "replaying it from the committed step",
    "skip": "bad again: skipped (committed without its update, bad_step_repeat: skip)",
    "stop": "bad again: the job stops (bad_step_repeat: stop)",
    "replayed": "the replay committed: the fault was transient",
}


def describe_incident(kind: str, step: int | None, rank: int | None, node: int | None,
                      details: dict[str, Any]) -> str:
    """One line for an incident event (``INCIDENT_KINDS``)."""
    if kind == ev.STRAGGLER:
        switch = ""
        if details.get("strategy") == "switch":
            switch = "; its node moves to a spare" + ("" if details.get("spare_idle") else " once one is idle")
        return (f"STRAGGLER rank {rank} (node {node}): {_ms(details.get('busy_seconds'))} busy per step, "
                f"{_number(details.get('ratio'))} x its peers' {_ms(details.get('peers_busy_seconds'))} "
                f"(compute {_ms(details.get('compute_seconds'))}, data {_ms(details.get('data_seconds'))}, "
                f"waiting in collectives {_ms(details.get('comm_seconds'))}, its peers "
                f"{_ms(details.get('peers_comm_seconds'))}){switch}")
    if kind == ev.SWITCH_BEGIN:
        return (f"switching node {node} to spare {details.get('spare')} at the next step boundary: "
                f"{details.get('why')}")
    if kind == ev.BAD_STEP:
        ranks = details.get("ranks") or []
        named = f" (bad values on rank(s) {ranks})" if ranks else ""
        action = _BAD_STEP_ACTIONS.get(str(details.get("action")), str(details.get("action")))
        if details.get("action") == "replayed":
            suspect = f": rank(s) {ranks} suspected of a hardware fault" if ranks else ""
            return f"bad step {step}: {action}{suspect}"
        return f"BAD STEP {step} (attempt {details.get('attempt')}): {details.get('cause')}{named}; {action}"
    if kind == ev.NODE_CHECK_FAILED:
        problems = "; ".join(str(problem) for problem in details.get("problems") or [])
        return f"node {node} ({details.get('host')}) failed its health check: {problems}; it is given no ranks"
    if kind == ev.COMMIT_DRAIN:
        return (f"job restart held {details.get('seconds')} s for rank {rank}'s commit of the checkpoint of "
                f"step {step}: {details.get('outcome')}")
    raise ValueError(f"not an incident event: {kind}")


def _ms(seconds: Any) -> str:
    return f"{seconds * 1000:.1f} ms" if isinstance(seconds, int | float) else "?"


def _number(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "?"
