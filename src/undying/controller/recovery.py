"""One process-level recovery in progress, the workers' check-ins to it, and the plan it produces.

Runs in the controller. Survivors check in with the committed step they hold; replacement
ranks check in once started. When everyone expected has checked in, the plan names the
step everyone resumes from (the newest step a survivor holds: a step some survivor
applied cannot be undone, so the others catch up), one healthy replica at that step as
the source, and the ranks that receive the state from it (the newcomers and any
survivor that is a step behind). An elastic shrink drops a lost node's ranks from the
recovery's members; an elastic grow adds a returned node's ranks to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from undying.controller.membership import RankRecord
from undying.controller.state import JobState
from undying.faults import Fault, FaultReason
from undying.protocol import Phase, Plan, PlanAction, RecoverRequest
from undying.strategy_names import StrategyName

if TYPE_CHECKING:
    from undying.controller.machine import JobMachine


@dataclass
class ActiveRecovery:
    strategy: StrategyName
    fault: Fault
    old_generation: int
    generation: int
    members: list[int]  # the ranks of the new generation, in process-group order
    survivors: set[int]  # ranks whose process keeps its memory
    newcomers: set[int] = field(default_factory=set)  # ranks restarted as replacements
    awaited_nodes: set[int] = field(default_factory=set)  # nodes whose agent must come back first
    checked_in: dict[int, int] = field(default_factory=dict)  # survivor rank -> committed step it holds
    newcomers_ready: set[int] = field(default_factory=set)
    plan: Plan | None = None
    started: float = 0.0
    deadline: float = 0.0
    may_shrink: bool = False  # elastic training enabled: awaited nodes may be dropped
    reschedule_deadline: float = 0.0  # when awaited nodes are dropped (wait_reschedule_timeout)
    grow: bool = False  # an elastic grow-back, not a fault
    tried: set[StrategyName] = field(default_factory=set)  # strategies that already failed for this fault
    retiring: int | None = None  # a switch: the node whose ranks stay until the others are at the boundary

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def action(self) -> PlanAction:
        if self.strategy == StrategyName.STOP:
            return PlanAction.PERSIST
        return PlanAction.DUMP if self.strategy == StrategyName.DUMP else PlanAction.RESUME

    def missing(self) -> list[int]:
        """Ranks the plan still waits for."""
        waiting = {rank for rank in self.survivors if rank not in self.checked_in}
        waiting |= self.newcomers - self.newcomers_ready
        return sorted(waiting)

    def ready(self) -> bool:
        return not self.awaited_nodes and not self.missing() and bool(self.checked_in)

    def make_plan(self) -> Plan:
        target = max(self.checked_in.values())
        source = min(rank for rank, step in self.checked_in.items() if step == target)
        behind = {rank for rank, step in self.checked_in.items() if step < target}
        self.plan = Plan(action=self.action, strategy=self.strategy, generation=self.generation,
                         world_size=self.world_size, target_step=target, source_rank=source,
                         receivers=sorted(self.newcomers | behind), reason=self.fault.describe(),
                         members=list(self.members),
                         holders=sorted(rank for rank, step in self.checked_in.items() if step == target))
        return self.plan


def note_check_in(job: JobMachine, now: float, request: RecoverRequest, record: RankRecord | None) -> None:
    """Record a worker's check-in where it belongs: the running recovery, a pending grow, or a new step failure."""
    if record is not None:
        record.phase = Phase.RECOVERING
        record.last_heartbeat = now
    recovery = job.recovery
    pending = job.pending_grow
    # News wakes the controller's loop at once (controller/core.py): a check-in that makes a decision
    # due (a new failure, the last awaited check-in) must not wait for the next tick. Only a change
    # is news: the check-ins waiting for a plan repeat themselves.
    was_ready = recovery is not None and recovery.plan is None and recovery.ready()
    if request.newcomer and recovery is None and pending is not None and request.generation == pending.generation:
        job.effects.news |= request.rank not in pending.newcomers_ready
        pending.newcomers_ready.add(request.rank)
    elif request.newcomer:
        if recovery is not None and request.generation == recovery.generation:
            recovery.newcomers_ready.add(request.rank)
        elif recovery is not None and request.rank in recovery.survivors and recovery.plan is None:
            # Alive but without the state (its own repair failed): it receives, it is not restarted.
            recovery.survivors.discard(request.rank)
            recovery.newcomers.add(request.rank)
            recovery.newcomers_ready.add(request.rank)
    elif recovery is not None and request.generation < recovery.generation and request.rank in recovery.survivors:
        recovery.checked_in[request.rank] = request.committed_step
        # A grow ends the generation at a step boundary; a rank that left it at one checked in, so a
        # step the others still have in flight can no longer commit anywhere: abort it.
        job.abort_generation = max(job.abort_generation, recovery.old_generation)
    elif job.state is JobState.RUNNING and request.generation == job.generation:
        job.effects.news |= job.detector.step_failed(now, Fault(
            FaultReason.STEP_FAILED, node=record.node if record else request.node, rank=request.rank,
            step=request.committed_step, detail=request.reason[:300], error=request.error,
            log_tail=tuple(request.error_tail)), request.generation)
    if recovery is not None and recovery.plan is None and recovery.ready() and not was_ready:
        job.effects.news = True

def plan_for(job: JobMachine, request: RecoverRequest) -> Plan:
    """The plan a checked-in worker leaves with (WAIT: ask again)."""
    recovery = job.recovery
    if recovery is not None:
        if recovery.plan is None:
            return Plan(action=PlanAction.WAIT)
        # A newcomer's rank is in the plan for its new process only: the old one (a switched node's
        # rank, checked in at the boundary) has no part in it.
        in_plan = request.rank in recovery.checked_in or (request.rank in recovery.newcomers and request.newcomer)
        return _stamped(job, recovery.plan) if in_plan else Plan(action=PlanAction.EXIT,
                                                                  reason="not part of this recovery")
    if job.state is JobState.RUNNING:
        formed = job.plans.get(job.generation)
        # The plan was published while this worker was between two polls.
        fits = request.generation < job.generation or (request.newcomer and request.generation == job.generation)
        return _stamped(job, formed) if formed is not None and fits else Plan(action=PlanAction.WAIT)
    if job.state in (JobState.STOPPING, JobState.RESTARTING) or job.state.terminal:
        return Plan(action=PlanAction.EXIT, reason=f"job {job.state.value}")
    return Plan(action=PlanAction.WAIT)

def _stamped(job: JobMachine, plan: Plan) -> Plan:
    return replace(plan, store=job.store_address, rng_stores=list(job.rng_stores))
