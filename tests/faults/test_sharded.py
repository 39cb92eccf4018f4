"""A sharded model (FSDP2 HSDP on a 2 x 2 mesh from ft.device_mesh) under real faults: a killed worker,
a lost node, a hung worker, an exception, and a job restart. The survivors keep their processes, a
replacement receives its shard from the rank that holds it in the other replica, and the final
parameters (gathered whole) are bitwise equal to a fault-free run on the same mesh."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import FINAL_STATE, STEPS, JobRun, assert_ends_bitwise, run_job
from undying import events as ev

pytestmark = pytest.mark.faults

MESH = ["--mesh", "2x2"]  # rows are replicas: node 0 holds replica 0 (ranks 0, 1), node 1 replica 1
PROCESS_LEVEL = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
                 "--recover-strategy", "retry,recover-in-place,recover"]
# T1 snapshots only at checkpoint steps: a replacement's node memory lacks the step it resumes
# from, so its shard comes from the other replica (tests/faults/test_t1_repair.py: from T1).
PEER_ONLY = ["--set", "checkpoint.snapshot_interval=0"]


def assert_bitwise(run: JobRun, reference: JobRun) -> None:
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference)


def assert_survivors_kept(run: JobRun, replaced: set[int]) -> None:
    assert not run.kinds(ev.RESTART_BEGIN), "a process-level fault must not restart the job"
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    recovered = {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED)}
    for rank in range(4):
        assert (recovered[rank] != first[rank]) == (rank in replaced), (rank, first, recovered)
    # A replacement joins its generation before it builds its model: its phases are timed from the join.
    assert all(e.details["wait_for_plan"] >= 0 for e in run.kinds(ev.RECOVERED)), run.kinds(ev.RECOVERED)


def shards_received(run: JobRun) -> dict[int, int]:
    """Receiving rank -> the rank that sent it its shard."""
    return {e.rank: e.details["donor"] for e in run.kinds(ev.SHARD_RECEIVED)}


def test_the_reference_trains_a_sharded_model(hsdp_reference: JobRun) -> None:
    """The run every other one is compared with really shards: its parameters are DTensors over the
    mesh, and gathered whole they are what its digest covers."""
    assert hsdp_reference.result["final_step"] == STEPS
    final = torch.load(hsdp_reference.run_dir / FINAL_STATE)
    assert final["transformer.wte.weight"].dim() == 2
    records = [e for e in hsdp_reference.kinds(ev.CHECKPOINT_SAVE)]
    assert records, "periodic checkpoints of a sharded job"


def test_the_sharded_checkpoint_loads_with_plain_dcp_into_an_unsharded_model(hsdp_reference: JobRun) -> None:
    """Every rank wrote its own shards into one DCP checkpoint; plain torch.distributed.checkpoint,
    in one process without any mesh, puts the whole parameters back together, bit for bit."""
    import torch.distributed.checkpoint as dcp

    from undying.checkpoint import list_committed

    final = torch.load(hsdp_reference.run_dir / FINAL_STATE)
    [last] = [c for c in list_committed(hsdp_reference.run_dir / "checkpoints") if c.step == STEPS]
    data_files = sorted(record.name for record in last.manifest.files if record.name.endswith(".distcp"))
    assert len(data_files) > 1, data_files  # written by several ranks, not gathered on one
    model = {name: torch.empty_like(tensor) for name, tensor in final.items()}
    dcp.load({"model": model}, checkpoint_id=str(last.path))
    assert all(torch.equal(model[name], final[name]) for name in final)


def test_a_killed_worker_gets_its_shard_from_its_replica_peer(hsdp_reference: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, [*PROCESS_LEVEL, *PEER_ONLY, "--inject", "kill:rank=3:step=15"], script_args=MESH)
    assert_bitwise(run, hsdp_reference)
    assert_survivors_kept(run, {3})
    assert run.kinds(ev.DECISION)[-1].details["strategy"] == "recover-in-place"
    assert shards_received(run) == {3: 1}  # rank 1 holds shard 1 in replica 0


def test_a_lost_node_is_recovered_onto_a_spare_from_the_other_replica(hsdp_reference: JobRun,
                                                                        tmp_path: Path) -> None:
    run = run_job(tmp_path, [*PROCESS_LEVEL, "--standby", "1", "--inject", "node:node=1:step=15"],
                  script_args=MESH)
    assert_bitwise(run, hsdp_reference)
    assert_survivors_kept(run, {2, 3})
    assert run.kinds(ev.DECISION)[-1].details["strategy"] == "recover"
    assert shards_received(run) == {2: 0, 3: 1}


def test_a_hung_worker_is_replaced_and_the_survivors_give_up_its_collectives(hsdp_reference: JobRun,
                                                                             tmp_path: Path) -> None:
    run = run_job(tmp_path, [*PROCESS_LEVEL, *PEER_ONLY, "--inject", "hang:rank=2:step=12"], script_args=MESH)
    assert_bitwise(run, hsdp_reference)
    assert_survivors_kept(run, {2})
    assert shards_received(run) == {2: 0}


def test_an_exception_in_a_step_is_retried_in_the_same_processes(hsdp_reference: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, [*PROCESS_LEVEL, "--inject", "raise:rank=1:step=12"], script_args=MESH)
    assert_bitwise(run, hsdp_reference)
    assert_survivors_kept(run, set())
    assert run.kinds(ev.DECISION)[-1].details["strategy"] == "retry"
    assert not shards_received(run)


def test_a_job_restart_restores_every_rank_its_own_shard(hsdp_reference: JobRun, tmp_path: Path) -> None:
    """The default chain (job restart): every rank restores its own shard from its T1 snapshot."""
    run = run_job(tmp_path, ["--inject", "kill:rank=3:step=15"], script_args=MESH)
    assert_bitwise(run, hsdp_reference)
    assert run.kinds(ev.RESTART_BEGIN)
    loads = run.kinds(ev.CHECKPOINT_LOAD)
    assert loads and {e.details["source"] for e in loads} == {"memory"}, [e.details for e in loads]


def test_a_job_restart_from_storage_loads_every_rank_its_own_shard(hsdp_reference: JobRun, tmp_path: Path) -> None:
    """A lost node takes its ranks' T1 snapshots with it: the restart reads the periodic checkpoint of
    step 10 from storage, each rank its own shard from its rank file."""
    run = run_job(tmp_path, ["--set", "checkpoint.snapshot_interval=0", "--inject", "node:node=1:step=15:committed=10"],
                  script_args=MESH)
    assert_bitwise(run, hsdp_reference)
    loads = run.kinds(ev.CHECKPOINT_LOAD)
    assert loads and {e.details["source"] for e in loads} == {"storage"}, [e.details for e in loads]
    assert {e.step for e in loads} == {10}


def test_a_dump_writes_every_shard_into_one_dcp_checkpoint_and_the_restart_loads_it(hsdp_reference: JobRun,
                                                                                      tmp_path: Path) -> None:
    """The dying checkpoint of a sharded job: ranks 0-2 (the holders of the step) write their shards
    into one DCP checkpoint, as a periodic one is written, and their rank files; rank 1 also writes
    the killed rank 3's rank file (its mirrored RNG; its shard, rank 1's, is in the DCP files). Plain
    ``dcp.load`` puts the whole parameters back together from it, and the restart reads it from
    storage, as the newest state (no T1 snapshot of that step, no periodic checkpoint)."""
    import torch.distributed.checkpoint as dcp

    from undying.checkpoint import list_committed

    run = run_job(tmp_path, ["--set", "process_recover=true", "--recover-strategy", "dump",
                             "--checkpoint-interval", "100", "--set", "checkpoint.snapshot_interval=0",
                             "--inject", "kill:rank=3:step=15"], script_args=MESH)
    assert_bitwise(run, hsdp_reference)
    [dumped] = run.kinds(ev.DUMP_COMMITTED)
    assert dumped.step in (14, 15) and dumped.details["writers"] == [0, 1, 2], dumped.details
    [restart] = run.kinds(ev.RESTART_BEGIN)
    loads = [e for e in run.kinds(ev.CHECKPOINT_LOAD) if e.time > restart.time]
    assert {(e.details["source"], e.details["dump"], e.step) for e in loads} == {("storage", True, dumped.step)}

    [dump] = [c for c in list_committed(run.run_dir / "checkpoints") if c.step == dumped.step]
    assert dump.manifest.meta["dump"]
    names = sorted(record.name for record in dump.manifest.files)
    assert ".metadata" in names and sum(name.endswith(".distcp") for name in names) > 1, names
    assert [name for name in names if name.startswith("rank_")] == [f"rank_{rank:05d}.pt" for rank in range(4)]
    final = torch.load(hsdp_reference.run_dir / FINAL_STATE)
    model = {name: torch.full_like(tensor, float("nan")) for name, tensor in final.items()}
    dcp.load({"model": model}, checkpoint_id=str(dump.path))  # no process group, no mesh, no undying
    assert all(bool(torch.isfinite(tensor).all()) for tensor in model.values())
    # The weights of step 14 or 15, not the final ones.
    assert not torch.equal(model["transformer.wte.weight"], final["transformer.wte.weight"])


def test_a_restart_on_another_mesh_reshards_the_checkpoint_through_dcp(hsdp_reference: JobRun, tmp_path: Path) -> None:
    """A 2 x 2 job checkpoints at step 20; the next job, sharded 1 x 4, loads that checkpoint (each
    rank the parts of the saved chunks its own shard covers) and trains on. What it restored, the
    parameters and every optimizer state tensor gathered whole, is bitwise what the 2 x 2 job held at
    step 20 (a job of 20 steps on 1 x 4 restores and trains nothing). Its first step computes the
    reference's loss of step 20 to the printed digit; its parameters at the end differ from the
    2 x 2 run's only by the reduction order of 10 steps (measured: 5.6e-5 at most)."""
    checkpoints = ["--checkpoint-dir", str(tmp_path / "checkpoints")]
    saved = ["--final-state", str(tmp_path / "2x2.pt"), "--final-optimizer-state", str(tmp_path / "2x2-opt.pt")]
    first = run_job(tmp_path / "2x2", checkpoints, steps=20, script_args=[*MESH, *saved])
    assert first.returncode == 0, first.output + first.logs()
    # On a copy of the checkpoints: whatever the restoring job writes, the next one reads the 2 x 2's.
    shutil.copytree(tmp_path / "checkpoints", tmp_path / "copy")
    restored = ["--final-state", str(tmp_path / "restored.pt"),
                "--final-optimizer-state", str(tmp_path / "restored-opt.pt")]
    restoring = run_job(tmp_path / "1x4-restore", ["--checkpoint-dir", str(tmp_path / "copy")], steps=20,
                        script_args=["--mesh", "1x4", *restored])
    assert restoring.returncode == 0, restoring.output + restoring.logs()
    for name in ("", "-opt"):
        before, after = torch.load(tmp_path / f"2x2{name}.pt"), torch.load(tmp_path / f"restored{name}.pt")
        assert sorted(after) == sorted(before) and len(before) > 1, (sorted(before), sorted(after))
        differ = [key for key in before if not torch.equal(before[key], after[key])]
        assert not differ, f"restored on 1 x 4 unlike the 2 x 2 job's step 20: {differ}"
    assert any(key.endswith(".exp_avg_sq") for key in torch.load(tmp_path / "restored-opt.pt"))
    final = tmp_path / "1x4.pt"
    second = run_job(tmp_path / "1x4", checkpoints, script_args=["--mesh", "1x4", "--final-state", str(final)])
    assert second.returncode == 0, second.output + second.logs()
    assert second.result["final_step"] == STEPS
    loads = second.kinds(ev.CHECKPOINT_LOAD)
    assert {(e.rank, e.step, e.details["source"]) for e in loads} == {(rank, 20, "storage") for rank in range(4)}
    step_20 = "step    20 | loss"
    line = next(line for line in (second.run_dir / "logs" / "rank0.log").read_text().splitlines() if step_20 in line)
    assert line in (hsdp_reference.run_dir / "logs" / "rank0.log").read_text()
    ours, reference = torch.load(final), torch.load(hsdp_reference.run_dir / FINAL_STATE)
    assert max(float((ours[name].double() - reference[name].double()).abs().max()) for name in reference) < 1e-3


def test_parameters_kept_whole_through_the_step_zero2_style_recover_bitwise(hsdp_reference: JobRun,
                                                                             tmp_path: Path) -> None:
    """``fully_shard(..., reshard_after_forward=False)`` (parameters gathered once per step, gradients and
    optimizer state sharded: ZeRO-2's memory) trains the same bits, and a killed worker's survivors drop
    the parameters they held whole for the failed step's backward."""
    run = run_job(tmp_path, [*PROCESS_LEVEL, *PEER_ONLY, "--inject", "kill:rank=2:step=15"],
                  script_args=[*MESH, "--keep-unsharded"])
    assert_bitwise(run, hsdp_reference)
    assert_survivors_kept(run, {2})
    assert shards_received(run) == {2: 0}
