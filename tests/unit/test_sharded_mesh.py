"""The sharded job's mesh: what ft.device_mesh refuses (one error line naming the field and what is
allowed), which rank a replacement takes its shard from, and the mesh torch sees."""

from __future__ import annotations

import pytest
import torch

from undying.runtime.sharded import ShardLost, make_mesh, shard_donors, wrap_sharded

CPU = torch.device("cpu")


def mesh_of(rank: int = 0, world: int = 4, replicate: int = 2, shard: int | None = 2,
            strategies: tuple[str, ...] = ("recover-in-place",), t1_snapshots: bool = True):
    return make_mesh(rank, world, replicate, shard, list(strategies), "gloo", CPU, t1_snapshots=t1_snapshots)


@pytest.mark.parametrize(("replicate", "shard"), [(3, 2), (2, 3), (0, 4), (4, 0)])
def test_a_mesh_that_does_not_cover_the_job_is_refused(replicate: int, shard: int) -> None:
    with pytest.raises(ValueError, match=r"^ft.device_mesh: replicate") as error:
        mesh_of(replicate=replicate, shard=shard)
    assert "\n" not in str(error.value)


def test_elastic_training_needs_a_second_replica() -> None:
    """HSDP shrinks by whole replicas; pure FSDP has no replica to train on without a lost rank."""
    mesh = mesh_of(strategies=("recover-in-place", "elastic-training"))
    assert (mesh.replicate, mesh.shard) == (2, 2)
    with pytest.raises(ValueError, match="^ft.device_mesh: recover_strategy elastic-training .*replicate=1; "
                                         "allowed with this mesh: retry, recover-in-place, job-restart, exit$"):
        mesh_of(replicate=1, shard=4, strategies=("recover-in-place", "elastic-training"))


def test_pure_fsdp_refuses_the_strategies_that_need_a_replica() -> None:
    """A lost node's T1 and a dump's writer need another replica; recover-in-place needs only the
    node's own T1 snapshot of the lost rank."""
    with pytest.raises(ValueError, match=r"recover_strategy recover, dump .*replicate=1 \(recover needs peer copies "
                                         r"of T1: checkpoint.peer_copy auto.*\); allowed with "
                                         r"this mesh: retry, recover-in-place, job-restart, exit$") as error:
        mesh_of(replicate=1, shard=4, strategies=("retry", "recover-in-place", "recover", "dump"))
    assert "\n" not in str(error.value)


def test_pure_fsdp_with_peer_copies_recovers_a_lost_node_but_refuses_dump() -> None:
    """With T1 copied to the next node (runtime/peer_copy.py) a lost node's shards come back from
    memory: recover is allowed; a dump still needs a replica of each shard to write it."""
    mesh = make_mesh(0, 4, 1, 4, ["retry", "recover-in-place", "recover"], "gloo", CPU, t1_snapshots=True,
                     peer_copies=True)
    assert (mesh.replicate, mesh.shard) == (1, 4)
    with pytest.raises(ValueError, match=r"recover_strategy dump .*allowed with this mesh: retry, "
                                         r"recover-in-place, recover, job-restart, exit$"):
        make_mesh(0, 4, 1, 4, ["recover", "dump"], "gloo", CPU, t1_snapshots=True, peer_copies=True)


def test_pure_fsdp_recovers_in_place_from_t1() -> None:
    mesh = mesh_of(replicate=1, shard=4, strategies=("retry", "recover-in-place", "job-restart"))
    assert (mesh.replicate, mesh.shard) == (1, 4)


def test_pure_fsdp_refuses_recover_in_place_without_t1_snapshots() -> None:
    with pytest.raises(ValueError, match=r"^ft.device_mesh: recover_strategy recover-in-place .*replicate=1 "
                                         r"\(recover-in-place needs T1 snapshots: checkpoint.snapshot_interval "
                                         r">= 1 or auto\); allowed with this mesh: retry, job-restart, exit$") as error:
        mesh_of(replicate=1, shard=4, strategies=("recover-in-place",), t1_snapshots=False)
    assert "\n" not in str(error.value)


def test_hsdp_recovers_in_place_from_a_replica_without_t1_snapshots() -> None:
    mesh = mesh_of(strategies=("recover-in-place", "recover", "dump"), t1_snapshots=False)
    assert (mesh.replicate, mesh.shard) == (2, 2)


