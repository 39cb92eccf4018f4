"""Elastic training: train on without a lost node that did not come back, grow back when it returns.

Runs in the controller, inside the job machine. The recovery itself is the process-level one
(``process.py``) with the awaited nodes' ranks dropped once ``wait_reschedule_timeout`` passes
(``resize.shrink``: a recover that waited for the node hands the recovery over to elastic
training then); the global batch stays ``world_size`` slots (the workers' loader and
gradient sync weight the replicas). The grow-back runs while the job trains (``while_running``, ``resize``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from undying.controller.strategies.base import RecoveryContext, within_budget
from undying.controller.strategies.process import ProcessRecovery
from undying.controller.strategies.resize import grow_if_nodes_returned
from undying.faults import Fault
from undying.strategy_names import StrategyName

if TYPE_CHECKING:
    from undying.controller.job import JobCore


class Elastic(ProcessRecovery):
    """Train on without a lost node (fewer data-parallel replicas, same global batch) once it has
    not come back within ``wait_reschedule_timeout``; grow back when it returns."""

    name = StrategyName.ELASTIC

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        if not context.lost_nodes:
            return "no node is lost (its agent can restart the process)"
        if context.survivors() < 1:
            return "no healthy replica holds the state"
        nodes_left = len(context.alive_nodes)
        if nodes_left < context.spec.fewest_nodes:
            return f"{nodes_left} node(s) left, below min_nodes ({context.spec.fewest_nodes})"
        return context.mesh_refusal(self.name) or within_budget(context)

    def while_running(self, job: JobCore, now: float) -> None:
        """While the job trains shrunk: bring back the ranks of a dropped node whose agent returned."""
        grow_if_nodes_returned(job, now)
