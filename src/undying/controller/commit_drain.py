"""A job restart's stop held while a survivor finishes committing a T2 checkpoint.

Runs in the controller, inside the job machine: the job restart's executor
(``strategies/job_restart.py``) starts one when it begins and ends it in its ``progress``;
the job machine feeds it the workers' checkpoint events while the restart owns the job.
"""

from __future__ import annotations

from dataclasses import dataclass

from undying import events as ev
from undying.controller.deadlines import Deadlines
from undying.controller.membership import Membership
from undying.controller.persist_health import PersistHealth
from undying.events import Event


@dataclass
class CommitDrain:
    """A job restart's stop orders held while the rank that commits ``step``'s T2 checkpoint (its
    persister busy with it, as its newest heartbeat said) finishes: every record is in, or it gives up."""

    step: int
    rank: int
    why: str  # the restart's fault, for its stop orders
    started: float
    until: float
    outcome: str = ""

    @classmethod
    def for_restart(cls, membership: Membership, health: PersistHealth, deadlines: Deadlines, why: str,
                    now: float) -> CommitDrain | None:
        """The commit to wait for: of a checkpoint newer than the newest durable one, not failed already."""
        for record in membership.ranks.values():
            step = record.committing
            if step and step > (health.newest_step or 0) and step not in health.failed_steps \
                    and record.exitcode is None and membership.node_alive(record.node):
                return cls(step, record.rank, why, now, now + deadlines.commit_drain)
        return None

    def worker_event(self, event: Event) -> None:
        if event.step == self.step and event.kind in (ev.CHECKPOINT_SAVE, ev.PERSIST_FAILED) and not self.outcome:
            self.outcome = "committed" if event.kind == ev.CHECKPOINT_SAVE else "failed"

    def over(self, membership: Membership, now: float) -> str:
        """Why the wait is over ("" while it is not)."""
        record = membership.ranks.get(self.rank)
        if self.outcome:
            return self.outcome
        if record is None or record.exitcode is not None or not membership.node_alive(record.node):
            return "its writer is gone"
        return "timed out" if now > self.until else ""
