"""The worker's side of a recovery: from a failed step (or a replacement's start) to a committed step.

Runs in the worker. ``RecoveryClient.recover`` is the whole path, in order: leave the failed
generation's group, check in with the controller (``/v1/worker/recover``) and wait for its plan,
write the dying checkpoint if the plan says ``dump`` (runtime/dying_checkpoint.py), follow the job's store if it moved (controller
failover), enter the plan's generation and build its group, then repair: a replacement whose node's
T1 snapshot holds the plan's step loads it (runtime/t1_repair.py), the source replica sends its
state to the other receivers (runtime/state_transfer.py), and every other rank rolls back its step
in flight. A plan whose regroup or repair fails is followed by the next plan; a repair that nothing
can carry out (``ShardLost``) ends the process with the refusal's exit status (runtime/process_exit.py).
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
from undying.runtime.pg import CollectiveError, GenerationGroup
from undying.runtime.process_exit import repair_refusal_exits
from undying.runtime.reporter import Reporter
from undying.runtime.rng import restore_rng
from undying.runtime.rng_mirror import MIRROR_TIMEOUT_S, RngMirror
from undying.runtime.sharded import shard_donors
from undying.runtime.state_transfer import recv_state, send_state
from undying.runtime.t1_repair import T1Decision, T1Offer, decide, exchange_offers
from undying.runtime.training_state import TrainingState

if TYPE_CHECKING:
    from undying.runtime.snapshots import CheckpointEngine

PARK_POLL_S = 1.0
# The longest a parked rank lets its persister finish a T2 commit whose records are all in (the
# controller holds the job restart's stop orders as long: controller/deadlines.py COMMIT_DRAIN).
COMMIT_DRAIN_S = 30.0
SOURCE_T1 = "t1"  # where a receiver's state came from (state_received, shard_received): its node's T1
SOURCE_REPLICA = "replica"  # ... or a peer holding the same state (the plan's source, a shard's donor)
SOURCE_PEER_COPY = "peer_copy"  # ... or the copy of its T1 snapshot kept on another node (runtime/peer_copy.py)


class RecoveryClient:
    """Carries out the controller's recovery plans for one worker.

    Guarantees: ``recover`` returns only once this rank is a member of a new generation whose
    group is built and holds the training state of the plan's ``target_step`` (loaded from its node's
    T1 snapshot of that step, received from the plan's source replica, or its own step in flight
    rolled back), with that step marked as the commit boundary; in a pure-FSDP job whose receiver's
    T1 lacks that step, every rank holds instead the newest step all of them hold in T1. Not
    guaranteed: that it returns at all; a plan that gives this process no part (``exit``, or after
    a dump) parks it until its agent stops it, and a repair nothing can carry out (``ShardLost``) ends it
    with the exit status ``WORKER_EXIT_REPAIR_REFUSED``.
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
        # A plan whose group join_early built already, with when the join began, the plan came and the
        # group was built: a replacement's recovery is timed from its join.
        self._joined: tuple[Plan, float, float, float] | None = None
        self._t1_error: str | None = None  # why this receiver's T1 snapshot of the step could not be loaded
        self.dying_checkpoint = DyingCheckpoint(spec, membership, state, reporter, rng_mirror, checkpoints)

    def recover(self, reason: str, raised: tuple[list[str], str] | None = None) -> None:
        """Leave the failed step, follow the controller's plan, and return at a committed step.
        ``raised``: this rank's own exception that failed the step (told to the controller)."""
        with repair_refusal_exits():  # ShardLost: the chain goes on to its next strategy
            self._recover(reason, raised)

    def _recover(self, reason: str, raised: tuple[list[str], str] | None) -> None:
        started = time.monotonic()
        self.checkpoints.settle()  # a repair rewrites the state an overlapped snapshot may still be copying
        self.reporter.update(phase=Phase.RECOVERING)
        if self.state.holds_state:
            self.reporter.emit(ev.STEP_FAILED, step=self.state.committed_step, reason=reason)
        while True:
            joined, self._joined = self._joined, None
            if joined is not None:
                plan, started, planned, rebuilt = joined
            else:
                plan, planned = self._follow_next_plan(reason, raised)
            raised = None  # a later round of this loop is a failed recovery, not the step's exception
            try:
                if joined is None:
                    self.injections.at_point(RECOVERY, plan.target_step)
                    self.membership.build_group()
                    rebuilt = time.monotonic()
                repairing = time.monotonic()
                self._repair(plan)
                self.checkpoints.peer.continued(self.state.committed_step)
                break
            except CollectiveError as error:
                reason = f"recovery of generation {plan.generation} failed: {error}"
                self.reporter.emit(ev.STEP_FAILED, step=self.state.committed_step, reason=reason)
        self.reporter.update(step=self.state.committed_step, phase=Phase.COMPUTING)
        self.reporter.emit(ev.RECOVERED, step=self.state.committed_step, strategy=plan.strategy, pid=os.getpid(),
                           source_rank=plan.source_rank, received=self.membership.rank in plan.receivers,
                           wait_for_plan=round(planned - started, 4), rebuild=round(rebuilt - planned, 4),
                           repair=round(time.monotonic() - repairing, 4), total=round(time.monotonic() - started, 4))

    def join_early(self) -> None:
        """A replacement rank of a sharded job: join the plan's generation (its groups, torch's default
        group among them) before the script builds its model, since FSDP2 places a model on the mesh
        through torch's default group. ``recover`` then only repairs; its ``recovered`` event times the
        wait for the plan and the rebuild from this join, which come before the script's model is built.
        If the groups cannot be built, ``recover`` follows the next plan as usual."""
        started = time.monotonic()
        with repair_refusal_exits():  # a dump this process cannot complete
            plan, planned = self._follow_next_plan("joining as a replacement rank")
        try:
            self.injections.at_point(RECOVERY, plan.target_step)
            self.membership.build_group()
        except CollectiveError as error:
            self.reporter.emit(ev.STEP_FAILED, step=self.state.committed_step,
                               reason=f"recovery of generation {plan.generation} failed: {error}")
            return
        self._joined = (plan, started, planned, time.monotonic())

    def _follow_next_plan(self, reason: str, raised: tuple[list[str], str] | None = None) -> tuple[Plan, float]:
        """Leave the current group, wait for the controller's next plan and enter its generation (after
        a dump, or for a plan that gives this process no part, park). Returns it and when it came."""
        self.membership.leave_group()
        plan = self.reporter.wait_for_plan(self.membership.generation, self.state.committed_step, reason,
                                           newcomer=not self.state.holds_state, raised=raised)
        planned = time.monotonic()
        if plan.action == PlanAction.DUMP:
            self.injections.at_point(DUMP, plan.target_step)
            self.dying_checkpoint.write(plan)
        if plan.action == PlanAction.PERSIST and self.state.committed_step == plan.target_step:
            # The job stops: this rank writes its part of the newest committed step, then waits to be stopped.
            self.checkpoints.persist_now(plan.target_step)
        if plan.action != PlanAction.RESUME:
            self.checkpoints.finish_commit(COMMIT_DRAIN_S)
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
        """Make this rank hold the state of ``plan.target_step``: a receiver from its node's T1 snapshot
        of that step if it holds one, else from the source replica; every other rank by rolling back
        its step in flight. A pure-FSDP job whose receiver's T1 lacks the step goes back, every rank,
        to the newest step that all hold in T1 (runtime/t1_repair.py): the step the job continues from."""
        membership, state = self.membership, self.state
        group = membership.current_group()
        state.forget_failed_step()
        decision = self._agree_on_t1(plan, group) if plan.receivers else T1Decision(frozenset())
        if decision.rollback_step is not None:
            self._roll_back_to_t1(plan, decision)
            return
        from_t1 = {membership.members[index] for index in decision.from_t1}
        from_peer = [receiver for receiver in plan.receivers if receiver not in from_t1]
        if membership.rank == plan.source_rank and from_peer:
            send_state(group, state.replica_state(), [membership.members.index(receiver)
                                                      for receiver in from_peer], membership.device)
        if membership.rank in from_peer:
            started = time.monotonic()
            # Into this rank's own tensors where it has them (its model's parameters): no second copy.
            received = recv_state(group, membership.members.index(plan.source_rank), membership.device,
                                  live=state.replica_state())
            state.load_replica_state(received)
            self.reporter.emit(ev.STATE_RECEIVED, step=plan.target_step, source=SOURCE_REPLICA,
                               donor=plan.source_rank, seconds=round(time.monotonic() - started, 4),
                               **({"t1_error": self._t1_error} if self._t1_error else {}))
        if state.sharded:
            self._repair_shards(plan, from_peer)
        # A receiver from T1 restored the snapshot's RNG with it; one from a peer takes its RNG from the
        # mirror (below), where its predecessor wrote it.
        if membership.rank in from_peer:
            state.slot_rng.forget()
        elif membership.rank not in from_t1:
            restore_rng(state.roll_back_step_in_flight())
        if membership.rank in plan.receivers:
            state.holds_state = True
        self._take_slot_streams(plan)
        self._committed(plan.target_step)

    def _take_slot_streams(self, plan: Plan) -> None:
        """The RNG streams this rank draws from but does not hold as of the plan's step, from the mirror
        (runtime/slot_rng.py): a receiver's own; after an elastic shrink or grow, the stream of each slot
        it covers for another rank, or of its own slot, covered again, where their last holder wrote them."""
        streams = self.state.slot_rng
        for slot in streams.missing():
            streams.take(slot, self.rng_mirror.read(plan.target_step, slot, plan.rng_stores) or None)

    def _committed(self, step: int) -> None:
        self.state.committed_step = step
        self.rng_mirror.forget_written(abandon=self.membership.aborted)
        self.rng_mirror.write_rng(step, self.state.mark_commit_boundary(), abandon=self.membership.aborted)

    def _agree_on_t1(self, plan: Plan, group: GenerationGroup) -> T1Decision:
        """Every member: a receiver first loads its own T1 snapshot of the target step if its node
        holds a complete one; then all exchange what they hold (one small all-reduce) and ``decide``
        alike who still receives from a peer. Raises ShardLost where nothing can repair a lost shard."""
        membership, state = self.membership, self.state
        held = self.checkpoints.node_t1().held(membership.replicas)
        loaded, seconds, self._t1_error = False, 0.0, None
        if membership.rank in plan.receivers and plan.target_step in held:
            started = time.monotonic()
            try:
                self.checkpoints.load_t1(plan.target_step)
                loaded = True
            except Exception as error:  # whatever a snapshot that does not load raises: a peer can still send it
                held.remove(plan.target_step)  # ... over whatever was loaded
                self._t1_error = f"T1 snapshot of step {plan.target_step} unusable: {error}"
            seconds = round(time.monotonic() - started, 4)
        peer = self.checkpoints.peer
        copies = tuple(peer.steps_held(membership.replicas)) if peer.enabled else ()
        offer = T1Offer(loaded, state.committed_step if state.holds_state else None, tuple(held), copies)
        offers = exchange_offers(group, offer, peer.slots(self.spec.checkpoint.snapshot_slots), membership.device)
        mesh = membership.mesh
        decision = decide(offers, [membership.members.index(receiver) for receiver in plan.receivers],
                          plan.target_step, replicas_hold_state=mesh is None or mesh.replicate > 1,
                          holders=peer.holders())
        if loaded and decision.rollback_step is None:
            self.reporter.emit(ev.STATE_RECEIVED, step=plan.target_step, source=SOURCE_T1,
                               path=str(self.checkpoints.directory), seconds=seconds)
            if mesh is not None:
                self.reporter.emit(ev.SHARD_RECEIVED, step=plan.target_step, source=SOURCE_T1,
                                   shard=membership.rank % mesh.shard, seconds=seconds)
        return decision

    def _roll_back_to_t1(self, plan: Plan, decision: T1Decision) -> None:
        """Pure FSDP: go back to the decision's step with every other rank: from this rank's T1 snapshot
        of it, or, holding that step live already, by rolling back the step in flight, or, holding it
        nowhere (its node was lost), from the copy its holder's node keeps; a holder sends those copies.
        Later snapshots belong to the history given up here and are forgotten."""
        membership, state = self.membership, self.state
        assert decision.rollback_step is not None
        step, from_copies = decision.rollback_step, decision.from_copies or {}
        started = time.monotonic()
        index = membership.members.index(membership.rank)
        self.checkpoints.peer.send_copies(step, from_copies)
        if index in from_copies:
            self._receive_copy(plan, step, membership.members[from_copies[index]])
            return
        if state.holds_state and state.committed_step == step:
            restore_rng(state.roll_back_step_in_flight())
        else:
            if state.holds_state:
                state.roll_back_step_in_flight()  # a GradScaler's memory of the failed step goes with it
            self.checkpoints.load_t1(step)  # the snapshot's RNG too
        self.checkpoints.snapshots.invalidate(keep_step=step)
        state.holds_state = True
        self.reporter.emit(ev.T1_ROLLBACK, step=step, target=plan.target_step, source=SOURCE_T1,
                           seconds=round(time.monotonic() - started, 4))
        if membership.rank in plan.receivers and membership.mesh is not None:
            self.reporter.emit(ev.SHARD_RECEIVED, step=step, source=SOURCE_T1,
                               shard=membership.rank % membership.mesh.shard,
                               seconds=round(time.monotonic() - started, 4))
        self._committed(step)

    def _receive_copy(self, plan: Plan, step: int, holder: int) -> None:
        """Load this rank's state of ``step`` (models, optimizers, shards, RNG, loaders) from the peer copy
        that rank ``holder`` sends: this rank's own node, and its T1 with it, was lost."""
        membership, state = self.membership, self.state
        started = time.monotonic()
        if state.holds_state:
            state.roll_back_step_in_flight()
        self.checkpoints.peer.receive_copy(membership.members.index(holder), state)
        self.checkpoints.snapshots.invalidate()
        state.holds_state = True
        seconds = round(time.monotonic() - started, 4)
        self.reporter.emit(ev.T1_ROLLBACK, step=step, target=plan.target_step, source=SOURCE_PEER_COPY,
                           seconds=seconds)
        self.reporter.emit(ev.STATE_RECEIVED, step=step, source=SOURCE_PEER_COPY, donor=holder, seconds=seconds)
        if membership.mesh is not None:
            self.reporter.emit(ev.SHARD_RECEIVED, step=step, source=SOURCE_PEER_COPY, donor=holder,
                               shard=membership.rank % membership.mesh.shard, seconds=seconds)
        self._committed(step)

    def _repair_shards(self, plan: Plan, receivers: list[int]) -> None:
        """A sharded job: each of ``receivers`` (those whose T1 did not hold the step) gets its shard of
        the models and optimizers from a rank that holds the same shard in another replica
        (runtime/sharded.py ``shard_donors``), after the replica state every rank shares."""
        membership, state = self.membership, self.state
        if not receivers:
            return
        assert membership.mesh is not None, "a sharded job's membership has its mesh"
        donors = shard_donors(membership.mesh, receivers, membership.members)
        group = membership.current_group()
        mine = [receiver for receiver, donor in donors.items() if donor == membership.rank]
        if mine:
            send_state(group, state.shard_state(), [membership.members.index(receiver) for receiver in mine],
                       membership.device)
        if membership.rank in donors:
            started = time.monotonic()
            state.load_shard_state(recv_state(group, membership.members.index(donors[membership.rank]),
                                              membership.device, live=state.shard_state()))
            self.reporter.emit(ev.SHARD_RECEIVED, step=plan.target_step, source=SOURCE_REPLICA,
                               donor=donors[membership.rank], shard=membership.rank % membership.mesh.shard,
                               seconds=round(time.monotonic() - started, 4))
