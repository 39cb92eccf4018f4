"""What every recovery strategy is: one executor behind one interface, and what it may look at.

Runs in the controller, inside the job machine. An executor owns its strategy whole:
whether it applies to a fault (``applies``), how it starts (``start``), what it does while
time passes as long as it owns the job (``progress``) and while the job trains
(``while_running``), the workers' check-ins and events to what it owns (``check_in``,
``plan_for``, ``on_worker_event``), how long it may take (``deadline``), and what the chain
skips once it failed (``fallback``: only what was tried, so the chain falls through in order).
It changes the job through ``JobCore``'s methods (controller/job.py) and hands a recovery
to another executor only by ``JobCore.hand_over``. The chain that walks them is in ``__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from undying.config import JobSpec
from undying.controller.deadlines import Deadlines
from undying.controller.recovery import ActiveRecovery
from undying.events import Event
from undying.faults import Fault
from undying.protocol import Plan, PlanAction, RecoverRequest
from undying.sharded_support import mesh_refusal
from undying.strategy_names import StrategyName

if TYPE_CHECKING:
    from undying.controller.job import JobCore


@dataclass(frozen=True)
class RecoveryContext:
    """What a strategy may look at when deciding whether it applies."""

    spec: JobSpec
    restart_count: int
    alive_nodes: frozenset[int] = frozenset()
    lost_ranks: frozenset[int] = frozenset()  # ranks whose process is gone or hung
    retries_at_step: int = 0
    excluded: frozenset[str] = field(default_factory=frozenset)  # strategies that already failed for this fault
    world_size: int = 0  # ranks in the current generation (fewer than the spec's after an elastic shrink)
    lost_nodes: frozenset[int] = frozenset()  # nodes of lost ranks whose agent is gone
    # Survivors still loading the job's state at the start of a generation hold no committed step
    # a replica could be repaired from: only a job restart (from storage or T1) is correct then.
    survivors_restoring: frozenset[int] = frozenset()
    # A sharded job's mesh, as its ranks report it: ranks per replica (0: data parallel or not heard
    # yet) and whether a one-replica mesh's T1 snapshots are copied to the next node.
    mesh_shard: int = 0
    mesh_peer_copies: bool = False

    def survivors(self) -> int:
        return (self.world_size or self.spec.world_size) - len(self.lost_ranks)

    def mesh_refusal(self, strategy: StrategyName) -> str | None:
        """Why the job's sharded mesh cannot serve ``strategy`` (None: it can, or the job is data parallel)."""
        if not self.mesh_shard:
            return None
        replicate = (self.world_size or self.spec.world_size) // self.mesh_shard
        return mesh_refusal(strategy, replicate, self.spec.checkpoint.snapshot_interval != 0, self.mesh_peer_copies)


@dataclass(frozen=True)
class Decision:
    strategy: StrategyName
    reason: str


@dataclass(frozen=True)
class Attempt:
    """A strategy chosen for one fault: what it recovers from, and why the chain chose it."""

    fault: Fault
    lost: frozenset[int]  # the ranks whose process is gone or hung
    excluded: frozenset[StrategyName]  # strategies that already failed for this fault
    reason: str  # the chain's reason (the refusals of the strategies before it, or the fault)