def test_the_shard_dim_defaults_to_what_the_replicas_leave() -> None:
    mesh = mesh_of(replicate=1, shard=None, strategies=("retry",))
    assert (mesh.replicate, mesh.shard) == (1, 4)


def test_the_mesh_torch_sees_places_each_rank_at_its_replica_and_shard() -> None:
    mesh = mesh_of(rank=3)
    device_mesh = mesh.device_mesh
    assert device_mesh.mesh_dim_names == ("replicate", "shard")
    assert device_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert list(device_mesh.get_coordinate()) == [1, 1]
    replicate, shard = mesh.groups
    assert replicate.members == [1, 3] and shard.members == [2, 3]
    assert device_mesh.get_group("replicate") is replicate and device_mesh.get_group("shard") is shard


def test_a_replacement_takes_its_shard_from_the_first_replica_that_kept_it() -> None:
    mesh = mesh_of()
    assert shard_donors(mesh, [3], [0, 1, 2, 3]) == {3: 1}
    assert shard_donors(mesh, [2, 3], [0, 1, 2, 3]) == {2: 0, 3: 1}
    assert shard_donors(mesh, [0], [0, 1, 2, 3]) == {0: 2}


def test_a_shard_no_replica_kept_cannot_be_repaired() -> None:
    with pytest.raises(ShardLost, match="shard 1"):
        shard_donors(mesh_of(), [1, 3], [0, 1, 2, 3])
    with pytest.raises(ShardLost):
        shard_donors(mesh_of(replicate=1, shard=4, strategies=()), [2], [0, 1, 2, 3])  # pure FSDP: no replica


def test_wrapping_needs_both_the_mesh_and_a_sharded_model() -> None:
    with pytest.raises(ValueError, match="apply fully_shard"):
        wrap_sharded(torch.nn.Linear(2, 2), mesh_of(), joining=False)
    with pytest.raises(ValueError, match="ft.device_mesh"):
        wrap_sharded(torch.nn.Linear(2, 2), None, joining=False)


FOREIGN_MESH = '''
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from undying.runtime.sharded import make_mesh, wrap_sharded

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
ours = make_mesh(0, 1, 1, 1, [], "gloo", torch.device("cpu"))
mine = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh=ours.device_mesh)
print("ours:", type(wrap_sharded(mine, ours, joining=False)).__name__)
theirs = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh=init_device_mesh("cpu", (1,)))
try:
    wrap_sharded(theirs, ours, joining=False)
except ValueError as error:
    print("theirs:", error)
dist.destroy_process_group()
'''


def test_a_model_sharded_over_a_mesh_of_its_own_is_refused() -> None:
    """Its groups would die with the generation: only ft.device_mesh's survive a recovery. (A process
    of its own: torch's default group is global state.)"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FOREIGN_MESH], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ours: ShardedModel" in done.stdout
    assert "theirs: ft.wrap_model:" in done.stdout and "did not build" in done.stdout, done.stdout


def test_a_sharded_dump_is_written_by_every_holder_and_for_each_lost_rank_by_its_replica_peer() -> None:
    from undying.protocol import Plan
    from undying.runtime.dying_checkpoint import MIRRORED, OWN, dump_files

    mesh = mesh_of()
    plan = Plan(action="dump", source_rank=0, target_step=15, members=[0, 1, 2, 3], holders=[0, 1, 2])
    assert dump_files(plan, 0, plan.members, mesh) == {0: OWN}
    assert dump_files(plan, 1, plan.members, mesh) == {1: OWN, 3: MIRRORED}  # rank 3 held shard 1, as rank 1
    assert dump_files(plan, 2, plan.members, mesh) == {2: OWN}
    assert dump_files(plan, 3, plan.members, mesh) == {}
    # Data parallel: the source writes every rank's file.
    assert dump_files(plan, 0, plan.members, None) == dict.fromkeys([0, 1, 2, 3], MIRRORED)
    assert dump_files(plan, 1, plan.members, None) == {}
    lost_shard = Plan(action="dump", source_rank=0, target_step=15, members=[0, 1, 2, 3], holders=[0, 2])
    with pytest.raises(ShardLost, match="shard 1"):
        dump_files(lost_shard, 0, lost_shard.members, mesh)
