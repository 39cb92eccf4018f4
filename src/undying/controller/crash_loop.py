"""Crash loops: a job whose recoveries bring it no further stops, with the fault that started it.

Runs in the controller, inside the job machine. A bug in the script (an exception at its first
step, a refused call, an import that fails) is not a fault any recovery can cure: each recovery
replays the same step and meets the same error. The job stops (exit 1) once the recoveries are
seen to bring nothing: after ``crash_loop_limit`` recoveries in a row with no step committed in
between, or at once when the same exception comes back at the same step (never a refused repair:
a worker that exited because nothing holds a lost shard, ``Fault.repair_refused``). The cause it reports
(event ``crash_loop``, the console, the job's end message and the report) is the first fault of
the run of faults that made no progress: its rank, its exception or signal, and the last lines
of that rank's output.

Progress is a step committed in the generation a recovery resumed: a heartbeat of that
generation whose committed step is past the step the generation resumed from (a plan's target
step, or the step the ranks restored at a job restart). A planned leave is never part of a loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from undying.faults import Fault, FaultReason
from undying.protocol import Phase

# The phases of a rank that trains: its first beat in one of them tells the step the generation resumed at.
TRAINING_PHASES = frozenset({Phase.COMPUTING, Phase.SYNCING, Phase.UPDATING, Phase.UPDATED})


@dataclass
class CrashLoop:
    """The faults acted on since a step last committed, and the generation watched for progress."""

    limit: int  # crash_loop_limit: recoveries in a row without a committed step (0: never stop)
    streak: list[Fault] = field(default_factory=list)  # oldest first
    generation: int = 0  # the generation whose progress counts
    resume_step: int | None = None  # the step it resumed from (None: not known yet)

    def watch(self, generation: int, resume_step: int | None = None) -> None:
        """A generation starts (its resume step known from the ranks' first beats) or a recovery's
        plan resumes one at ``resume_step``."""
        self.generation, self.resume_step = generation, resume_step

    def heard(self, generation: int, step: int, phase: str) -> None:
        """A rank's heartbeat: its committed step in ``generation``."""
        if generation != self.generation:
            return  # a beat of an older generation (a survivor before it joined the new one)
        if self.resume_step is None:
            if phase in TRAINING_PHASES:
                self.resume_step = step
            return
        if step > self.resume_step:
            self.streak.clear()

    def verdict(self, fault: Fault) -> str | None:
        """A fault the chain is about to act on: why the job must stop instead (None: recover)."""
        if self.limit == 0 or fault.planned or fault.reason == FaultReason.NODE_RETURNED:
            return None
        if any(earlier is fault for earlier in self.streak):
            return None  # the same fault decided again, after a recovery of it failed
        # A refused repair (``Fault.repair_refused``: nothing holds a lost shard) comes back at the same
        # step because the chain tried a strategy that cannot help, not because the script failed again:
        # the chain goes on to its next strategy, and only the recoveries count.
        repeated = bool(fault.error) and not fault.repair_refused and any(
            earlier.error == fault.error and earlier.step == fault.step and not earlier.repair_refused
            for earlier in self.streak)
        self.streak.append(fault)
        if repeated:
            return f"the same exception again at step {fault.step}"
        recoveries = len(self.streak) - 1
        if recoveries >= self.limit:
            return f"{recoveries} recoveries in a row committed no step (crash_loop_limit {self.limit})"
        return None

    def root_cause(self) -> Fault:
        """The fault that started the loop: the first whose script raised (a refused repair is undying's
        own exception, not the script's), else the first."""
        assert self.streak
        return next((fault for fault in self.streak if fault.error and not fault.repair_refused), self.streak[0])


def root_cause_details(root: Fault, why: str, recoveries: int) -> dict[str, Any]:
    """The ``crash_loop`` event's details: why the job stopped and what started the loop."""
    return {"why": why, "recoveries": recoveries, "reason": root.reason, "rank": root.rank, "node": root.node,
            "step": root.step, "description": root.describe(), "error": root.error, "exitcode": root.exitcode,
            "signal": root.signal, "log_tail": list(root.log_tail)}


def stop_message(root: Fault, why: str) -> str:
    """The job's one-line end message."""
    at = f" at step {root.step}" if root.step is not None else ""
    return f"crash loop ({why}); root cause: {root.describe()}{at}"
