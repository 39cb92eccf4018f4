"""Recovery strategies as small policy objects behind one interface, and the chain that picks one.

Runs in the controller. MindCluster's order is retry -> recover-in-place -> recover
-> elastic-training -> dump -> exit, restricted to what the job enabled; job-level
restart (all workers, from the newest verified checkpoint) is the fallback under
all of them, bounded by ``max_restarts``. A strategy this version does not build
is accepted in the spec, reported at start, and skipped by the chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from undying.config import JobSpec
from undying.faults import Fault, FaultReason
from undying.strategy_names import CHAIN_ORDER, PROCESS_LEVEL, StrategyName

RETRY = StrategyName.RETRY
RECOVER_IN_PLACE = StrategyName.RECOVER_IN_PLACE
RECOVER = StrategyName.RECOVER
ELASTIC = StrategyName.ELASTIC
DUMP = StrategyName.DUMP
JOB_RESTART = StrategyName.JOB_RESTART
EXIT = StrategyName.EXIT
# How often the same step may be retried in place before the chain moves on.
MAX_RETRIES_PER_STEP = 2


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

    def survivors(self) -> int:
        return (self.world_size or self.spec.world_size) - len(self.lost_ranks)


@dataclass(frozen=True)
class Decision:
    strategy: str
    reason: str


class Strategy(Protocol):
    name: str

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        """None if this strategy can handle the fault, else why not (one short phrase)."""


def _budget(context: RecoveryContext) -> str | None:
    if context.restart_count >= context.spec.max_restarts:
        return f"max_restarts ({context.spec.max_restarts}) exhausted"
    return None


class Retry:
    """Re-run the failed step in the same processes after rebuilding the process group."""

    name = RETRY

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        if fault.reason != FaultReason.STEP_FAILED or context.lost_ranks:
            return "a process is gone or hung"
        if context.retries_at_step >= MAX_RETRIES_PER_STEP:
            return f"step already retried {context.retries_at_step} times"
        return _budget(context)


class RecoverInPlace:
    """Restart only the failed process, on its own node; everyone else keeps its memory."""

    name = RECOVER_IN_PLACE

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        if fault.reason == FaultReason.AGENT_LOST:
            return "the node itself is lost"
        if not context.lost_ranks:
            return "no process to restart"
        if fault.node is not None and fault.node not in context.alive_nodes:
            return "the failed rank's node is not alive"
        if context.survivors() < 1:
            return "no healthy replica holds the state"
        return _budget(context)


class Recover:
    """Replace a lost node (pod rescheduling): only that node's processes start."""

    name = RECOVER

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        if fault.reason != FaultReason.AGENT_LOST:
            return "not a lost node"
        if context.spec.pod_rescheduling != "on":
            return "pod_rescheduling is off"
        if context.survivors() < 1:
            return "no healthy replica holds the state"
        return _budget(context)


class Elastic:
    """Train on without a lost node (fewer data-parallel replicas, same global batch) once it has
    not come back within ``wait_reschedule_timeout``; grow back when it returns."""

    name = ELASTIC

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        if not context.lost_nodes:
            return "no node is lost (its agent can restart the process)"
        if context.survivors() < 1:
            return "no healthy replica holds the state"
        nodes_left = len(context.alive_nodes)
        if nodes_left < context.spec.fewest_nodes:
            return f"{nodes_left} node(s) left, below min_nodes ({context.spec.fewest_nodes})"
        return _budget(context)


class Dump:
    """The dying checkpoint: a healthy replica writes the committed state, then the job restarts."""

    name = DUMP

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        if context.survivors() * 2 <= context.spec.world_size:
            return "no more than half of the ranks are healthy"
        return _budget(context)


class JobRestart:
    """Restart every worker on every node from the newest verified checkpoint."""

    name = JOB_RESTART

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        return _budget(context)


class Exit:
    """Stop the job with a non-zero exit."""

    name = EXIT

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        return None


# Strategies this version carries out. The others are validated and reported, then skipped.
BUILT: dict[str, Strategy] = {
    RETRY: Retry(), RECOVER_IN_PLACE: RecoverInPlace(), RECOVER: Recover(), ELASTIC: Elastic(), DUMP: Dump(),
}


def effective_chain(spec: JobSpec) -> list[Strategy]:
    """The strategies the controller will actually try, in order."""
    enabled = spec.recover_strategy if spec.process_recover else []
    chain: list[Strategy] = [BUILT[name] for name in CHAIN_ORDER if name in enabled and name in BUILT]
    return [*chain, JobRestart(), Exit()]


def unbuilt_strategies(spec: JobSpec) -> list[str]:
    return [name for name in spec.process_level_strategies() if name not in BUILT]


def describe_chain(spec: JobSpec) -> str:
    """One line for the start banner: what was asked and what will be used."""
    used = " -> ".join(strategy.name for strategy in effective_chain(spec))
    missing = unbuilt_strategies(spec)
    note = f" ({', '.join(missing)}: not built in this version, skipped)" if missing else ""
    return f"recovery: {used}{note}"


def decide(fault: Fault, context: RecoveryContext) -> Decision:
    """Walk the chain; the first strategy that applies wins."""
    refusals = []
    for strategy in effective_chain(context.spec):
        if strategy.name in context.excluded:
            refusals.append(f"{strategy.name}: already failed")
            continue
        if strategy.name in (*PROCESS_LEVEL, DUMP) and context.survivors_restoring:
            refusals.append(f"{strategy.name}: survivors {sorted(context.survivors_restoring)} still restoring")
            continue
        why_not = strategy.applies(fault, context)
        if why_not is None:
            reason = "; ".join(refusals) if refusals else fault.describe()
            return Decision(strategy.name, reason)
        refusals.append(f"{strategy.name}: {why_not}")
    raise AssertionError("Exit always applies")
