"""Process-level recovery: only the failed processes restart, the others keep their memory.

Runs in the controller, inside the job machine. ``ProcessRecovery`` is the execution shared
by retry, recover-in-place, recover, elastic training and the dump: a new generation is
formed from the survivors (who check in with the committed step they hold) and the
newcomers (restarted ranks, or a lost node's ranks on its returning or adopting agent);
once everyone has checked in, the plan names the step, the source replica and the
receivers. A second fault it can take in is absorbed; otherwise it fails and the chain
goes on with the next strategy in the chain that applies to what is known now.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from undying import events as ev
from undying.controller.recovery import ActiveRecovery
from undying.controller.strategies.base import (
    Attempt,
    Executor,
    RecoveryContext,
    rescheduling_off,
    strategy_enabled,
    within_budget,
)
from undying.controller.strategies.resize import shrink
from undying.faults import PROCESS_FAULTS, Fault, FaultReason
from undying.protocol import PlanAction
from undying.strategy_names import StrategyName

if TYPE_CHECKING:
    from undying.controller.job import JobCore


class ProcessRecovery(Executor):
    """The execution every process-level strategy shares; subclasses say when they apply. A failed
    one falls back in MindCluster's order (``Executor.fallback``): a failed recover-in-place goes on
    to recover, elastic training, dump, then a job restart, each only if it applies to what is known now."""

    begin_event = ev.RECOVERY_BEGIN  # what its start is logged as (the dump: dump_begin)

    # ---------------------------------------------------------------- start

    def start(self, job: JobCore, attempt: Attempt, now: float) -> None:
        fault, lost = attempt.fault, set(attempt.lost)
        old_generation = job.generation
        members = job.membership.members
        survivors = set(members) - lost
        recovery = ActiveRecovery(self.name, fault, old_generation, old_generation + 1, list(members),
                                  survivors=survivors, started=now, deadline=now + self.deadline(job.deadlines),
                                  tried=set(attempt.excluded))
        job.begin_recovery(recovery)
        self.gather_newcomers(job, recovery, lost, now, attempt.excluded)
        details: dict[str, Any] = {"strategy": self.name, "old_generation": old_generation,
                                   "survivors": sorted(survivors), "newcomers": sorted(recovery.newcomers),
                                   "awaited_nodes": sorted(recovery.awaited_nodes)}
        if recovery.may_shrink:
            details["shrink_after"] = round(recovery.reschedule_deadline - now, 3)
        job.emit(self.begin_event, generation=job.generation, step=fault.step, details=details)

    def gather_newcomers(self, job: JobCore, recovery: ActiveRecovery, lost: set[int], now: float,
                         excluded: frozenset[StrategyName]) -> None:
        """Restart the lost ranks: at once on a live node, on a lost node once its agent (or a spare) is back."""
        membership = job.membership
        recovery.newcomers = set(lost)
        lost_nodes = {membership.ranks[rank].node for rank in lost}
        recovery.awaited_nodes = {node for node in lost_nodes if not membership.node_alive(node)}
        for node in sorted(lost_nodes - recovery.awaited_nodes):
            job.replace(node, sorted(r for r in lost if membership.ranks[r].node == node), now)
        job.adopt_spares_for(recovery.awaited_nodes, now)
        if recovery.awaited_nodes and StrategyName.ELASTIC not in excluded \
                and strategy_enabled(job.spec, StrategyName.ELASTIC):
            # A lost node gets wait_reschedule_timeout to come back; after that the job trains on
            # without it (at once if a recover already waited for it).
            waited_already = self.name == StrategyName.ELASTIC and StrategyName.RECOVER in excluded
            # A node that announced its leave (SIGTERM: preempted, drained) is not waited for,
            # unless a spare was just ordered to take its place: that spare is the node coming back.
            spare_coming = any(membership.being_adopted(node) for node in recovery.awaited_nodes)
            planned_leave = recovery.fault.planned and not spare_coming
            wait = 0.0 if waited_already or planned_leave else job.deadlines.reschedule_wait
            recovery.may_shrink = True
            recovery.reschedule_deadline = now + wait
            recovery.deadline += wait

    # ---------------------------------------------------------------- progress

    def progress(self, job: JobCore, now: float) -> None:
        recovery = job.recovery
        assert recovery is not None
        membership = job.membership
        finished = sorted(rank for rank in recovery.survivors if membership.ranks[rank].done)
        if finished:
            self.fail(job, f"survivor(s) {finished} already finished training", None, now)
            return
        fault = job.detector.find(now, job.generation)
        if fault is not None and not self.absorb(job, fault, recovery, now):
            self.fail(job, f"second fault during {recovery.strategy}: {fault.describe()}", fault, now)
            return
        job.adopt_spares_for(recovery.awaited_nodes, now)
        for node in sorted(recovery.awaited_nodes):
            if membership.node_alive(node):
                recovery.awaited_nodes.discard(node)
                job.replace(node, sorted(r for r in recovery.newcomers if membership.ranks[r].node == node), now)
        if recovery.awaited_nodes and recovery.may_shrink and now >= recovery.reschedule_deadline:
            refused = shrink(job, recovery, now)
            if refused is not None:
                self.fail(job, refused, None, now)
                return
        if recovery.plan is None and recovery.ready():
            self.publish_plan(job, recovery, now)
        elif now > recovery.deadline:
            waiting = recovery.missing() or sorted(recovery.awaited_nodes)
            self.fail(job, f"{recovery.strategy} timed out waiting for {waiting}", None, now)

    def publish_plan(self, job: JobCore, recovery: ActiveRecovery, now: float) -> None:
        membership = job.membership
        plan = recovery.make_plan()
        job.publish(plan)
        job.emit(ev.RECOVERY_PLAN, generation=plan.generation, step=plan.target_step,
                 details={"strategy": plan.strategy, "action": plan.action, "source_rank": plan.source_rank,
                          "receivers": plan.receivers, "world_size": plan.world_size,
                          "seconds": round(now - recovery.started, 4)})
        if plan.action != PlanAction.RESUME:
            return  # the dump's source (or, at a stop, every rank) writes; the job goes on once it is committed
        old_world = len(membership.members)
        membership.members = list(plan.members)
        membership.ranks = {rank: membership.ranks[rank] for rank in membership.members}
        for rank in recovery.survivors | recovery.newcomers:
            membership.ranks[rank].step = plan.target_step
            membership.ranks[rank].step_known = True
            membership.ranks[rank].last_progress = None  # re-armed by the first step after the repair
        if recovery.grow:
            job.emit(ev.ELASTIC_GROW, generation=plan.generation, step=plan.target_step,
                     details={"old_world_size": old_world, "new_world_size": len(membership.members),
                              "seconds": round(now - recovery.started, 4)})
        job.end_recovery()

    def absorb(self, job: JobCore, fault: Fault, recovery: ActiveRecovery, now: float) -> bool:
        """A second fault that the running recovery can take in: a survivor's process died before
        it checked in (it becomes a replacement too), or the same fault seen twice."""
        if fault.reason == FaultReason.STEP_FAILED:
            return True
        if fault.rank is not None and fault.rank not in recovery.survivors | recovery.newcomers:
            return True  # a rank already counted as lost when the recovery began
        if recovery.plan is not None or recovery.strategy == StrategyName.DUMP or fault.rank is None:
            return False
        rank = fault.rank
        record = job.membership.ranks[rank]
        if rank in recovery.newcomers and record.spawn_generation < recovery.generation:
            return True  # the old process of a rank already being replaced
        if fault.reason in PROCESS_FAULTS and rank in recovery.survivors and rank not in recovery.checked_in \
                and job.membership.node_alive(record.node) \
                and strategy_enabled(job.spec, StrategyName.RECOVER_IN_PLACE):
            recovery.survivors.discard(rank)
            recovery.newcomers.add(rank)
            if recovery.strategy == StrategyName.RETRY:
                job.hand_over(StrategyName.RECOVER_IN_PLACE,
                              f"rank {rank}'s process is gone: it restarts on its node")
            job.replace(record.node, [rank], now)
            return bool(recovery.survivors)
        return False

    def fail(self, job: JobCore, why: str, fault: Fault | None, now: float) -> None:
        """The recovery cannot finish: log it and let the chain decide again, on the newest fault,
        without the strategies tried for it. Its newcomers hold no state yet: they count as lost."""
        recovery = job.recovery
        assert recovery is not None
        job.emit(ev.RECOVERY_FAILED, generation=job.generation, details={"strategy": recovery.strategy, "why": why})
        job.count_fault(FaultReason.RECOVERY_FAILED)
        job.end_recovery()
        tried = self.fallback(frozenset(recovery.tried))
        job.act_on(fault or recovery.fault, now, tried, stateless=set(recovery.newcomers))


class Retry(ProcessRecovery):
    """Re-run the failed step in the same processes after rebuilding the process group."""

    name = StrategyName.RETRY
    max_retries_per_step = 2  # how often the same step may be retried before the chain moves on

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        if fault.reason != FaultReason.STEP_FAILED or context.lost_ranks:
            return "a process is gone or hung"
        if context.retries_at_step >= self.max_retries_per_step:
            return f"step already retried {context.retries_at_step} times"
        return within_budget(context)

    def start(self, job: JobCore, attempt: Attempt, now: float) -> None:
        step = job.membership.committed_step()
        job.count_retry(step)
        super().start(job, attempt, now)


class RecoverInPlace(ProcessRecovery):
    """Restart only the failed process, on its own node; everyone else keeps its memory."""

    name = StrategyName.RECOVER_IN_PLACE

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        if fault.reason == FaultReason.AGENT_LOST:
            return "the node itself is lost"
        if not context.lost_ranks:
            return "no process to restart"
        if fault.node is not None and fault.node not in context.alive_nodes:
            return "the failed rank's node is not alive"
        if context.survivors() < 1:
            return "no healthy replica holds the state"
        return context.mesh_refusal(self.name) or within_budget(context)


class Recover(ProcessRecovery):
    """Replace a lost node (pod rescheduling): only that node's processes start."""

    name = StrategyName.RECOVER

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        if fault.reason != FaultReason.AGENT_LOST:
            return "not a lost node"
        if context.spec.pod_rescheduling != "on":
            return "pod_rescheduling is off"
        if (off := rescheduling_off(context)) is not None:
            return off
        if context.survivors() < 1:
            return "no healthy replica holds the state"
        return context.mesh_refusal(self.name) or within_budget(context)
