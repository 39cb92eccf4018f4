"""Changing the world size of a running job: shrink (drop nodes that did not come back) and grow.

Runs in the controller, inside the job machine. A shrink happens inside a recovery whose
awaited nodes missed ``wait_reschedule_timeout``: their ranks leave the new generation.
A grow starts the returned ranks first while the survivors train on, and only once every
one of them has checked in ends the running generation (at the survivors' next step
boundary) and regroups, so the survivors never wait for a cold start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from undying import events as ev
from undying.controller.membership import RankRecord
from undying.controller.recovery import ActiveRecovery
from undying.controller.strategies.base import strategy_enabled
from undying.faults import Fault, FaultReason
from undying.protocol import Phase
from undying.strategy_names import StrategyName

if TYPE_CHECKING:
    from undying.controller.job import JobCore


def shrink(job: JobCore, recovery: ActiveRecovery, now: float) -> str | None:
    """Drop the nodes that did not come back from the recovery; why not, if that leaves too few."""
    membership = job.membership
    dropped_nodes = sorted(recovery.awaited_nodes)
    dropped = {rank for rank in recovery.members if membership.ranks[rank].node in recovery.awaited_nodes}
    members = [rank for rank in recovery.members if rank not in dropped]
    nodes_left = {membership.ranks[rank].node for rank in members}
    fewest = job.spec.fewest_nodes
    if len(nodes_left) < fewest or not recovery.survivors:
        return (f"elastic-training: {len(nodes_left)} node(s) left, below min_nodes ({fewest})"
                if recovery.survivors else "elastic-training: no healthy replica left")
    refused = sharded_refusal(job, members)
    if refused is not None:
        return refused
    if recovery.strategy != StrategyName.ELASTIC:
        # Elastic training drives the shrunk recovery from here; if it fails, both were tried.
        job.hand_over(StrategyName.ELASTIC, f"node(s) {dropped_nodes} not back in time (waited "
                                            f"{now - recovery.started:.3g} s): the job trains on without them")
    else:
        recovery.tried.add(StrategyName.ELASTIC)
    old_world = len(recovery.members)
    recovery.members = members
    recovery.newcomers -= dropped
    recovery.newcomers_ready -= dropped
    recovery.awaited_nodes.clear()
    recovery.deadline = now + job.deadlines.recovery
    for rank in dropped:
        membership.ranks.pop(rank, None)
    job.emit(ev.ELASTIC_SHRINK, generation=recovery.generation, step=recovery.fault.step,
             details={"old_world_size": old_world, "new_world_size": len(members),
                      "dropped_nodes": dropped_nodes, "dropped_ranks": sorted(dropped),
                      "waited": round(now - recovery.started, 3)})
    return None


def sharded_refusal(job: JobCore, members: list[int]) -> str | None:
    """Why a sharded job cannot train on ``members`` (None if it can, or if it is data parallel): they
    must be whole replicas, and with ``elastic_batch: grow`` as many of them as give every rank an
    equal share of the step's slots (FSDP divides every rank's gradient by one factor)."""
    membership = job.membership
    shard = membership.mesh_shard
    if not shard:
        return None
    broken = membership.incomplete_replicas(members)
    if broken:
        return (f"elastic-training: the ranks left {sorted(members)} are not whole replicas of the sharded mesh "
                f"({shard} ranks a replica; replica(s) {broken} incomplete)")
    replicas, kept = job.spec.world_size // shard, len(members) // shard
    if job.spec.elastic_batch == "grow" and replicas % kept:
        return (f"elastic-training: elastic_batch grow on a sharded mesh needs the replicas left ({kept}) to divide "
                f"the job's ({replicas}); allowed: elastic_batch accumulate")
    return None


def grow_if_nodes_returned(job: JobCore, now: float) -> None:
    """Elastic grow-back: a node dropped by a shrink is alive again; bring its ranks back in."""
    membership = job.membership
    if len(membership.members) >= job.spec.world_size or not strategy_enabled(job.spec, StrategyName.ELASTIC):
        return
    pending = job.pending_grow
    if pending is not None:
        # Not while a member still restores at start (after a shrunk job restart): ending its
        # generation then would break the restore's rendezvous; it trains within seconds.
        restoring = any(record.phase == Phase.STARTING for record in membership.ranks.values())
        if pending.newcomers <= pending.newcomers_ready and not restoring:
            _begin_grow(job, pending, now)
        elif now > pending.deadline:
            job.await_grow(None)
            for node in {membership.node_of(rank) for rank in pending.newcomers}:
                if node in membership.nodes:  # this agent incarnation is not asked again
                    job.refuse_grow(node, membership.nodes[node].pid)
            job.emit(ev.RECOVERY_FAILED, generation=job.generation,
                     details={"strategy": StrategyName.ELASTIC, "grow": True, "why": "returned ranks did not start "
                              f"within start_timeout ({job.spec.start_timeout:g} s): "
                              f"{sorted(pending.newcomers - pending.newcomers_ready)}"})
        return
    members = set(membership.members)
    dropped = {node for node in range(job.spec.nnodes) if not set(membership.ranks_of(node)) & members}
    returned = sorted(node for node in dropped & membership.alive_nodes()
                      if (node, membership.nodes[node].pid) not in job.grow_refused)
    if not returned:
        # A spare that joined since the shrink takes a dropped node's place (it says hello as it).
        job.adopt_spares_for(dropped, now)
        return
    if any(record.done for record in membership.ranks.values()):
        return
    newcomers = {rank for node in returned for rank in membership.ranks_of(node)}
    grown = sorted(members | newcomers)
    if len(grown) < job.spec.world_size and sharded_refusal(job, grown) is not None:
        return  # a sharded job grows to whole replicas the workers can weight (sharded_refusal): wait for more
    pending = ActiveRecovery(StrategyName.ELASTIC,
                             Fault(FaultReason.NODE_RETURNED, node=returned[0], step=membership.committed_step()),
                             job.generation, job.generation + 1, grown,
                             survivors=set(members), newcomers=newcomers, started=now, grow=True,
                             deadline=now + job.deadlines.grow_start)
    job.await_grow(pending)
    for node in returned:
        job.order_replace(node, membership.ranks_of(node), pending.generation, now, grow=True)


def _begin_grow(job: JobCore, pending: ActiveRecovery, now: float) -> None:
    """Every returned rank is up: end the running generation and regroup with them."""
    membership = job.membership
    job.await_grow(None)
    old_generation = job.generation
    for rank in sorted(pending.newcomers):
        membership.ranks[rank] = RankRecord(rank, membership.node_of(rank), pending.generation, now,
                                            step_known=False)
    pending.deadline = now + job.deadlines.recovery
    # Survivors leave at their next step boundary and check in; the first check-in aborts what a
    # straggler has in flight (Executor.check_in): a step is never half committed.
    job.begin_recovery(pending, at_boundary=True, counted=False)
    job.emit(ev.RECOVERY_BEGIN, generation=job.generation, step=membership.committed_step(),
             details={"strategy": StrategyName.ELASTIC, "grow": True, "old_generation": old_generation,
                      "survivors": sorted(pending.survivors), "newcomers": sorted(pending.newcomers),
                      "newcomers_started_in": round(now - pending.started, 3)})
