"""Recovery strategies as small policy objects behind one interface, and the chain that picks one.

Runs in the controller. MindCluster's order is retry -> recover-in-place -> recover
-> elastic-training -> dump -> exit, restricted to what the job enabled; job-level
restart (all workers, from the last checkpoint) is the fallback under all of them,
bounded by ``max_restarts``. A strategy that this version does not build yet is
accepted in the spec and reported at start, and the chain skips it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from undying.config import JobSpec

JOB_RESTART = "job-restart"
EXIT = "exit"

# The process-level strategies, in MindCluster's order of preference.
CHAIN_ORDER = ("retry", "recover-in-place", "recover", "elastic-training", "dump")


@dataclass(frozen=True)
class Fault:
    """What the controller saw go wrong."""

    reason: str  # worker_exit | agent_lost | heartbeat_missed | start_timeout
    node: int | None = None
    rank: int | None = None
    step: int | None = None
    exitcode: int | None = None
    signal: str | None = None

    def describe(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else f"node {self.node}"
        if self.reason == "worker_exit":
            how = f"killed by {self.signal}" if self.signal else f"exit code {self.exitcode}"
            return f"{where} exited ({how})"
        if self.reason == "agent_lost":
            return f"node {self.node} lost (agent gone)"
        if self.reason == "heartbeat_missed":
            return f"{where} missed its heartbeats (hang?)"
        return f"{where}: {self.reason}"


@dataclass(frozen=True)
class RecoveryContext:
    """What a strategy may look at when deciding whether it applies."""

    spec: JobSpec
    restart_count: int


@dataclass(frozen=True)
class Decision:
    strategy: str
    reason: str


class Strategy(Protocol):
    name: str

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        """None if this strategy can handle the fault, else why not (one short phrase)."""


class JobRestart:
    """Restart every worker on every node from the newest verified checkpoint."""

    name = JOB_RESTART

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        if context.restart_count >= context.spec.max_restarts:
            return f"max_restarts ({context.spec.max_restarts}) exhausted"
        return None


class Exit:
    """Stop the job with a non-zero exit."""

    name = EXIT

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        return None


# Strategies this version carries out. The others are validated and reported, then skipped.
BUILT: dict[str, Strategy] = {}


def effective_chain(spec: JobSpec) -> list[Strategy]:
    """The strategies the controller will actually try, in order."""
    chain: list[Strategy] = [BUILT[name] for name in CHAIN_ORDER if name in spec.recover_strategy and name in BUILT]
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
        why_not = strategy.applies(fault, context)
        if why_not is None:
            reason = "; ".join(refusals) if refusals else fault.describe()
            return Decision(strategy.name, reason)
        refusals.append(f"{strategy.name}: {why_not}")
    raise AssertionError("Exit always applies")
