"""The recovery chain: which strategy handles a fault, and the executors that carry each one out.

Runs in the controller, inside the job machine. MindCluster's order is retry ->
recover-in-place -> recover -> elastic-training -> dump -> exit, restricted to what the job
enabled; job-level restart (all workers, from the newest verified checkpoint) is the fallback
under all of them, bounded by ``max_restarts``. Each strategy is one executor
(``base.Executor``): ``process.py`` (retry, recover-in-place, recover), ``elastic.py``,
``dump.py``, ``job_restart.py`` (job restart, exit); ``stop.py`` and ``switch.py`` are
executors the chain never picks (a requested stop, a suspect node moved to a spare). The job
machine asks the executor that owns what the job does (``executor_for(job.active_strategy())``)
and, while the job trains, every executor's ``while_running``; it names none of them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from undying import events as ev
from undying.config import JobSpec
from undying.controller.crash_loop import root_cause_details, stop_message
from undying.controller.state import EXIT_FAILED, JobState
from undying.controller.strategies.base import Attempt, Decision, Executor, RecoveryContext, strategy_enabled
from undying.controller.strategies.dump import Dump
from undying.controller.strategies.elastic import Elastic
from undying.controller.strategies.job_restart import Exit, JobRestart
from undying.controller.strategies.process import Recover, RecoverInPlace, Retry
from undying.controller.strategies.stop import GracefulStop
from undying.controller.strategies.switch import Switch
from undying.faults import PROCESS_FAULTS, Fault, FaultReason
from undying.protocol import Phase
from undying.strategy_names import CHAIN_ORDER, StrategyName

if TYPE_CHECKING:
    from undying.controller.job import JobCore

__all__ = ["BUILT", "Attempt", "Decision", "Executor", "RecoveryContext", "act_on", "decide", "describe_chain",
           "effective_chain", "executor_for", "executors", "handle_fault", "never_started", "unbuilt_strategies"]

JOB_RESTART_EXECUTOR = JobRestart()
EXIT_EXECUTOR = Exit()
STOP_EXECUTOR = GracefulStop()
# Strategies this version carries out. The others are validated and reported, then skipped.
BUILT: dict[StrategyName, Executor] = {
    StrategyName.RETRY: Retry(), StrategyName.RECOVER_IN_PLACE: RecoverInPlace(), StrategyName.RECOVER: Recover(),
    StrategyName.ELASTIC: Elastic(), StrategyName.DUMP: Dump(),
}
# Every executor, in the order the job machine asks them while the job trains (``Executor.while_running``:
# an elastic grow-back before a switch, which waits while the grow runs).
_EVERY: dict[StrategyName, Executor] = {**BUILT, StrategyName.JOB_RESTART: JOB_RESTART_EXECUTOR,
                                        StrategyName.EXIT: EXIT_EXECUTOR, StrategyName.STOP: STOP_EXECUTOR,
                                        StrategyName.SWITCH: Switch()}


def executor_for(name: str) -> Executor:
    return _EVERY[StrategyName(name)]


def executors() -> list[Executor]:
    """Every executor, in the order the job machine asks them while the job trains."""
    return list(_EVERY.values())


def effective_chain(spec: JobSpec) -> list[Executor]:
    """The strategies the controller will actually try, in order."""
    chain = [BUILT[name] for name in CHAIN_ORDER if name in BUILT and strategy_enabled(spec, name)]
    return [*chain, JOB_RESTART_EXECUTOR, EXIT_EXECUTOR]


def unbuilt_strategies(spec: JobSpec) -> list[str]:
    return [name for name in spec.process_level_strategies() if name not in BUILT]


def never_started(spec: JobSpec) -> dict[str, str]:
    """The strategies of the chain that no fault can start under ``spec``, each with why: the banner
    lists only the others. (A listed ``recover`` without the settings it needs is refused by the
    spec itself, config/model.py.)"""
    if spec.max_restarts == 0:  # every strategy but exit spends one of max_restarts (base.within_budget)
        return {strategy.name: "max_restarts is 0" for strategy in effective_chain(spec) if strategy is not EXIT_EXECUTOR}
    if spec.fault_scheduling == "off":  # base.rescheduling_off
        return {JOB_RESTART_EXECUTOR.name: "fault_scheduling is off"}
    return {}


def describe_chain(spec: JobSpec) -> str:
    """One line for the start banner: the strategies that will be tried, in order, and those left out."""
    idle = never_started(spec)
    used = " -> ".join(strategy.name for strategy in effective_chain(spec) if strategy.name not in idle)
    notes = [f"{', '.join(missing)}: not built in this version, skipped"] if (missing := unbuilt_strategies(spec)) else []
    for reason in dict.fromkeys(idle.values()):
        notes.append(f"{', '.join(name for name, why in idle.items() if why == reason)}: never started, {reason}")
    return f"recovery: {used}" + (f" ({'; '.join(notes)})" if notes else "")


def decide(fault: Fault, context: RecoveryContext) -> Decision:
    """Walk the chain; the first strategy that applies wins."""
    refusals = []
    for strategy in effective_chain(context.spec):
        if strategy.name in context.excluded:
            refusals.append(f"{strategy.name}: already failed")
            continue
        if strategy.needs_committed_survivors and context.survivors_restoring:
            refusals.append(f"{strategy.name}: survivors {sorted(context.survivors_restoring)} still restoring")
            continue
        why_not = strategy.applies(fault, context)
        if why_not is None:
            reason = "; ".join(refusals) if refusals else fault.describe()
            return Decision(strategy.name, reason)
        refusals.append(f"{strategy.name}: {why_not}")
    raise AssertionError("Exit always applies")


def handle_fault(job: JobCore, fault: Fault, now: float) -> None:
    """A fault seen while the generation trains: log it, then let the chain act on it."""
    if fault.reason in PROCESS_FAULTS:
        # Its own last beat may predate the step it failed in; every rank is in the same step, and the
        # furthest any of them has reported is the step in flight.
        fault = replace(fault, step=max([fault.step or 0, *job.membership.known_steps()]))
    job.count_fault(fault.reason)
    job.await_grow(None)  # its starting ranks are told to exit when they ask for a plan
    job.detector.step_failures.clear()
    job.emit(ev.FAULT_DETECTED, node=fault.node, rank=fault.rank, step=fault.step, generation=job.generation,
             details={"reason": fault.reason, "exitcode": fault.exitcode, "signal": fault.signal,
                      "description": fault.describe(), "detail": fault.detail,
                      "repair_refused": fault.repair_refused})
    act_on(job, fault, now)


def act_on(job: JobCore, fault: Fault, now: float, excluded: frozenset[StrategyName] = frozenset(),
           stateless: set[int] | None = None) -> None:
    """Decide which strategy handles ``fault`` (skipping ``excluded``) and start it; ``stateless``:
    ranks alive or starting that hold no committed state (a failed recovery's newcomers)."""
    why_stop = job.crash_loop.verdict(fault)
    if why_stop is not None:
        stop_crash_loop(job, why_stop, now)
        return
    lost = _lost_ranks(job, fault) | (set(stateless or ()) & set(job.membership.members))
    step = job.membership.committed_step()
    decision = decide(fault, _context(job, lost, excluded, step))
    job.emit(ev.DECISION, generation=job.generation, step=fault.step,
             details={"strategy": decision.strategy, "reason": decision.reason,
                      "restart_count": job.restart_count, "max_restarts": job.spec.max_restarts,
                      "lost_ranks": sorted(lost)})
    attempt = Attempt(fault, frozenset(lost), excluded, decision.reason)
    executor_for(decision.strategy).start(job, attempt, now)


def begin_stop(job: JobCore, why: str, now: float) -> None:
    """The job was asked to stop: every rank persists the newest committed step first (stop.py)."""
    fault = Fault(FaultReason.STOP_REQUESTED, step=job.membership.committed_step(), detail=why)
    STOP_EXECUTOR.start(job, Attempt(fault, frozenset(), frozenset(), why), now)


def stop_crash_loop(job: JobCore, why: str, now: float) -> None:
    """The recoveries bring the job no further: stop it, naming the fault that started the loop."""
    root = job.crash_loop.root_cause()
    job.emit(ev.CRASH_LOOP, node=root.node, rank=root.rank, step=root.step, generation=job.generation,
             details=root_cause_details(root, why, len(job.crash_loop.streak) - 1))
    job.finish(JobState.FAILED, EXIT_FAILED, stop_message(root, why), now)


def _lost_ranks(job: JobCore, fault: Fault) -> set[int]:
    membership = job.membership
    extra: set[int] = set()
    if fault.reason == FaultReason.AGENT_LOST and fault.node is not None:
        extra |= set(membership.ranks_of(fault.node))
    if fault.reason in PROCESS_FAULTS and fault.rank is not None:
        extra.add(fault.rank)
    return membership.lost_ranks(extra)


def _context(job: JobCore, lost_ranks: set[int], excluded: frozenset[StrategyName], step: int) -> RecoveryContext:
    membership = job.membership
    lost_nodes = {membership.ranks[rank].node for rank in lost_ranks if rank in membership.ranks}
    restoring = {rank for rank, record in membership.ranks.items()
                 if rank not in lost_ranks and record.phase == Phase.STARTING
                 and record.spawn_generation == job.generation and job.generation not in job.plans}
    return RecoveryContext(job.spec, job.restart_count, frozenset(membership.alive_nodes()),
                           frozenset(lost_ranks), job.retries.get(step, 0), frozenset(excluded),
                           world_size=len(membership.members),
                           lost_nodes=frozenset(node for node in lost_nodes if not membership.node_alive(node)),
                           survivors_restoring=frozenset(restoring), mesh_shard=membership.mesh_shard,
                           mesh_peer_copies=membership.mesh_peer_copies)
