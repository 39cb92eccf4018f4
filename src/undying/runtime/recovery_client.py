"""The worker's side of a recovery: from a failed step (or a replacement's start) to a committed step.

Runs in the worker. ``RecoveryClient.recover`` is the whole path, in order: leave the failed
generation's group, check in with the controller (``/v1/worker/recover``) and wait for its plan,
write the dying checkpoint if the plan says ``dump`` (runtime/dying_checkpoint.py), follow the job's store if it moved (controller
failover), enter the plan's generation and build its group, then repair: the source replica sends
its state to the replacement ranks (runtime/state_transfer.py) and every other rank rolls back its
step in flight. A plan whose regroup or repair fails is followed by the next plan.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from undying import events as ev
from undying.config import JobSpec
from undying.protocol import Phase, Plan, PlanAction
from undying.runtime.dying_checkpoint import DyingCheckpoint
from undying.runtime.injection_points import DUMP, RECOVERY, InjectionPoints
from undying.runtime.membership import Membership
from undying.runtime.pg import CollectiveError
from undying.runtime.reporter import Reporter
from undying.runtime.rng import restore_rng
from undying.runtime.rng_mirror import MIRROR_TIMEOUT_S, RngMirror
from undying.runtime.sharded import shard_donors
from undying.runtime.state_transfer import recv_state, send_state
from undying.runtime.training_state import TrainingState

if TYPE_CHECKING:
    from undying.runtime.snapshots import CheckpointEngine

PARK_POLL_S = 1.0


class RecoveryClient:
    """Carries out the controller's recovery plans for one worker.

    Guarantees: ``recover`` returns only once this rank is a member of a new generation whose
    group is built and holds the training state of the plan's ``target_step`` (received from the
    plan's source replica, or its own step in flight rolled back), with that step marked as the
    commit boundary. Not guaranteed: that it returns at all; a plan that gives this process no
    part (``exit``, or after a dump) parks it until its agent stops it.
    """

    def __init__(self, spec: JobSpec, membership: Membership, state: TrainingState, reporter: Reporter,
                 rng_mirror: RngMirror, injections: InjectionPoints, checkpoints: CheckpointEngine) -> None:
        self.spec = spec
        self.membership = membership
        self.state = state
        self.reporter = reporter
        self.rng_mirror = rng_mirror
        self.injections = injections
        self.checkpoints = checkpoints
        self._joined: tuple[Plan, float] | None = None  # a plan whose group join_early built already
        self.dying_checkpoint = DyingCheckpoint(spec, membership, state, reporter, rng_mirror, checkpoints)

    def recover(self, reason: str) -> None:
        """Leave the failed step, follow the controller's plan, and return at a committed step."""
        started = time.monotonic()
        self.checkpoints.settle()  # a repair rewrites the state an overlapped snapshot may still be copying
        self.reporter.update(phase=Phase.RECOVERING)
        if self.state.holds_state:
            self.reporter.emit(ev.STEP_FAILED, step=self.state.committed_step, reason=reason)
        while True:
            joined, self._joined = self._joined, None
            plan, planned = joined or self._follow_next_plan(reason)
            try:
                if joined is None:
                    self.injections.at_point(RECOVERY, plan.target_step)
                    self.membership.build_group()
                rebuilt = time.monotonic()
                self._repair(plan)
                break
            except CollectiveError as error:
                reason = f"recovery of generation {plan.generation} failed: {error}"
                self.reporter.emit(ev.STEP_FAILED, step=self.state.committed_step, reason=reason)
        self.reporter.update(step=self.state.committed_step, phase=Phase.COMPUTING)
        self.reporter.emit(ev.RECOVERED, step=self.state.committed_step, strategy=plan.strategy, pid=os.getpid(),
                           source_rank=plan.source_rank, received=self.membership.rank in plan.receivers,
                           wait_for_plan=round(planned - started, 4), rebuild=round(rebuilt - planned, 4),
                           repair=round(time.monotonic() - rebuilt, 4), total=round(time.monotonic() - started, 4))

    def join_early(self) -> None:
        """A replacement rank of a sharded job: join the plan's generation (its groups, torch's default
        group among them) before the script builds its model, since FSDP2 places a model on the mesh
        through torch's default group. ``recover`` then only repairs. If the groups cannot be built,
        ``recover`` follows the next plan as usual."""
        plan, planned = self._follow_next_plan("joining as a replacement rank")
        try:
            self.injections.at_point(RECOVERY, plan.target_step)
            self.membership.build_group()
        except CollectiveError as error:
            self.reporter.emit(ev.STEP_FAILED, step=self.state.committed_step,
                               reason=f"recovery of generation {plan.generation} failed: {error}")
            return
        self._joined = (plan, planned)

    def _follow_next_plan(self, reason: str) -> tuple[Plan, float]:
        """Leave the current group, wait for the controller's next plan and enter its generation (after
        a dump, or for a plan that gives this process no part, park). Returns it and when it came."""
        self.membership.leave_group()
        plan = self.reporter.wait_for_plan(self.membership.generation, self.state.committed_step, reason,
                                           newcomer=not self.state.holds_state)
        planned = time.monotonic()
        if plan.action == PlanAction.DUMP:
            self.injections.at_point(DUMP, plan.target_step)
            self.dying_checkpoint.write(plan)
        if plan.action != PlanAction.RESUME:
            self._park()
        if plan.store:
            self._follow_store(plan.store)
        self.membership.enter(plan)
        self.state.apply_members(self.membership, self.spec.elastic_batch)
        return plan, planned

    def _park(self) -> None:
        """Nothing left for this process to do: the controller stops it (job restart or exit)."""
        self.reporter.update(phase=Phase.RECOVERING)
        while True:
            time.sleep(PARK_POLL_S)

    def _follow_store(self, address: str) -> None:
        """Meet the next generation in the store the plan names: after a controller failover it
        is the new controller's (the old one died with its node)."""
        if not self.membership.move_store(address):
            return
        self.rng_mirror.use_store(self.membership.bounded_store(MIRROR_TIMEOUT_S, name="rng mirror store"))
        self.checkpoints.store_moved()
        self.reporter.emit(ev.STORE_MOVED, step=self.state.committed_step, store=address)

    def _repair(self, plan: Plan) -> None:
        """Make this rank hold the state of ``plan.target_step``: from the source replica if listed
        as a receiver, else by rolling back its own step in flight."""
        membership, state = self.membership, self.state
        group = membership.current_group()
        state.forget_failed_step()
        if membership.rank == plan.source_rank:
            send_state(group, state.replica_state(), [membership.members.index(receiver)
                                                      for receiver in plan.receivers], membership.device)
        if membership.rank in plan.receivers:
            # Into this rank's own tensors where it has them (its model's parameters): no second copy.
            received = recv_state(group, membership.members.index(plan.source_rank), membership.device,
                                  live=state.replica_state())
            state.load_replica_state(received)
        if state.sharded:
            self._repair_shards(plan)
        if membership.rank in plan.receivers:
            state.holds_state = True
            rng = self.rng_mirror.read(plan.target_step, fallbacks=plan.rng_stores)
        else:
            rng = state.roll_back_step_in_flight()
        if rng:
            restore_rng(rng)
        state.committed_step = plan.target_step
        self.rng_mirror.write_rng(state.committed_step, state.mark_commit_boundary())

    def _repair_shards(self, plan: Plan) -> None:
        """A sharded job: each receiver gets its shard of the models and optimizers from a rank that
        holds the same shard in another replica (runtime/sharded.py ``shard_donors``), after the
        replica state every rank shares."""
        membership, state = self.membership, self.state
        if not plan.receivers:
            return
        assert membership.mesh is not None, "a sharded job's membership has its mesh"
        donors = shard_donors(membership.mesh, list(plan.receivers), membership.members)
        group = membership.current_group()
        mine = [receiver for receiver, donor in donors.items() if donor == membership.rank]
        if mine:
            send_state(group, state.shard_state(), [membership.members.index(receiver) for receiver in mine],
                       membership.device)
        if membership.rank in donors:
            started = time.monotonic()
            state.load_shard_state(recv_state(group, membership.members.index(donors[membership.rank]),
                                              membership.device, live=state.shard_state()))
            self.reporter.emit(ev.SHARD_RECEIVED, step=plan.target_step, source="replica",
                               donor=donors[membership.rank], shard=membership.rank % membership.mesh.shard,
                               seconds=round(time.monotonic() - started, 4))
