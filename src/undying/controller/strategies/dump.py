"""The dying checkpoint: a healthy replica writes the committed state, then the job restarts.

Runs in the controller, inside the job machine. The dump reuses the process-level recovery's
check-in (the survivors report their committed step; the plan's action is ``dump`` and names
the source); when the source reports ``dump_committed`` the dump hands the recovery over to the
job restart, which loads it like any checkpoint. A fault during the dump fails it: the restart loads the last periodic one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from undying import events as ev
from undying.controller.state import EXIT_FAILED, JobState
from undying.controller.strategies.base import RecoveryContext, within_budget
from undying.controller.strategies.job_restart import begin_job_restart
from undying.controller.strategies.process import ProcessRecovery
from undying.events import Event
from undying.faults import Fault
from undying.strategy_names import StrategyName

if TYPE_CHECKING:
    from undying.controller.job import JobCore
    from undying.controller.recovery import ActiveRecovery


class Dump(ProcessRecovery):
    """The dying checkpoint: a healthy replica writes the committed state, then the job restarts."""

    name = StrategyName.DUMP
    begin_event = ev.DUMP_BEGIN

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        if context.survivors() * 2 <= context.spec.world_size:
            return "no more than half of the ranks are healthy"
        return context.mesh_refusal(self.name) or within_budget(context)

    def gather_newcomers(self, job: JobCore, recovery: ActiveRecovery, lost: set[int], now: float,
                         excluded: frozenset[StrategyName]) -> None:
        return None  # nothing restarts before the dump: the job restarts after it

    def on_worker_event(self, job: JobCore, event: Event, now: float) -> None:
        if event.kind != ev.DUMP_COMMITTED:
            return
        why = f"dying checkpoint of step {event.step} committed"
        if job.spec.fault_scheduling == "off":
            # No restart to load it: the job ends, and its next run resumes from the dump.
            job.finish(JobState.FAILED, EXIT_FAILED, f"{why}; fault_scheduling is off, the job is not restarted", now)
            return
        # The dump already counted against max_restarts: the restart that loads it is the same recovery,
        # handed over to the job restart's executor.
        job.hand_over(StrategyName.JOB_RESTART, f"{why}: the job restarts from it")
        begin_job_restart(job, why, now, count=False)
