"""What every recovery strategy is: one executor behind one interface, and what it may look at.

Runs in the controller, inside the job machine. An executor owns its strategy whole:
whether it applies to a fault (``applies``), how it starts (``start``), what it does while
time passes (``progress``), how long it may take (``deadline``), and what the chain skips
once it failed (``fallback``: only what was tried, so the chain falls through in order). The
chain that walks them is in ``__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from undying.config import JobSpec
from undying.controller.deadlines import Deadlines
from undying.events import Event
from undying.faults import Fault
from undying.strategy_names import StrategyName

if TYPE_CHECKING:
    from undying.controller.machine import JobMachine


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
    strategy: StrategyName
    reason: str


@dataclass(frozen=True)
class Attempt:
    """A strategy chosen for one fault: what it recovers from, and why the chain chose it."""

    fault: Fault
    lost: frozenset[int]  # the ranks whose process is gone or hung
    excluded: frozenset[StrategyName]  # strategies that already failed for this fault
    reason: str  # the chain's reason (the refusals of the strategies before it, or the fault)


class Executor(Protocol):
    """One recovery strategy, from the decision to its end."""

    name: StrategyName
    # Process-level strategies (and the dump) need a survivor that holds a committed step.
    needs_committed_survivors: bool

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        """None if this strategy can handle the fault, else why not (one short phrase)."""

    def start(self, job: JobMachine, attempt: Attempt, now: float) -> None:
        """Carry out the decision: order what must start or stop, and enter the state that tracks it."""

    def progress(self, job: JobMachine, now: float) -> None:
        """Time passed while this strategy's recovery is the job's state: advance it, finish or fail it."""

    def on_worker_event(self, job: JobMachine, event: Event, now: float) -> None:
        """A worker's event arrived while this strategy's recovery runs."""

    def deadline(self, deadlines: Deadlines) -> float:
        """Seconds the recovery may take from its start before it fails."""

    def fallback(self, tried: frozenset[StrategyName]) -> frozenset[StrategyName]:
        """The strategies the chain skips once this one failed for a fault (``tried``: those that
        already failed for it): only strategies that were tried, so the chain falls through in order."""


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
