"""Job-level restart and exit: the fallbacks under every process-level strategy.

Runs in the controller, inside the job machine. A restart stops every worker of the
generation, waits (up to ``node_return_timeout``) for every node's agent, adopting spares
for lost nodes, and starts the next generation from the newest verified checkpoint (in
node memory or storage); it counts against ``max_restarts``. A job that elastic training
has shrunk restarts at once with the members it has instead (``shrunk_restart_members``).
Two things come between the stop and the start: a survivor committing a T2 checkpoint whose
records are all in finishes it first (``CommitDrain``, at most ``commit_drain`` seconds: the
survivors leave their step at once, only the stop orders wait), and every node runs its health
check again once its workers are gone (agent/node_check.py; a node that fails is not given ranks:
fitness.py). Exit ends the job as failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from undying import events as ev
from undying.controller.commit_drain import CommitDrain
from undying.controller.deadlines import Deadlines
from undying.controller.state import EXIT_FAILED, JobState
from undying.controller.strategies.base import (
    Attempt,
    Executor,
    RecoveryContext,
    rescheduling_off,
    strategy_enabled,
    within_budget,
)
from undying.controller.strategies.resize import sharded_refusal
from undying.events import Event
from undying.faults import Fault
from undying.protocol import Order, OrderKind
from undying.strategy_names import StrategyName

if TYPE_CHECKING:
    from undying.controller.job import JobCore


def begin_job_restart(job: JobCore, why: str, now: float, count: bool = True) -> None:
    """Stop every worker; the next generation starts once they are gone and every node is back. The
    job restart's executor owns the job from here (stopping, restarting)."""
    job.begin_restart(StrategyName.JOB_RESTART, counted=count)
    job.emit(ev.RESTART_BEGIN, generation=job.generation, details={"restart_count": job.restart_count, "fault": why})
    job.hold_stop(CommitDrain.for_restart(job.membership, job.persist_health, job.deadlines, why, now))
    if job.commit_drain is None:
        stop_workers(job, why, now)


def stop_workers(job: JobCore, why: str, now: float) -> None:
    """Order every agent to stop its workers; each checks its node again once they are gone."""
    job.order_all(Order(kind=OrderKind.STOP, generation=job.generation, reason=why))
    for node in job.membership.nodes.values():
        node.check_due = node.alive and not node.standby and job.spec.node_check
    job.deadline_at(now + job.deadlines.stop)


def shrunk_restart_members(job: JobCore) -> list[int] | None:
    """The members a job restart of a shrunk elastic job starts with: the current members whose
    node is alive, if they span at least ``min_nodes`` nodes. None: restart every rank of the job,
    once every node is back (elastic training off, the job at full size, or too few nodes left).

    A dropped node whose agent is back (or a spare that adopted it) is not waited for nor started
    here: it joins after the restart by the elastic grow-back (``resize.grow_if_nodes_returned``),
    which hands it a live replica's state, so the restart keeps the members' node memory (T1)."""
    membership, spec = job.membership, job.spec
    if len(membership.members) >= spec.world_size or not strategy_enabled(spec, StrategyName.ELASTIC):
        return None
    members = [rank for rank in membership.members if membership.node_alive(membership.node_of(rank))]
    if len({membership.node_of(rank) for rank in members}) < spec.fewest_nodes:
        return None
    if sharded_refusal(job, members) is not None:  # a sharded job restarts on whole replicas only
        return None
    return members


class JobRestart(Executor):
    """Restart every worker on every node from the newest verified checkpoint."""

    name = StrategyName.JOB_RESTART
    needs_committed_survivors = False

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        return rescheduling_off(context) or within_budget(context)

    def start(self, job: JobCore, attempt: Attempt, now: float) -> None:
        begin_job_restart(job, attempt.fault.describe(), now)

    def progress(self, job: JobCore, now: float) -> None:
        membership = job.membership
        drain = job.commit_drain
        if job.state is JobState.STOPPING and drain is not None:
            outcome = drain.over(membership, now)
            if outcome:
                job.emit(ev.COMMIT_DRAIN, rank=drain.rank, step=drain.step, generation=job.generation,
                         details={"outcome": outcome, "seconds": round(now - drain.started, 3)})
                job.hold_stop(None)
                stop_workers(job, drain.why, now)
        elif job.state is JobState.STOPPING:
            still_running = [n.node for n in membership.nodes.values() if n.alive and n.running_workers()]
            checking = [n.node for n in membership.nodes.values() if n.alive and n.check_due]
            if (not still_running and not checking) or now > job.state_deadline:
                job.transition(JobState.RESTARTING)
                job.deadline_at(now + job.deadlines.node_return)
        elif job.state is JobState.RESTARTING:
            members = shrunk_restart_members(job)
            if members is not None:
                job.start_generation(now, members)
                return
            job.adopt_spares_for(set(range(job.spec.nnodes)), now)
            if membership.all_nodes_alive():
                job.start_generation(now)
            elif now > job.state_deadline:
                job.finish(JobState.FAILED, EXIT_FAILED, job.membership.missing_message("restart", job.spec.node_return_timeout), now)

    def on_worker_event(self, job: JobCore, event: Event, now: float) -> None:
        if job.commit_drain is not None:
            job.commit_drain.worker_event(event)

    def deadline(self, deadlines: Deadlines) -> float:
        return deadlines.commit_drain + deadlines.stop + deadlines.node_return


class Exit(Executor):
    """Stop the job with a non-zero exit."""

    name = StrategyName.EXIT
    needs_committed_survivors = False

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        return None

    def start(self, job: JobCore, attempt: Attempt, now: float) -> None:
        message = f"{attempt.fault.describe()}; no recovery left: {attempt.reason}"
        job.finish(JobState.FAILED, EXIT_FAILED, message, now)

    def deadline(self, deadlines: Deadlines) -> float:
        return 0.0

    def fallback(self, tried: frozenset[StrategyName]) -> frozenset[StrategyName]:
        return tried
