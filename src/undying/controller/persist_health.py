"""Whether the job's checkpoints reach storage: each failed T2 checkpoint said once, with what is at stake.

Runs in the controller, inside the job machine. Every rank reports its own persistence failures
(``persist_failed``: a full disk, a root it cannot write, a file missing at commit); the committing
rank reports each committed checkpoint (``checkpoint_save``). For each step whose checkpoint failed
the machine logs one ``checkpoint_failed`` event, which the console prints: the first rank's cause,
and from the second failure in a row a warning with the newest durable checkpoint's step and age
(a restart after losing every node would go back there, or to step 0 when there is none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WARN_AFTER = 2  # failed checkpoints in a row before the warning names what a full restart would lose


@dataclass
class PersistHealth:
    """The newest durable T2 checkpoint and the failures since."""

    newest_step: int | None = None
    newest_at: float | None = None  # monotonic time of its commit
    failed_in_row: int = 0
    failed_steps: set[int] = field(default_factory=set)  # steps already reported since the last commit

    def saved(self, step: int, now: float) -> None:
        if self.newest_step is None or step >= self.newest_step:
            self.newest_step, self.newest_at = step, now
        self.failed_in_row = 0
        self.failed_steps.clear()

    def failed(self, step: int, rank: int | None, reason: str, now: float) -> dict[str, Any] | None:
        """A rank's failure to persist ``step``: the ``checkpoint_failed`` details, or None if this
        step's failure was already reported (by another rank)."""
        if step in self.failed_steps:
            return None
        self.failed_steps.add(step)
        self.failed_in_row += 1
        details: dict[str, Any] = {"rank": rank, "reason": reason, "failed_in_row": self.failed_in_row,
                                   "newest_durable_step": self.newest_step,
                                   "newest_durable_age": None if self.newest_at is None
                                   else round(now - self.newest_at, 1),
                                   "warning": self.failed_in_row >= WARN_AFTER}
        return details


def failed_checkpoint_line(step: int | None, details: dict[str, Any]) -> str:
    """The console's line for one failed checkpoint (and, when repeated, what is at stake)."""
    line = f"checkpoint of step {step} NOT persisted (rank {details.get('rank')}: {details.get('reason')})"
    if not details.get("warning"):
        return line
    newest, age = details.get("newest_durable_step"), details.get("newest_durable_age")
    if newest is None:
        stake = "no checkpoint has reached storage yet: a restart after losing every node starts from step 0"
    else:
        stake = f"the newest durable checkpoint is step {newest}, {_age(age)} old"
    return f"{line}\nWARNING: {details.get('failed_in_row')} checkpoints in a row failed; {stake}"


def _age(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "of unknown age"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
