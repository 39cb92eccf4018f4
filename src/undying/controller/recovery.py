"""One process-level recovery in progress: who it waits for, who checked in, and the plan it produces.

Runs in the controller. The executor that owns it (``strategy``: strategies/) records the
workers' check-ins to it (``Executor.check_in``). Survivors check in with the committed step
they hold; replacement ranks check in once started. When everyone expected has checked in,
the plan names the step everyone resumes from (the newest step a survivor holds: a step
some survivor applied cannot be undone, so the others catch up), one healthy replica at that
step as the source, and the ranks that receive the state from it (the newcomers and any
survivor that is a step behind). An elastic shrink drops a lost node's ranks from the
recovery's members; an elastic grow adds a returned node's ranks to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from undying.faults import Fault
from undying.protocol import Plan, PlanAction
from undying.strategy_names import StrategyName


@dataclass
class ActiveRecovery:
    strategy: StrategyName  # the strategy whose executor owns it (changed only by JobCore.hand_over)
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
        if self.awaited_nodes or not self.checked_in:
            return False
        # Every check-in asks, so the exact test (a scan of every rank) comes only once the counts
        # allow it: with 16k ranks checking in one by one, scanning each time took seconds.
        if len(self.checked_in) < len(self.survivors) or len(self.newcomers_ready) < len(self.newcomers):
            return False
        return not self.missing()

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
