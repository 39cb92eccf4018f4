"""The loop behind ``ft.steps()``: where it starts, one step transaction after another, and what
follows each step's end (commit, replay of a bad step, recovery).

Runs in the worker, on the training thread. ``Runtime`` (runtime/core.py) builds one ``StepLoop``
from its parts; the loop takes up its starting step (a restore, the script's own checkpoint, or a
replacement's repair), yields each step to the script, and after it commits (or hands a failed
step to the recovery client, runtime/recovery_client.py) moves on or yields the same step again.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from undying import events as ev
from undying.config import JobSpec
from undying.protocol import Phase
from undying.runtime.bad_steps import BadSteps
from undying.runtime.carried_batches import DrawLedger
from undying.runtime.loop_start import agree_on_start, print_rerun_line, start_from_script_checkpoint
from undying.runtime.membership import Membership
from undying.runtime.recovery_client import RecoveryClient
from undying.runtime.reporter import Reporter
from undying.runtime.rng_mirror import RngMirror
from undying.runtime.run_record import append_samples
from undying.runtime.snapshots import CheckpointEngine
from undying.runtime.step_transaction import StepTransaction
from undying.runtime.step_value import Step
from undying.runtime.training_state import TrainingState


class StepLoop:
    """The step loop of one worker; ``steps`` is ``ft.steps`` (its docstring says what it yields)."""

    def __init__(self, spec: JobSpec, state: TrainingState, membership: Membership, reporter: Reporter,
                 transaction: StepTransaction, checkpoints: CheckpointEngine, recovery: RecoveryClient,
                 bad_steps: BadSteps, rng_mirror: RngMirror, draws: DrawLedger, device: torch.device,
                 run_dir: Path, joining: bool) -> None:
        self.spec = spec
        self.state = state
        self.membership = membership
        self.reporter = reporter
        self.transaction = transaction
        self.checkpoints = checkpoints
        self.recovery = recovery
        self.bad_steps = bad_steps
        self.rng_mirror = rng_mirror
        self.draws = draws
        self.device = device
        self.run_dir = run_dir
        self.joining = joining
        self._resumed_from: int | None = None  # the step the newest restore or recovery took this rank to
        self._loop_state_registered = False
        self.ran_to_end = False  # the script's ``ft.steps(n)`` loop went through its last step

    def steps(self, max_steps: int, start: int | None = None) -> Iterator[Step]:
        """``ft.steps`` (runtime/core.py ``Runtime.steps``)."""
        self._register_loop_state()
        self.reporter.max_steps = max_steps
        rerun_cause = self._begin(start)
        self._mark_commit_boundary()
        step = self.state.committed_step
        first = True
        while step < max_steps:
            if rerun_cause is not None:
                print_rerun_line(self.membership.rank, step, self.membership.generation, rerun_cause)
                rerun_cause = None
            self.transaction.begin(step)
            self.draws.begin_step(step)
            yield Step(step, self.transaction)
            self.draws.end_step()
            failure = self.transaction.end()
            bad = self.transaction.bad_step
            skipped = bad is not None and self.bad_steps.after_bad(step, bad)  # committed without its update
            if bad is not None and not skipped:
                rerun_cause = "a bad step"  # replayed from the committed state
                continue
            if failure is not None and not skipped:
                self._recover(failure, self.transaction.raised)
                step = self.state.committed_step
                first = True
                rerun_cause = "a recovery"
                continue
            self.transaction.committed()
            self.state.committed_step = step + 1
            self.bad_steps.committed(step)
            if self.spec.sample_log and not skipped:
                membership = self.membership
                append_samples(self.run_dir, step, membership.rank, membership.group_rank, membership.replicas,
                               membership.generation, self.reporter.scalars.get("loss"), self.state.loaders,
                               self.transaction.decided_at)
            self._mark_commit_boundary()
            self.reporter.update(step=self.state.committed_step, phase=Phase.UPDATED)
            if first and self._resumed_from is not None:
                self.reporter.emit(ev.FIRST_STEP, step=self.state.committed_step, resumed_from=self._resumed_from)
            first = False
            # T1 snapshot every snapshot_interval steps; T2 every checkpoint.interval, in the background.
            self.checkpoints.at_commit(self.state.committed_step)
            step += 1
            if self.membership.ending():
                # The generation ended after every rank had applied this step (e.g. an elastic grow
                # began): the step stands, and the regrouping starts from it.
                self._recover("the controller ended this generation at a step boundary")
                step = self.state.committed_step
                first = True
        self.ran_to_end = True

    def _register_loop_state(self) -> None:
        """Once, before the first step: take the unregistered schedulers and GradScalers into the
        transaction, and say once which ones could not be; refuse an optimizer that is not wrapped."""
        if self._loop_state_registered:
            return
        self._loop_state_registered = True
        left_out = self.state.register_loop_state()
        if left_out:
            warnings.warn(f"undying: not part of the step transaction (a failed step would leave them "
                          f"advanced; pass each to ft.register): {', '.join(left_out)}", stacklevel=3)

    def _begin(self, start: int | None) -> str | None:
        """Take up the step the loop starts from (see ``steps``); returns what brought this rank there
        when its earlier output may hold steps from it on (a recovery, a restore), else None."""
        if self.joining:
            self._recover("joining as a replacement rank")
            return "a recovery"
        restored = self.checkpoints.restore()
        if restored:
            self._resumed_from = self.state.committed_step
            if start is not None and start != self.state.committed_step:
                warnings.warn(f"undying: ft.steps starts at step {self.state.committed_step}, restored from "
                              f"undying's own state, not at start={start}: its state wins (weights, optimizer, "
                              f"RNG, data position of one committed step)", stacklevel=3)
        elif agree_on_start(self.membership.current_group(), start, self.device) is not None:
            assert start is not None
            start_from_script_checkpoint(self.state, self.membership.current_group(), self.device, start)
            self.checkpoints.peer.continued(start)  # peer copies anchor at the step the job continues from
        # Restored: a fault from now on finds this rank holding a step the job can recover from
        # in place, and the controller must know that before this rank's first step.
        self.reporter.report_now(self.state.committed_step, Phase.COMPUTING)
        self.transaction.timer.restart()
        return "a restore" if restored else None

    def _mark_commit_boundary(self) -> None:
        """Remember what a rollback to this committed step needs, and mirror its RNG state where a
        replacement finds it even when this process and its node are gone (runtime/rng_mirror.py)."""
        self.rng_mirror.write_rng(self.state.committed_step, self.state.mark_commit_boundary(),
                                  abandon=self.membership.aborted)

    def _recover(self, reason: str, raised: tuple[list[str], str] | None = None) -> None:
        self.recovery.recover(reason, raised)
        self._resumed_from = self.state.committed_step
        self.transaction.timer.restart()
