"""The graceful stop: a job asked to stop persists its newest committed step first, so a rerun loses nothing.

Runs in the controller, inside the job machine. Not a recovery strategy (nothing failed, the chain
never picks it): the job was asked to stop, by a SIGTERM to node 0's ``undying run`` (a preempted
or timed-out Slurm job, a drained pod), by the agents of a Slurm step that all got the signal, or
by ``undying stop``. It reuses a recovery's check-in: the running generation ends at its next step
boundary (each rank finishes its step in flight, as for an elastic grow; the first check-in aborts
a straggler's step, so no step is half committed), every rank checks in with its committed step,
and the plan's action is ``persist``: every rank writes its part of that step's T2 checkpoint
through the ordinary commit protocol (data parallel and sharded alike). Once the checkpoint is
committed the job ends as ``stopped`` (exit 75, EX_TEMPFAIL: run it again to resume there); so
does a stop whose newest step is a checkpoint step already committed by its periodic checkpoint. A
stop that cannot finish within ``stop_timeout`` (a fault meanwhile, a write that fails) cancels
the job: the newest durable checkpoint is then the last periodic one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from undying import events as ev
from undying.controller.deadlines import Deadlines
from undying.controller.recovery import ActiveRecovery
from undying.controller.state import EXIT_CANCELLED, EXIT_OK, EXIT_STOPPED, JobState
from undying.controller.strategies.base import Attempt, RecoveryContext
from undying.controller.strategies.process import ProcessRecovery
from undying.events import Event
from undying.faults import Fault
from undying.strategy_names import StrategyName

if TYPE_CHECKING:
    from undying.controller.job import JobCore


class GracefulStop(ProcessRecovery):
    """Every rank persists the newest committed step, then the job ends as stopped."""

    name = StrategyName.STOP
    begin_event = ev.STOP_BEGIN

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        return "not a recovery"  # started by a stop request only, never by the chain

    def deadline(self, deadlines: Deadlines) -> float:
        return deadlines.graceful_stop

    def start(self, job: JobCore, attempt: Attempt, now: float) -> None:
        old_generation = job.generation
        members = list(job.membership.members)
        # The ranks finish their step in flight and check in at the boundary; the first check-in
        # aborts a straggler's step (Executor.check_in), so every rank holds the same step.
        job.begin_recovery(ActiveRecovery(self.name, attempt.fault, old_generation, old_generation + 1, members,
                                          survivors=set(members), started=now,
                                          deadline=now + self.deadline(job.deadlines)),
                           at_boundary=True, counted=False)
        job.emit(self.begin_event, generation=job.generation, step=job.membership.committed_step(),
                 details={"why": attempt.reason, "old_generation": old_generation})

    def gather_newcomers(self, job: JobCore, recovery: ActiveRecovery, lost: set[int], now: float,
                         excluded: frozenset[StrategyName]) -> None:
        return None

    def progress(self, job: JobCore, now: float) -> None:
        recovery = job.recovery
        if recovery is not None and all(job.membership.ranks[rank].done for rank in recovery.survivors):
            # Every rank finished training before it reached the stop's boundary: nothing is left to stop.
            job.finish(JobState.SUCCEEDED, EXIT_OK, f"finished at step {job.membership.committed_step()} "
                                                    f"before the stop ({recovery.fault.detail}) took effect", now)
            return
        super().progress(job, now)
        recovery = job.recovery
        if job.state.terminal or recovery is None or recovery.plan is None:
            return
        durable = job.persist_health.newest_step
        if durable is not None and durable >= recovery.plan.target_step:
            # The step was a checkpoint step: its periodic checkpoint committed before the plan came.
            self._stopped(job, recovery, durable, "by its periodic checkpoint", now)

    def on_worker_event(self, job: JobCore, event: Event, now: float) -> None:
        recovery = job.recovery
        if recovery is None or recovery.plan is None or event.step != recovery.plan.target_step:
            return
        if event.kind == ev.CHECKPOINT_SAVE:
            self._stopped(job, recovery, event.step, f"to {event.details.get('path')}", now)
        elif event.kind == ev.PERSIST_FAILED:
            self.fail(job, f"the checkpoint of step {event.step} failed on rank {event.rank}: "
                           f"{event.details.get('reason')}", None, now)

    def _stopped(self, job: JobCore, recovery: ActiveRecovery, step: int, where: str, now: float) -> None:
        job.finish(JobState.STOPPED, EXIT_STOPPED,
                   f"stopped ({recovery.fault.detail}) with step {step} persisted {where}"
                   "; run the job again with the same checkpoint directory to resume there", now)

    def fail(self, job: JobCore, why: str, fault: Fault | None, now: float) -> None:
        """Nothing to fall back to: the job is cancelled, and its newest durable checkpoint is the last
        one the job committed before the stop."""
        recovery = job.recovery
        assert recovery is not None
        job.emit(ev.RECOVERY_FAILED, generation=job.generation, details={"strategy": self.name, "why": why})
        durable = job.persist_health.newest_step
        newest = f"step {durable}" if durable is not None else "none"
        job.finish(JobState.CANCELLED, EXIT_CANCELLED,
                   f"stop requested ({recovery.fault.detail}) but the newest step could not be persisted: {why}; "
                   f"newest durable checkpoint: {newest}", now)