class Executor:
    """One strategy, from the decision to its end: the shared defaults, which each executor overrides
    where its strategy differs."""

    name: StrategyName
    # Process-level strategies (and the dump) need a survivor that holds a committed step.
    needs_committed_survivors = True

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        """None if this strategy can handle the fault, else why not (one short phrase)."""
        raise NotImplementedError

    def start(self, job: JobCore, attempt: Attempt, now: float) -> None:
        """Carry out the decision: order what must start or stop, and enter the state that tracks it."""
        raise NotImplementedError

    def progress(self, job: JobCore, now: float) -> None:
        """Time passed while this executor owns what the job does: advance it, finish or fail it."""
        return None

    def while_running(self, job: JobCore, now: float) -> None:
        """Time passed while the job trains (no fault found): what this strategy starts by itself."""
        return None

    def on_worker_event(self, job: JobCore, event: Event, now: float) -> None:
        """A worker's event arrived while this executor owns what the job does."""
        return None

    def check_in(self, job: JobCore, recovery: ActiveRecovery, request: RecoverRequest, now: float) -> None:
        """A worker checks in to ``recovery``, which this executor owns (the job's recovery, or an
        elastic grow's ranks starting while the job trains): record it where it belongs."""
        # News wakes the controller's loop at once (controller/core.py): a check-in that makes a decision
        # due (the last awaited check-in) must not wait for the next tick. Only a change is news: the
        # check-ins waiting for a plan repeat themselves.
        if recovery is not job.recovery:  # a grow's returned rank, started while the survivors train
            job.effects.news |= request.rank not in recovery.newcomers_ready
            recovery.newcomers_ready.add(request.rank)
            return
        was_ready = recovery.plan is None and recovery.ready()
        if request.newcomer:
            if request.generation == recovery.generation:
                recovery.newcomers_ready.add(request.rank)
            elif request.rank in recovery.survivors and recovery.plan is None:
                # Alive but without the state (its own repair failed): it receives, it is not restarted.
                recovery.survivors.discard(request.rank)
                recovery.newcomers.add(request.rank)
                recovery.newcomers_ready.add(request.rank)
        elif request.generation < recovery.generation and request.rank in recovery.survivors:
            recovery.checked_in[request.rank] = request.committed_step
            # A grow ends the generation at a step boundary; a rank that left it at one checked in, so a
            # step the others still have in flight can no longer commit anywhere: abort it.
            job.abort_through(recovery.old_generation)
        if recovery.plan is None and recovery.ready() and not was_ready:
            job.effects.news = True

    def plan_for(self, job: JobCore, recovery: ActiveRecovery, request: RecoverRequest) -> Plan:
        """The plan a worker checked in to this executor's recovery leaves with (WAIT: ask again)."""
        if recovery.plan is None:
            return Plan(action=PlanAction.WAIT)
        # A newcomer's rank is in the plan for its new process only: the old one (a switched node's
        # rank, checked in at the boundary) has no part in it.
        in_plan = request.rank in recovery.checked_in or (request.rank in recovery.newcomers and request.newcomer)
        return stamped(job, recovery.plan) if in_plan else Plan(action=PlanAction.EXIT,
                                                                 reason="not part of this recovery")

    def deadline(self, deadlines: Deadlines) -> float:
        """Seconds the recovery may take from its start before it fails."""
        return deadlines.recovery

    def fallback(self, tried: frozenset[StrategyName]) -> frozenset[StrategyName]:
        """The strategies the chain skips once this one failed for a fault (``tried``: those that
        already failed for it): only strategies that were tried, so the chain falls through in order."""
        return tried | {self.name}


def stamped(job: JobCore, plan: Plan) -> Plan:
    """``plan`` as handed to a worker: with the store of its generation and where the RNG mirrors are."""
    return replace(plan, store=job.store_address, rng_stores=list(job.rng_stores))


def within_budget(context: RecoveryContext) -> str | None:
    """Why not, when every restart ``max_restarts`` allows is used up."""
    if context.restart_count >= context.spec.max_restarts:
        return f"max_restarts ({context.spec.max_restarts}) exhausted"
    return None


def rescheduling_off(context: RecoveryContext) -> str | None:
    """Why not, when the job asked for no rescheduling after a fault (``fault_scheduling: off``): no
    node is replaced and the job is not restarted; what recovers inside the running processes and
    nodes (retry, recover-in-place, an elastic shrink, the dying checkpoint) still may."""
    if context.spec.fault_scheduling == "off":
        return "fault_scheduling is off (nothing is rescheduled)"
    return None


def strategy_enabled(spec: JobSpec, name: StrategyName) -> bool:
    """The job asked for this strategy (process-level recovery on and the name in recover_strategy)."""
    return spec.process_recover and name in spec.recover_strategy
