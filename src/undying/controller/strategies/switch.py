"""The switch: a node that slows or corrupts the job hands its ranks to an idle spare at a step boundary.

Runs in the controller, inside the job machine. Not a recovery strategy (nothing failed, the chain
never picks it): the job machine starts it for a node ``suspects.py`` keeps (a straggler under
``straggler_strategy: switch``, a transient bad step under ``bad_step_transient: switch``) while the
job trains and a spare is idle. It is a planned leave onto a spare without a lost step: the running
generation ends at its next step boundary (every rank finishes its step in flight, as for a stop;
the first check-in aborts a straggler's step, so no step is half committed); once every other rank
has checked in, the node is retired (its agent is told to say hello again, which stops its workers,
and it joins as a spare that is never given ranks) and the spare adopts its place; its ranks start
there as newcomers and receive a live replica's state of the step every survivor holds, exactly as
``recover`` hands a lost node's ranks to a spare (strategies/process.py). It does not count
against ``max_restarts``. If it cannot finish (the spare fails, a second fault), the chain handles
what is known then, with the switched node counted as lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from undying import events as ev
from undying.controller.recovery import ActiveRecovery
from undying.controller.strategies.base import Attempt, RecoveryContext
from undying.controller.strategies.process import ProcessRecovery
from undying.faults import Fault, FaultReason
from undying.strategy_names import StrategyName

if TYPE_CHECKING:
    from undying.controller.job import JobCore


class Switch(ProcessRecovery):
    """Move one node's ranks to an idle spare at a step boundary."""

    name = StrategyName.SWITCH
    begin_event = ev.SWITCH_BEGIN

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        return "not a recovery"  # started by the job machine for a suspect node, never by the chain

    def while_running(self, job: JobCore, now: float) -> None:
        """While the job trains: switch a node ``job.suspects`` keeps, if a spare is idle for it."""
        due = job.suspects.next_switch(job.membership)
        if due is None:
            return
        node, why = due
        members = job.membership.members
        if not set(members) - set(job.membership.ranks_of(node)):
            return  # every rank is on it: no replica would be left to hand the state over
        fault = Fault(FaultReason.SWITCH, node=node, step=job.membership.committed_step(), detail=why)
        self.start(job, Attempt(fault, frozenset(), frozenset(), why), now)

    def start(self, job: JobCore, attempt: Attempt, now: float) -> None:
        membership = job.membership
        node = attempt.fault.node
        assert node is not None
        old_generation = job.generation
        members = list(membership.members)
        moving = {rank for rank in membership.ranks_of(node) if rank in members}
        recovery = ActiveRecovery(self.name, attempt.fault, old_generation, old_generation + 1, members,
                                  survivors=set(members) - moving, newcomers=moving, awaited_nodes={node},
                                  started=now, deadline=now + self.deadline(job.deadlines), retiring=node)
        # Each rank finishes its step in flight, then checks in.
        job.begin_recovery(recovery, at_boundary=True, counted=False)
        spare = membership.idle_spare()
        job.emit(self.begin_event, node=node, generation=job.generation, step=attempt.fault.step,
                 details={"why": attempt.reason, "spare": None if spare is None else spare.node,
                          "ranks": sorted(moving), "old_generation": old_generation})

    def progress(self, job: JobCore, now: float) -> None:
        recovery = job.recovery
        assert recovery is not None
        if recovery.retiring is not None:
            fault = job.detector.find(now, job.generation)
            if fault is not None and not self.absorb(job, fault, recovery, now):
                self.fail(job, f"second fault during the switch: {fault.describe()}", fault, now)
                return
            if not recovery.survivors <= set(recovery.checked_in):
                if now > recovery.deadline:
                    self.fail(job, f"the switch timed out waiting for {recovery.missing()}", None, now)
                return
            # Every other rank is at the step boundary: the node's ranks may go.
            job.retire_node(recovery.retiring, recovery.fault.detail, now)
            recovery.retiring = None
        super().progress(job, now)

    def fail(self, job: JobCore, why: str, fault: Fault | None, now: float) -> None:
        """The chain takes over, on the second fault or, without one, on the switched node as lost."""
        recovery = job.recovery
        assert recovery is not None
        node = recovery.fault.node
        if fault is None:
            fault = Fault(FaultReason.AGENT_LOST, node=node, step=job.membership.committed_step(),
                          detail=f"switched out: {why}", planned=True)
        if recovery.retiring is not None and node is not None:
            job.retire_node(node, recovery.fault.detail, now)  # it was being switched out: it stays out
        super().fail(job, why, fault, now)
