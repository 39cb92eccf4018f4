"""One training step as a transaction: every rank applies it, or none does.

Runs in the worker. The step loop (runtime/step_loop.py) begins one per step; the wrapped optimizer's
``step()`` asks ``commit`` whether to apply the update: the gradients are averaged (during
backward as a rule, runtime/ddp.py), every rank votes, and a rank whose generation the controller
has meanwhile aborted applies nothing. An exception inside ``with step:`` votes no when ``retry``
is on. What failed is kept in ``failure``; the runtime then recovers and re-runs the step. The vote
also carries the bad-step check (runtime/step_check.py): a step whose values are not finite or whose
loss spikes fails on every rank alike (``bad_step``), and the runtime replays it (runtime/bad_steps.py).
The transaction times each step (runtime/step_timing.py) and is where the ``slow`` and ``nan``
injections act on it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from undying._torch_compat.tensors import map_tensors
from undying.config import JobSpec
from undying.log_tail import exception_tail
from undying.protocol import Phase
from undying.runtime.carried_batches import CarriedBatchError
from undying.runtime.ddp import FixedLayoutDDP, commit_vote
from undying.runtime.injection_points import AFTER_VOTE, InjectionPoints
from undying.runtime.membership import Membership
from undying.runtime.peer_copies import PeerCopies
from undying.runtime.pg import CollectiveError, GenerationGroup
from undying.runtime.reporter import Reporter
from undying.runtime.rng_mirror import RngMirror
from undying.runtime.step_check import (
    COUNT_LIMITS,
    REPORT_LEN,
    BadStep,
    StepCheck,
    gradients_of,
    report_from_parts,
    report_parts,
)
from undying.runtime.step_timing import StepTimer
from undying.runtime.training_state import TrainingState
from undying.runtime.vote_sums import commit_vote_with_sums
from undying.strategy_names import StrategyName

# How long an exception in the step body waits to learn whether the controller aborted the
# generation (then it is a symptom of a fault elsewhere and the step is re-run) before it is the
# user's own error and ends the process.
ABORT_GRACE_S = 2.0
ABORT_POLL_S = 0.1


class StepTransaction:
    """The state of the step in flight: ``failure`` (why it cannot commit, or None), whether this
    rank has voted and whether it applied the update."""

    def __init__(self, spec: JobSpec, state: TrainingState, membership: Membership, reporter: Reporter,
                 rng_mirror: RngMirror, injections: InjectionPoints, device: torch.device,
                 peer_copies: PeerCopies | None = None) -> None:
        self.spec = spec
        self.state = state
        self.membership = membership
        self.reporter = reporter
        self.rng_mirror = rng_mirror
        self.injections = injections
        self.device = device
        self.peer_copies = peer_copies  # their confirmations travel in the commit vote
        self.failure: str | None = None
        # This rank's own exception that failed the step (retry), as text: (traceback tail, exception
        # line). Never the exception itself: its traceback holds the frames of the failed collective,
        # whose group (and connections, which peers wait on) would then outlive the generation.
        self.raised: tuple[list[str], str] | None = None
        self.voted = False
        self.decided_at: float | None = None  # wall time this rank's vote and fence let it apply the step
        self.began_at = 0.0  # monotonic time the step began
        self.check = StepCheck(spec, membership.rank)
        self.bad_step: BadStep | None = None  # the vote found the step bad (no rank applied it)
        self.timer = StepTimer(spec.straggler_window, self._data_seconds)
        self._poisoned = False  # an injected ``nan``: this attempt's model outputs are NaN
        if spec.loss_spike_factor is not None:
            state.register("undying.recent_losses", self.check.recent)  # job state: every rank holds it alike
        self.rng_sent = False  # this step's RNG mirror write has started (forward_done)
        # Did the last step move the RNG (its mirror had something to write)? Only then does the next
        # step capture it early (forward_done): a script that draws nothing pays one capture a step.
        self.rng_moves = True

    @property
    def updated(self) -> bool:
        """Did this rank decide to apply the step (its vote passed, and the fence)?"""
        return self.decided_at is not None

    def begin(self, step: int) -> None:
        self.failure = None
        self.raised = None
        self.bad_step = None
        self.voted = False
        self.decided_at = None
        self.began_at = time.monotonic()  # the commit fence asks if this rank was silent since
        self.timer.begin()
        self.check.begin_step()
        self.rng_sent = False
        for loader in self.state.loaders:
            loader.begin_step()
        for model in self.state.models:
            model.begin_step()
        self.set_phase(Phase.COMPUTING)
        self.injections.at_step_start(step)
        self._poisoned = self.injections.poisoned(step)
        slowdown = self.injections.slowdown(step)
        if slowdown > 1.0:
            extra = (slowdown - 1.0) * self.timer.own_compute  # as if its compute took that much longer
            self.timer.injected(extra)
            time.sleep(extra)

    def committed(self) -> None:
        """The step committed (and its checkpoint work is done): its times go out with the next beats."""
        self.timer.committed()
        self.reporter.step_times = self.timer.typical()

    def poison_output(self, _module: torch.nn.Module, _args: Any, output: Any) -> Any:
        """A wrapped model's forward hook: an injected ``nan`` makes the outputs of this attempt NaN."""
        if not self._poisoned or not torch.is_grad_enabled():
            return None
        return map_tensors(lambda t: t * math.nan if t.is_floating_point() else t, output)

    def _data_seconds(self) -> float:
        loaders = [*self.state.loaders, *self.state.statefuls.values()]
        return sum(getattr(loader, "read_seconds", 0.0) for loader in loaders)

    def end(self) -> str | None:
        """Why the step that just ended cannot stand (None: it committed)."""
        if self.failure is None and not self.updated and self.membership.aborted():
            self.failure = "the controller aborted this generation"
        return self.failure

    def set_phase(self, phase: Phase) -> None:
        self.reporter.update(phase=phase)

    def batches_taken(self) -> bool:
        """Has this step taken all its micro-batches? Then its next backward averages the gradients."""
        return not any(loader.step_incomplete() for loader in self.state.loaders)

    def forward_done(self) -> None:
        """After a training forward: once the step has taken its last micro-batch, start mirroring the
        RNG state the next step starts from (the forward drew its random numbers), so that the store's
        round trip overlaps the backward pass; the commit writes it again only if it moved since.
        Not while the steps draw nothing (``rng_moves``): the commit's own capture then finds the
        state unchanged, and one capture a step is saved (NumPy's ``get_state`` is most of one)."""
        if self.rng_moves and not self.rng_sent and not self.voted and self.batches_taken():
            self.rng_sent = True
            self.rng_moves = self.rng_mirror.start_write_rng(self.state.committed_step + 1, self.state.rng_to_mirror())

    def fire_raise_injections(self) -> None:
        """Called by opt.step(): a ``raise`` injection fires inside the step body even unguarded."""
        self.injections.in_step_body(self.state.committed_step)

    def commit(self, vote_ok: bool = True) -> bool:
        """The commit decision: True iff every rank's step succeeded and the gradients are averaged."""
        if self.voted:
            return self.failure is None
        incomplete = [loader for loader in self.state.loaders if loader.step_incomplete()]
        if incomplete and vote_ok:
            loader = incomplete[0]
            raise RuntimeError(
                f"loader: this step took fewer than its {loader.micro_batches} micro-batches; with "
                f"elastic_batch=accumulate a shrunk replica covers several batch slots, so iterate "
                f"`for batch in loader.step_batches():` (or set elastic_batch: grow)")
        self.voted = True
        self.set_phase(Phase.SYNCING)
        if vote_ok:
            # The RNG state a replay of the next step starts from is in the mirror before this rank
            # votes yes: a rank lost after the vote (its peers apply the step) is replaced with it. The
            # write began when the step's last forward ended (forward_done); again only if it moved.
            moved = self.rng_mirror.start_write_rng(self.state.committed_step + 1, self.state.rng_to_mirror())
            self.rng_moves = (self.rng_sent and self.rng_moves) or moved
        try:
            # Averaged during backward as a rule; here only what a backward did not (no backward,
            # a rank voting no): every rank issues the same collectives in the same order.
            for model in self.state.models:
                model.sync_gradients()
            self.set_phase(Phase.SYNCING)
            if not self.rng_mirror.wait(abandon=self.membership.aborted):
                # Its store froze with the controller's node: the step cannot commit anyway.
                self.fail("the controller aborted this generation while the RNG mirror's write was stuck")
                return False
            all_ok, sums = self._buffers_and_vote(vote_ok, final=True)
        except CollectiveError as error:
            self.fail(f"gradient all-reduce failed: {error}")
            return False
        if not all_ok:
            self.fail("a rank voted against this step")
            return False
        checked, sums = (sums[:REPORT_LEN], sums[REPORT_LEN:]) if self.check.enabled and sums else ([], sums)
        self.bad_step = self.check.verdict(checked) if checked else None
        if self.bad_step is not None:
            self.fail(f"bad step: {self.bad_step.cause}")
            return False
        if checked:
            self.check.committed(checked)
        self.injections.at_point(AFTER_VOTE, self.state.committed_step)
        if sums and self.peer_copies is not None:
            self.peer_copies.vote_result(sums, self.membership.current_group().world_size)
        # The fence: a rank silent for long enough to have been given up (a frozen host, woken: no
        # answered beat lately, or a long gap between two since the step began) asks the controller
        # first, and applies nothing if its generation was aborted meanwhile: its all-reduce may have
        # completed from bytes its peers sent before they gave the step up. A rank heard from all
        # along applies the step every rank voted for, even if a peer has died since: its peers
        # apply it too, and a recovery starts from it.
        lease = self.spec.commit_fence_lease()
        if lease is not None and self.reporter.confirm_generation(lease, since=self.began_at) \
                and self.membership.aborted():
            self.fail("the controller aborted this generation while this rank was silent")
            return False
        self.decided_at = time.time()  # wall time: the sample log's ``decided``
        return True

    def agree_to_continue(self) -> bool:
        """Before a further averaging round of the step (a second averaged backward): every rank
        still in the step? The same buffer broadcasts and vote as the commit's, voting yes: a rank
        that has given the step up meanwhile is in its commit, and its no pairs with this. False:
        the step is refused (this rank has voted) and nothing more is averaged in it."""
        if self.voted:
            return self.failure is None
        try:
            all_ok, _ = self._buffers_and_vote(True)
        except CollectiveError as error:
            self.voted = True
            self.fail(f"gradient all-reduce failed: {error}")
            return False
        if not all_ok:
            self.voted = True
            self.fail("a rank voted against this step")
        return all_ok

    def _buffers_and_vote(self, vote_ok: bool, final: bool = False) -> tuple[bool, list[float] | None]:
        """The models' buffers made group rank 0's (``broadcast_buffers``), then one vote-shaped
        all-reduce: (every rank voted yes, the sums of the reports or None). The reports: at the
        ``final`` vote the bad-step check's (first, REPORT_LEN of them), then the peer copies'."""
        for model in self.state.models:
            if isinstance(model, FixedLayoutDDP):
                model.sync_buffers()
        group = self.membership.current_group()
        checked = self.check.vote_report(self._gradients_to_check(group)) if final and self.check.enabled else ()
        copies = self.peer_copies.vote_report() if self.peer_copies is not None and self.peer_copies.enabled else ()
        if not checked and not copies:
            return commit_vote(group, vote_ok, self.device), None
        counts, floats = report_parts(checked) if checked else ([], [])
        all_ok, counted, summed = commit_vote_with_sums(group, vote_ok, counts, COUNT_LIMITS if checked else (),
                                                        (*floats, *copies), self.device)
        sums = report_from_parts(counted, summed[:len(floats)]) if checked else []
        return all_ok, [*sums, *summed[len(floats):]]

    def _gradients_to_check(self, group: GenerationGroup) -> list[torch.Tensor]:
        """The gradients this rank checks: its share of those every rank holds alike once averaged
        (a DDP model's), all of its own (a sharded model's local shards)."""
        replicated = [model for model in self.state.models if isinstance(model, FixedLayoutDDP)]
        own = [model for model in self.state.models if not isinstance(model, FixedLayoutDDP)]
        shared = gradients_of(replicated, (group.rank, group.world_size)) if replicated else []
        return [*shared, *gradients_of(own)]

    def step_raised(self, error: BaseException | None) -> bool:
        """The ``with step:`` guard saw the body end; True suppresses its exception (the step is re-run).

        Suppressed: any exception of a step that could not commit anyway (its all-reduce failed, or
        the controller aborted the generation, told within ABORT_GRACE_S): a user collective that
        fails because a peer died is a symptom of that fault, and the recovery re-runs the step.
        A collective of a sharded model that failed counts as the first kind.
        Else, with ``retry``, an exception of the step's own (this rank votes no, nobody applies it; a
        sharded model's rank leaves the generation instead, its peers being maybe in FSDP's collectives).
        Never a batch carried into the step (runtime/carried_batches.py): every re-run would meet it."""
        if error is None or not isinstance(error, Exception) or self.updated or isinstance(error, CarriedBatchError):
            return False
        if isinstance(error, CollectiveError):
            # A sharded model's own collectives (FSDP's all-gathers and reduce-scatters over the mesh,
            # runtime/mesh.py) raise in the body: a peer is gone, not the user's error.
            self.fail(f"a collective in the step failed: {error}")
        if self.failure is None and StrategyName.RETRY not in self.spec.recover_strategy \
                and not self._generation_aborted_soon():
            return False
        if self.failure is None and not self.membership.aborted():
            self.raised = exception_tail(error)  # the step's cause, not a symptom of a fault elsewhere
        self.fail(f"exception in step: {error!r}")
        if not self.voted and self.state.sharded:
            # FSDP's own collectives of the step (all-gathers, reduce-scatters) may still be ahead of the
            # peers, which a vote could not pair with: leave the generation, so their collectives fail
            # at once (or at the controller's abort) instead of at comm_timeout.
            self.voted = True
            self.membership.leave_group()
        elif not self.voted:
            # Vote no in the all-reduce the other ranks are waiting in, so nobody applies this step.
            self.commit(vote_ok=False)
        return True

    def _generation_aborted_soon(self) -> bool:
        """Has the controller aborted this generation, or does it within ABORT_GRACE_S? A peer's death
        reaches the controller at once (its agent reports the exit), the abort a moment later."""
        deadline = time.monotonic() + ABORT_GRACE_S
        while not self.membership.aborted():
            if not self.reporter.connected or time.monotonic() > deadline:
                return False
            self.reporter.confirm_generation(lease=0.0)
            if not self.membership.aborted():
                time.sleep(ABORT_POLL_S)
        return True

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
