"""What a bad step leads to in the worker: a replay from the committed state, then a skip or a stop.

Runs in the worker, called by the step loop (runtime/step_loop.py) once a step's commit vote found it bad
(runtime/step_check.py): no rank applied it. The first time, every rank winds the step back as a
recovery's survivor does (gradients dropped; data position, RNG, registered objects and optimizer
hyperparameters as of the commit) and the loop yields the same step again. The replay draws the
same batch with the same random numbers, so a bad value that came from the data or the model comes
again, and one that came from the machine (a flipped bit, a failing device) does not. A clean replay
commits and is reported as transient: the controller names the rank whose value was bad, and may
switch its node out (``bad_step_transient: switch``). A replay that is bad again is skipped
(``bad_step_repeat: skip``: the step is committed without its update, its loaders past its batch)
or stops the job (``stop``: the controller ends it with the cause; this process waits to be stopped).

Every rank sees the same vote, so every rank takes the same path; the first member of the
generation speaks for the job (``bad_step``, naming the rank whose own checked value was bad when the
vote says there was one), and where several were, each of them for itself (``bad_value``).
"""

from __future__ import annotations

import sys
import time

from undying import events as ev
from undying.config import JobSpec
from undying.data import ResumableLoader
from undying.data.iterable import StatefulIterableLoader
from undying.runtime.event_sink import EventSink
from undying.runtime.membership import Membership
from undying.runtime.rng import restore_rng
from undying.runtime.step_check import GRAD_NORM, BadStep
from undying.runtime.training_state import TrainingState

REPLAY, SKIP, STOP = "replay", "skip", "stop"  # what a bad attempt leads to
REPLAYED = "replayed"  # the replay of a bad step committed: the first attempt's fault was transient
PARK_S = 1.0


class BadSteps:
    """The attempts of the step in flight that the vote found bad, and what each leads to."""

    def __init__(self, spec: JobSpec, state: TrainingState, membership: Membership, reporter: EventSink) -> None:
        self.spec = spec
        self.state = state
        self.membership = membership
        self.reporter = reporter
        self._bad_attempts: dict[int, int] = {}  # step -> its attempts found bad (the step in flight only)

    def after_bad(self, step: int, bad: BadStep) -> bool:
        """The vote found this attempt of ``step`` bad and nobody applied it. Winds the step back;
        returns True if the step is to be committed without its update (skipped), False to replay
        it. Does not return when the job stops."""
        attempt = self._bad_attempts.get(step, 0) + 1
        self._bad_attempts = {step: attempt}
        self.state.forget_failed_step()
        restore_rng(self.state.roll_back_step_in_flight())
        own = {name: str(value) for name, value in bad.own.items() if name != GRAD_NORM}
        if own and bad.named_count > 1:  # the vote named none: each says it is one
            self.reporter.emit(ev.BAD_VALUE, step=step, attempt=attempt, values=own)
        action = REPLAY if attempt == 1 else self.spec.bad_step_repeat
        if self.membership.group_rank == 0:
            self.reporter.emit(ev.BAD_STEP, step=step, attempt=attempt, cause=bad.cause, action=action,
                               ranks=bad.named, named_count=bad.named_count,
                               values={name: str(value) for name, value in bad.own.items()})
        if action == STOP:
            self._stop(step, bad)
        if action == SKIP:
            self._skip_batches()
            del self._bad_attempts[step]
            return True
        return False

    def committed(self, step: int) -> None:
        """``step`` committed: if an attempt of it was bad, the replay was clean (a transient fault)."""
        attempts = self._bad_attempts.pop(step, 0)
        if attempts and self.membership.group_rank == 0:
            self.reporter.emit(ev.BAD_STEP, step=step, attempt=attempts + 1, action=REPLAYED,
                               cause="the replay was clean: the first attempt's bad values were transient")

    def _skip_batches(self) -> None:
        """Move every loader past the step's batches without training on them. Not a draw of the
        loop's: the draw ledger (runtime/carried_batches.py) is not told."""
        iterables = [obj for obj in self.state.statefuls.values() if isinstance(obj, StatefulIterableLoader)]
        loaders: list[ResumableLoader | StatefulIterableLoader] = [*self.state.loaders, *iterables]
        for loader in loaders:
            draws, loader.draws = loader.draws, None
            try:
                for _ in loader.step_batches():
                    pass
            finally:
                loader.draws = draws

    def _stop(self, step: int, bad: BadStep) -> None:
        """The job stops (the first member's event tells the controller): wait to be stopped."""
        print(f"[undying rank {self.membership.rank}] step {step} was bad again when replayed ({bad.cause}); "
              f"the job stops (bad_step_repeat: stop)", file=sys.stderr, flush=True)
        while True:
            time.sleep(PARK_S)
