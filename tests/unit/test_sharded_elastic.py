"""Elastic training of a sharded job (HSDP): the controller shrinks and grows it by whole replicas
only, and falls through to the next strategy when the ranks left are not whole replicas; the
worker's mesh renumbers its replicate groups over the replicas left."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.unit.job_harness import Job, check_in_together
from undying import events as ev
from undying.controller.membership import Membership
from undying.controller.strategies.resize import grow_if_nodes_returned
from undying.protocol import AgentLeave, Heartbeat, Phase, PlanAction, RecoverRequest
from undying.runtime.mesh import SwappableMesh, surviving_replicas

ELASTIC = {"process_recover": True, "recover_strategy": ["elastic-training"],
           "heartbeat_timeout": 5.0, "elastic_batch": "accumulate"}


def sharded_job(make_job: Callable[..., Job], mesh_shard: int, **spec_fields: Any) -> Job:
    """A running generation 1 whose workers built a mesh of ``mesh_shard`` ranks a replica (0: data
    parallel); every rank has committed step 7."""
    job = make_job(**{**ELASTIC, **spec_fields})
    job.start_running()
    for rank in range(job.spec.world_size):
        job.controller.heartbeat(Heartbeat(rank, rank // job.spec.nproc_per_node, 1, 7, Phase.COMPUTING,
                                           2000 + rank, mesh_shard=mesh_shard))
    return job


def leave_and_check_in(job: Job, nodes: list[int]) -> dict[int, Any]:
    """``nodes`` announce their leave (not waited for); the ranks left check in."""
    for node in nodes:
        assert job.controller.agent_leaving(AgentLeave(node, 1000 + node, f"host{node}", "SIGTERM"))
    assert job.wait_for(lambda: bool(job.events(ev.DECISION)))
    left = [rank for rank in range(job.spec.world_size) if rank // job.spec.nproc_per_node not in nodes]
    requests = [RecoverRequest(rank, rank // job.spec.nproc_per_node, 1, 7, 2000 + rank, newcomer=False, wait=2.0)
                for rank in left]
    return check_in_together(job.controller, requests)


def test_a_lost_node_holding_a_whole_replica_shrinks_the_job_to_the_other(make_job):
    """2 x 2 mesh, node 1 holds replica 1 (ranks 2, 3): the job trains on as replica 0."""
    job = sharded_job(make_job, mesh_shard=2, nnodes=2, nproc_per_node=2)
    plans = leave_and_check_in(job, [1])
    assert {(plan.action, plan.strategy, tuple(plan.members)) for plan in plans.values()} == {
        (PlanAction.RESUME, "elastic-training", (0, 1))}
    [shrink] = job.events(ev.ELASTIC_SHRINK)
    assert shrink.details["dropped_ranks"] == [2, 3]


def test_ranks_left_that_are_not_whole_replicas_fall_through_to_the_next_strategy(make_job):
    """2 x 2 mesh on 4 nodes of one rank: node 1 held rank 1, half of replica 0. Ranks 0, 2, 3 are
    not whole replicas (rank 0's shard partner is gone), so elastic training refuses and the chain
    goes on to a job restart. A data-parallel job of the same shape shrinks to them."""
    job = sharded_job(make_job, mesh_shard=2, nnodes=4, nproc_per_node=1)
    leave_and_check_in(job, [1])
    assert job.events(ev.ELASTIC_SHRINK) == []
    [failed] = job.events(ev.RECOVERY_FAILED)
    assert failed.details["strategy"] == "elastic-training"
    assert failed.details["why"] == ("elastic-training: the ranks left [0, 2, 3] are not whole replicas of the "
                                     "sharded mesh (2 ranks a replica; replica(s) [0] incomplete)")
    assert [decision.details["strategy"] for decision in job.events(ev.DECISION)] == [
        "elastic-training", "job-restart"]

    data_parallel = sharded_job(make_job, mesh_shard=0, nnodes=4, nproc_per_node=1)
    plans = leave_and_check_in(data_parallel, [1])
    assert {tuple(plan.members) for plan in plans.values()} == {(0, 2, 3)}


@pytest.mark.parametrize(("elastic_batch", "shrinks"), [("grow", False), ("accumulate", True)])
def test_grow_needs_the_replicas_left_to_divide_the_jobs(make_job, elastic_batch: str, shrinks: bool):
    """3 x 2 mesh, node 2 (replica 2) lost: 6 slots over 4 ranks is 2, 2, 1, 1 slots, which one FSDP
    divide factor cannot weight in ``grow``; ``accumulate`` sums micro-batches and can."""
    job = sharded_job(make_job, mesh_shard=2, nnodes=3, nproc_per_node=2, elastic_batch=elastic_batch)
    plans = leave_and_check_in(job, [2])
    assert bool(job.events(ev.ELASTIC_SHRINK)) == shrinks
    if shrinks:
        assert {tuple(plan.members) for plan in plans.values()} == {(0, 1, 2, 3)}
    else:
        assert "elastic_batch grow on a sharded mesh needs the replicas left (2) to divide the job's (3)" in \
            job.events(ev.RECOVERY_FAILED)[0].details["why"]


def test_incomplete_replicas_are_those_with_some_ranks_but_not_all() -> None:
    membership = Membership(nnodes=4, nproc_per_node=1)
    assert membership.incomplete_replicas([0, 2]) == []  # data parallel: no replicas to keep whole
    membership.mesh_shard = 2
    assert membership.incomplete_replicas([0, 1, 2, 3]) == []
    assert membership.incomplete_replicas([2, 3]) == []
    assert membership.incomplete_replicas([0, 2, 3]) == [0]
    assert membership.incomplete_replicas({1, 2}) == [0, 1]


def test_the_worker_mesh_takes_whole_replicas_only() -> None:
    assert surviving_replicas([0, 1, 2, 3], 2, 2) == [0, 1]
    assert surviving_replicas([2, 3], 2, 2) == [1]
    for members in ([0, 2, 3], [4, 5], []):
        with pytest.raises(ValueError, match="^mesh: the generation's ranks .* are not whole replicas") as error:
            surviving_replicas(members, 2, 2)
        assert "\n" not in str(error.value)


def test_a_shrunk_mesh_renumbers_the_replicate_group_and_keeps_the_device_mesh() -> None:
    """Replica 0 lost: rank 3 is the only member of its column's replicate group (rank 0 of 1),
    its shard group is unchanged, and the DeviceMesh FSDP holds keeps the job's shape."""
    mesh = SwappableMesh(3, 2, 2, "gloo", torch.device("cpu"))
    replicate, shard = mesh.groups
    mesh.take_members([2, 3])
    assert (replicate.members, replicate.rank(), replicate.size(), mesh.replicas) == ([3], 0, 1, 1)
    assert (shard.members, shard.rank(), shard.size()) == ([2, 3], 1, 2)
    assert mesh.device_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    mesh.take_members([0, 1, 2, 3])  # grown back
    assert (replicate.members, replicate.rank(), replicate.size(), mesh.replicas) == ([1, 3], 1, 2, 2)


def test_torch_maps_a_shrunk_groups_ranks_to_the_default_groups() -> None:
    """torch converts a group rank to a rank of its default group (``group_src``, c10d's logs); after
    a shrink the default group holds the ranks left, renumbered."""
    from torch.distributed import distributed_c10d

    mesh = SwappableMesh(3, 2, 2, "gloo", torch.device("cpu"))
    mesh.take_members([2, 3])
    mesh.register()
    replicate, shard = mesh.groups
    assert distributed_c10d._world.pg_group_ranks[replicate] == {1: 0}
    assert distributed_c10d._world.pg_group_ranks[shard] == {0: 0, 1: 1}


@pytest.mark.parametrize(("mesh_shard", "elastic_batch", "grows_with_node_2_alone"), [
    (2, "accumulate", False),  # 2 x 2: ranks 0, 1, 2 would be half a replica
    (1, "grow", False),  # 4 x 1: 3 replicas do not divide the job's 4 slots evenly
    (1, "accumulate", True),
])
def test_the_job_grows_back_by_whole_replicas_only(make_job, mesh_shard: int, elastic_batch: str,
                                                   grows_with_node_2_alone: bool):
    """4 nodes of one rank, trained on as ranks 0 and 1 after nodes 2 and 3 were dropped; node 2 is
    back before node 3."""
    job = sharded_job(make_job, mesh_shard=mesh_shard, nnodes=4, nproc_per_node=1, elastic_batch=elastic_batch)
    machine = job.controller.machine
    membership = machine.membership
    membership.members = [0, 1]  # as the shrink leaves it
    for rank in (2, 3):
        membership.ranks.pop(rank)
    membership.nodes[3].alive = False
    grow_if_nodes_returned(machine, job.now())
    if grows_with_node_2_alone:
        assert machine.pending_grow is not None and machine.pending_grow.newcomers == {2}
        return
    assert machine.pending_grow is None
    membership.nodes[3].alive = True
    grow_if_nodes_returned(machine, job.now())
    assert machine.pending_grow is not None and machine.pending_grow.newcomers == {2, 3}
