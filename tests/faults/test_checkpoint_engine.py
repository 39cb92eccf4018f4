"""The checkpoint engine with real processes and real faults: a persister killed mid-write never
leaves a checkpoint anyone lists or loads (on a local directory and behind an fsspec URL), a
checkpoint reshards across world sizes with every sample used exactly once, and no job leaves
shared memory behind. The restart from node memory
(T1) after a SIGKILLed worker is tested in tests/faults/test_job_restart.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, JobRun, assert_ends_bitwise, run_job
from undying import events as ev
from undying.checkpoint import list_committed
from undying.data import EPOCH_SEED_STRIDE
from undying.shm import job_dir

pytestmark = pytest.mark.faults

EXAMPLE_SEED = 0  # examples/gpt/train.py --seed default: the loader's seed


def assert_no_shared_memory_left(run: JobRun) -> None:
    job_id = run.kinds(ev.JOB_START)[0].details["job_id"]
    assert not job_dir(job_id).exists(), f"{job_dir(job_id)} left behind"


def test_persister_killed_mid_write_leaves_no_checkpoint(reference_run: JobRun, tmp_path: Path) -> None:
    """Node 0 (rank 0, the committer, with its memory) dies while persisting step 20: the shard is on
    disk, the manifest is not. The restart must not see step 20: it loads step 10 from storage."""
    run = run_job(tmp_path, ["--inject", "node:node=0:step=20:at=persist"])
    assert run.returncode == 0, run.output + run.logs()
    assert [event.details["spec"] for event in run.kinds(ev.INJECTION)] == ["node:node=0:step=20:at=persist"]
    loads = [event for event in run.kinds(ev.CHECKPOINT_LOAD) if event.rank == 0]
    assert [(event.step, event.details["source"]) for event in loads] == [(10, "storage")]
    first_generation_saves = [event.step for event in run.kinds(ev.CHECKPOINT_SAVE) if event.generation == 1]
    assert first_generation_saves == [10]
    assert_ends_bitwise(run, reference_run)
    committed = {ckpt.step: ckpt.manifest.generation for ckpt in list_committed(tmp_path / "checkpoints")}
    assert committed == {20: 2, 30: 2}, committed  # step 20 exists only as re-written after the restart
    assert not list((tmp_path / "checkpoints").glob("*.partial"))
    assert_no_shared_memory_left(run)


def test_url_checkpoint_dir_survives_a_persister_killed_mid_write(reference_run: JobRun, tmp_path: Path) -> None:
    """The same fault with ``checkpoint.dir`` a ``file://`` URL, which takes the fsspec path that object
    stores take (no staging rename: files written in place, the manifest last). Node 0 dies with its
    memory (T1) while persisting step 20, so the restart must come from storage: step 10."""
    root = f"file://{tmp_path}/ckpt"
    run = run_job(tmp_path / "run", ["--checkpoint-dir", root, "--inject", "node:node=0:step=20:at=persist"])
    assert run.returncode == 0, run.output + run.logs()
    loads = [event for event in run.kinds(ev.CHECKPOINT_LOAD) if event.rank == 0]
    assert [(event.step, event.details["source"], event.details["path"]) for event in loads] == [
        (10, "storage", f"{root}/step_000000010.g1")]
    saves = [(event.step, event.details["path"]) for event in run.kinds(ev.CHECKPOINT_SAVE)]
    assert saves == [(10, f"{root}/step_000000010.g1"), (20, f"{root}/step_000000020.g2"),
                     (30, f"{root}/step_000000030.g2")]
    assert_ends_bitwise(run, reference_run)
    assert {ckpt.step: ckpt.path for ckpt in list_committed(root)} == {
        20: f"{root}/step_000000020.g2", 30: f"{root}/step_000000030.g2"}
    # The killed write (step 20 of generation 1, no manifest) was removed at the restart; step 10 was
    # pruned (keep: 2) after step 30 was committed.
    left = {path.name: sorted(file.name for file in path.iterdir()) for path in (tmp_path / "ckpt").iterdir()}
    assert left == {name: [".metadata", "MANIFEST.json", "__0_0.distcp"] + [f"rank_{r:05d}.pt" for r in range(4)]
                    for name in ("step_000000020.g2", "step_000000030.g2")}, left
    assert_no_shared_memory_left(run)


def test_checkpoint_reshards_4_to_2_to_4_exactly_once(tmp_path: Path) -> None:
    """Three jobs share one checkpoint directory: 4 ranks to step 20, 2 ranks to step 30, 4 ranks to
    step 40. Concatenated in step and rank order, the samples they used are a prefix of the epoch's
    global order: nothing skipped, nothing repeated."""
    checkpoints = tmp_path / "checkpoints"
    sizes = [(4, 20), (2, 30), (4, 40)]
    runs = []
    for index, (world, steps) in enumerate(sizes):
        nodes = ["--nnodes", "1", "--nproc-per-node", "2"] if world == 2 else []
        run = run_job(tmp_path / f"run{index}", [*nodes, "--checkpoint-dir", str(checkpoints)], steps=steps)
        assert run.returncode == 0, run.output + run.logs()
        assert run.result["final_step"] == steps and run.result["world_size"] == world
        runs.append(run)
        assert_no_shared_memory_left(run)
    for run, (resumed_from, world) in zip(runs[1:], [(20, 2), (30, 4)], strict=True):
        loads = run.kinds(ev.CHECKPOINT_LOAD)
        assert len(loads) == world and {(e.step, e.details["source"]) for e in loads} == {(resumed_from, "storage")}

    consumed: dict[int, list[int]] = {}
    steps_seen: list[int] = []
    for run in runs:
        for step, records in sorted(run.samples().items()):
            steps_seen.append(step)
            for record in sorted(records, key=lambda r: r["rank"]):
                [loader] = record["loaders"]
                consumed.setdefault(loader["epoch"], []).extend(loader["indices"])
    assert steps_seen == list(range(40))
    text_length = len((REPO / "examples" / "gpt" / "input.txt").read_text())
    dataset_len = text_length - 32  # CharDataset with the example's block size
    for epoch, indices in consumed.items():
        generator = torch.Generator().manual_seed(EXAMPLE_SEED * EPOCH_SEED_STRIDE + epoch)
        order = torch.randperm(dataset_len, generator=generator).tolist()
        assert indices == order[:len(indices)], f"epoch {epoch}: not the global order"
    # 4 ranks x 4 samples for 20 steps, 2 x 4 for 10, 4 x 4 for 10.
    assert sum(len(indices) for indices in consumed.values()) == 20 * 16 + 10 * 8 + 10 * 16
