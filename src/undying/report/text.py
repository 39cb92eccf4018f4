"""A run's summary as plain text for a terminal: the outcome, then one line per fault and its recovery.

Printed by ``undying report`` and ``undying demo`` (the CLI process, never the job). A fault is
worded by ``undying.faults.describe_fault``, as on the console and in the event log.
"""

from __future__ import annotations

from undying.faults import describe_fault
from undying.report.summary import Recovery, RunSummary
from undying.strategy_names import StrategyName


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
    generations = plural(summary.generations, "generation")
    count = summary.recoveries_total
    recoveries = f"{count} recovery" if count == 1 else f"{count} recoveries"
    restarts = plural(summary.restarts, "job restart")
    lines.append(f"steps: {final_step}; {generations}, {recoveries} ({restarts})")
    lines.append(f"checkpoints: {summary.checkpoints_saved} saved, {summary.checkpoints_corrupt} corrupt")
    if summary.duration_seconds is not None:
        lines.append(f"duration: {summary.duration_seconds:.1f} s")
    lines.append(f"faults: {len(summary.recoveries)}")
    lines.extend("  " + describe_recovery(recovery) for recovery in summary.recoveries)
    if summary.crash_loop:
        loop = summary.crash_loop
        lines.append(f"crash loop: {loop.get('why')}; root cause: {loop.get('description')}"
                     + (f" at step {loop['step']}" if loop.get("step") is not None else ""))
        lines.extend(f"  | {line}" for line in loop.get("log_tail") or [])
    if summary.incidents:
        lines.append(f"incidents: {len(summary.incidents)}")
        lines.extend("  " + incident for incident in summary.incidents)
    if summary.world_changes:
        lines.append("elastic: " + ", ".join(summary.world_changes))
    if summary.takeovers:
        takeovers = (label.removeprefix("controller ") for label in summary.takeovers)
        lines.append("controller: " + ", ".join(takeovers))
    lines.extend(f"numerics: {change}" for change in summary.numerics_changes)
    return "\n".join(lines)


def describe_recovery(recovery: Recovery) -> str:
    """One line: what failed, what was decided, where training resumed and how soon."""
    # A Recovery built by hand may lack the description summarize() always fills in.
    fault = recovery.description or describe_fault(
        recovery.fault_kind, recovery.rank, recovery.node, recovery.exitcode, recovery.signal
    )
    text = f"fault: {fault}"
    if recovery.fault_step is not None:
        text += f" at step {recovery.fault_step}"
    text += f" -> decision: {recovery.strategy or 'none logged'}"
    if recovery.resumed_from_step is not None:
        text += f" -> resumed from step {recovery.resumed_from_step}"
        if recovery.steps_lost is not None:
            text += f" ({plural(recovery.steps_lost, 'step')} lost)"
        if recovery.recovery_seconds is not None:
            text += f", training again {recovery.recovery_seconds:.1f} s after the fault"
        else:
            text += ", not training again before the log ends"
    elif recovery.strategy not in (None, StrategyName.EXIT):
        text += " -> not resumed before the log ends"
    if recovery.detect_seconds is not None:
        text += f" (detected {recovery.detect_seconds:.1f} s after the injection)"
    return text


def plural(count: int, noun: str) -> str:
    """``1 step``, ``2 steps``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
