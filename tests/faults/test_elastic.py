"""Elastic training with real processes: a node killed and kept away is dropped after the reschedule
wait, the survivors train on in their own processes with the global batch kept; when the node
returns the job grows back; a later job restart restarts at the shrunk size. Sample order is
compared step by step with a fault-free run, loss and parameters within the tolerance of a
changed float summation order (docs/elastic.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import FINAL_STATE, STEPS, JobRun, run_job
from undying import events as ev
from undying.data import replica_slots

pytestmark = pytest.mark.faults

ELASTIC = ["--set", "process_recover=true", "--recover-strategy", "elastic-training"]
WORLD = 4
# Relative difference allowed between the elastic and the fault-free run's global mean loss at
# any step, and absolute difference of any final parameter. The elastic run adds the same
# per-sample gradient terms in another order (two micro-batches summed before a 2-rank ring
# all-reduce, or one 8-sample matmul, instead of a 4-rank ring), so each step's gradient differs
# in the last bits (~1e-7 relative); AdamW, which divides every coordinate's update by its own
# running RMS, amplifies that over the steps. Measured (docs/elastic.md): loss <= 2e-6 relative
# after 20 shrunk steps (accumulate); <= 9e-4 in a 150-step run with a grow-back (grow). Final
# parameters after these tests' 30 steps: 7.3e-4 shrunk at step 3 (grow, grown back
# or not), 2.3e-4 shrunk at step 10 (accumulate; 1.0e-4 with dropout), 1.9e-4 with a job restart
# while shrunk (grow). PARAM_ATOL is about 3x the largest. Dropout masks drawn from the wrong
# stream put the parameters 8e-2 apart and the loss of a step 1e-2.
# The gradient's scale is not visible through AdamW; tests/unit/test_elastic_gradients.py checks it.
LOSS_RTOL = 5e-3
PARAM_ATOL = 2e-3


def global_loss(records: list[dict]) -> float:
    """The mean loss over the step's whole global batch, from each rank's share of it."""
    return sum(record["loss"] * record["loaders"][0]["slots"] for record in records) / WORLD


def step_samples(records: list[dict]) -> list[int]:
    return sorted(index for record in records for loader in record["loaders"] for index in loader["indices"])


def last_run_of_each_step(samples: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """A job restart re-runs the steps after the checkpoint it loaded: keep each step's last run."""
    return {step: [r for r in records if r["generation"] == max(r["generation"] for r in records)]
            for step, records in samples.items()}


def steps_a_survivor_took_from_a_peer(run: JobRun) -> dict[int, set[int]]:
    """Step -> survivors that did not commit it themselves but received it from a peer's replica.

    A grow ends the shrunk generation "at a step boundary" through the same abort a fault uses: a
    rank still waiting in that step's all-reduce abandons it (runtime/pg.py ``_wait``) while its
    peer, whose all-reduce had completed, applies the step. The plan then targets the newer step
    and the laggard is one of its receivers: the job is consistent, but the laggard's sample
    record of that step is missing (seen once in four runs here)."""
    took: dict[int, set[int]] = {}
    members = {0, 1}  # the shrunk job's ranks (node 0's)
    for plan in run.kinds(ev.RECOVERY_PLAN):
        laggards = set(plan.details["receivers"]) & members
        if laggards and plan.step:
            took.setdefault(plan.step - 1, set()).update(laggards)
    # The same for a rank of the node that left: stopped between a step every rank committed (at the
    # full size) and its sample record of it (seen once in CI, a planned leave).
    samples = run.samples()
    for shrink in run.kinds(ev.ELASTIC_SHRINK):
        for rank in shrink.details["dropped_ranks"]:
            # Its last record before the shrink (a node that comes back logs later steps again).
            last = max((step for step, records in samples.items()
                        if any(r["rank"] == rank and r["generation"] < shrink.generation for r in records)),
                       default=-1)
            records = samples.get(last + 1, [])
            if any(r["replicas"] == shrink.details["old_world_size"] for r in records):
                took.setdefault(last + 1, set()).add(rank)
    return took


def assert_samples_kept(samples: dict[int, list[dict]], expected: dict[int, list[dict]],
                        took: dict[int, set[int]], steps: int, loss_rtol: float) -> None:
    """Every step used the fault-free run's samples, none twice, at a global loss within ``loss_rtol``;
    a step in ``took`` (steps_a_survivor_took_from_a_peer) lacks the records of those ranks: its
    samples are a subset of the fault-free run's. A step in ``took`` whose records are all there (a job
    restart ran it again, at the shrunk size) is checked as every other step."""
    for step in range(steps):
        indices = step_samples(samples[step])
        assert len(indices) == len(set(indices)), f"step {step} used a sample twice"
        if step in took and indices != step_samples(expected[step]):
            assert not took[step] & {record["rank"] for record in samples[step]}, f"step {step}"
            assert set(indices) < set(step_samples(expected[step])), f"step {step} used other samples"
            continue
        assert indices == step_samples(expected[step]), f"step {step} used other samples"
        assert global_loss(samples[step]) == pytest.approx(global_loss(expected[step]), rel=loss_rtol), step


def assert_first_shrunk_step_replays_the_full_job(samples: dict[int, list[dict]],
                                                 expected: dict[int, list[dict]]) -> None:
    """The first step after a shrink starts from the fault-free run's parameters, and with
    elastic_batch accumulate each slot's micro-batch computes what its own rank computed in the
    fault-free run: the same samples and, drawn from that rank's RNG stream, the same dropout masks.
    So each survivor's loss, the mean over its slots, is the fault-free ranks' mean bit for bit."""
    step = min(step for step, records in samples.items() if any(r["replicas"] < WORLD for r in records))
    full = {record["rank"]: record["loss"] for record in expected[step]}
    for record in samples[step]:
        first, count = replica_slots(record["group_rank"], record["replicas"], WORLD)
        assert record["loss"] == sum(full[slot] for slot in range(first, first + count)) / count, (step, record)


def assert_same_samples_and_close(run: JobRun, reference: JobRun, steps: int, rerun: bool = False) -> float:
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["final_step"] == steps
    samples, expected = run.samples(), reference.samples()
    if rerun:
        samples = last_run_of_each_step(samples)
    assert sorted(samples) == list(range(steps)) == sorted(expected)
    # A rank of the lost node killed between a step every rank committed and its record of that
    # step leaves that one record missing (seen in CI: rank 3's record of step 9).
    assert_samples_kept(samples, expected, steps_a_survivor_took_from_a_peer(run), steps, LOSS_RTOL)
    final = torch.load(run.run_dir / FINAL_STATE)
    fault_free = torch.load(reference.run_dir / FINAL_STATE)
    worst = max((final[name] - fault_free[name]).abs().max().item() for name in fault_free)
    assert worst <= PARAM_ATOL, f"parameters differ by up to {worst}"
    return worst


def run_elastic(tmp_path: Path, extra: list[str], wait: float = 2.0, script_args: list[str] | None = None) -> JobRun:
    return run_job(tmp_path, [*ELASTIC, *extra], STEPS,
                   script_args=["--final-state", str(tmp_path / FINAL_STATE), *(script_args or [])],
                   reschedule_wait=wait)


def test_a_node_that_does_not_return_is_dropped_and_training_goes_on_with_dropout_as_close_as_without(
        reference_run: JobRun, dropout_reference: JobRun, tmp_path: Path) -> None:
    """Run without and with dropout 0.1, elastic_batch accumulate: each survivor's second micro-batch
    draws its dropout masks from the stream of the rank whose slot it is (taken from the RNG mirror at
    the shrink), so the run with dropout ends as close to its fault-free run as the one without
    (measured: 1.0e-4 and 2.3e-4, the same in every run; with the survivors drawing those masks from
    their own streams, a step's loss was 1e-2 off). Its first shrunk step computes the fault-free
    run's losses bit for bit."""
    worst: dict[str, float] = {}
    for dropout, reference in (("0.0", reference_run), ("0.1", dropout_reference)):
        run = run_elastic(tmp_path / f"dropout{dropout}",
                          ["--set", "elastic_batch=accumulate", "--inject", "node:node=1:step=10:down=600"],
                          script_args=["--dropout", dropout])
        worst[dropout] = assert_same_samples_and_close(run, reference, STEPS)
        assert_first_shrunk_step_replays_the_full_job(run.samples(), reference.samples())
        [shrink] = run.kinds(ev.ELASTIC_SHRINK)
        assert shrink.details["old_world_size"] == 4 and shrink.details["new_world_size"] == 2
        assert shrink.details["dropped_nodes"] == [1] and shrink.details["waited"] >= 2.0
        assert run.result["replicas"] == 2
        # The survivors trained on in their own processes; nobody restarted.
        first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY)}
        assert {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED)} == {0: first[0], 1: first[1]}
        assert not run.kinds(ev.RESTART_BEGIN)
        # Each survivor took two micro-batches per step from step 10 on (accumulate).
        assert {r["rank"]: r["loaders"][0]["slots"] for r in run.samples()[STEPS - 1]} == {0: 2, 1: 2}
    assert worst["0.1"] <= worst["0.0"], worst


def test_the_job_grows_back_when_the_node_returns(reference_run: JobRun, tmp_path: Path) -> None:
    # Each step sleeps 0.4 s (numbers unchanged) so that the node is back well before the end.
    run = run_elastic(tmp_path, ["--set", "elastic_batch=grow", "--inject", "node:node=1:step=3:down=2"],
                      wait=1.0, script_args=["--step-sleep", "0.4"])
    assert_same_samples_and_close(run, reference_run, STEPS)
    [shrink] = run.kinds(ev.ELASTIC_SHRINK)
    [grow] = run.kinds(ev.ELASTIC_GROW)
    assert (grow.details["old_world_size"], grow.details["new_world_size"]) == (2, 4)
    assert shrink.step < grow.step < STEPS
    assert run.result["replicas"] == 4
    replicas = {step: {r["replicas"] for r in records} for step, records in run.samples().items()}
    assert replicas[grow.step - 1] == {2} and replicas[grow.step] == {4}
    # grow mode: a shrunk replica took one batch of two slots.
    assert {r["loaders"][0]["slots"] for r in run.samples()[grow.step - 1]} == {2}
    # The returned node's ranks started while the survivors trained on, then got the state from a
    # live replica; ranks 0 and 1 never restarted.
    assert sorted(e.rank for e in run.kinds(ev.WORKER_READY)) == [0, 1, 2, 2, 3, 3]
    begin = [e for e in run.kinds(ev.RECOVERY_BEGIN) if e.details.get("grow")]
    assert len(begin) == 1 and begin[0].details["newcomers"] == [2, 3]
    plan = run.kinds(ev.RECOVERY_PLAN)[-1]
    assert plan.details["receivers"] == [2, 3] and plan.details["world_size"] == 4
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    assert all(e.details["pid"] == first[e.rank] for e in run.kinds(ev.RECOVERED) if e.rank in (0, 1))


def test_below_min_nodes_elastic_training_is_refused_and_the_chain_falls_back(tmp_path: Path) -> None:
    # node_check off: a node's health check (about 3 s, torch imported in a child) comes before its
    # hello, and node_return_timeout also bounds the first join.
    run = run_elastic(tmp_path, ["--nnodes", "2:2", "--set", "node_return_timeout=3", "--set", "node_check=false",
                                 "--inject", "node:node=1:step=5:down=600"])
    assert run.returncode == 1
    [decision] = run.kinds(ev.DECISION)
    assert decision.details["strategy"] == "job-restart"
    assert "elastic-training: 1 node(s) left, below min_nodes (2)" in decision.details["reason"]
    assert not run.kinds(ev.ELASTIC_SHRINK)
    assert "did not join within node_return_timeout" in run.output


def test_a_job_restart_after_a_shrink_restarts_at_the_shrunk_size(reference_run: JobRun, tmp_path: Path) -> None:
    """Shrunk to node 0 (node 1 kept away), then a worker of node 0 is killed: with elastic training
    alone in the chain the fallback is a job restart, which starts ranks 0 and 1 again as the two
    members at once, without waiting node_return_timeout (60 s) for node 1, from node memory."""
    run = run_elastic(tmp_path, ["--inject", "node:node=1:step=10:down=600", "--inject", "kill:rank=1:step=20"])
    assert_same_samples_and_close(run, reference_run, STEPS)
    [shrink] = run.kinds(ev.ELASTIC_SHRINK)
    assert shrink.details["new_world_size"] == 2
    [decision] = [e for e in run.kinds(ev.DECISION) if e.details["strategy"] == "job-restart"]
    assert "elastic-training: no node is lost" in decision.details["reason"]
    [begin] = run.kinds(ev.RESTART_BEGIN)
    [end] = run.kinds(ev.RESTART_END)
    assert end.time - begin.time < 10, "the restart waited for the dropped node"
    start = run.kinds(ev.GENERATION_START)[-1]
    assert (start.generation, start.details["members"]) == (end.generation, [0, 1])
    loads = [e for e in run.kinds(ev.CHECKPOINT_LOAD) if e.generation == end.generation]
    # Rank 1 dies as it begins step 20, right after its snapshot of it; rank 0 holds 19 if its own
    # snapshot of step 20 had not finished when its agent stopped it, and then both restart from 19.
    assert {(e.rank, e.details["source"]) for e in loads} == {(0, "memory"), (1, "memory")}
    assert len({e.step for e in loads}) == 1 and loads[0].step in (19, 20), loads
    assert run.result["replicas"] == 2 and run.result["generation"] == end.generation
    assert {r["replicas"] for r in run.samples()[STEPS - 1]} == {2}


def test_a_job_restart_after_a_shrink_restores_from_storage_at_the_shrunk_size(
        reference_run: JobRun, tmp_path: Path) -> None:
    """As above, with T1 snapshots only at checkpoint steps: the members hold no snapshot taken at
    the shrunk size, so the restart loads the step-10 checkpoint the four ranks wrote and splits
    its global batch over the two members (without their rank files: other members wrote it)."""
    run = run_elastic(tmp_path, ["--set", "checkpoint.snapshot_interval=0",
                                 "--inject", "node:node=1:step=13:down=600:committed=10", "--inject", "kill:rank=1:step=17"],
                      script_args=["--step-sleep", "0.1"])
    assert_same_samples_and_close(run, reference_run, STEPS, rerun=True)
    [begin] = run.kinds(ev.RESTART_BEGIN)
    [end] = run.kinds(ev.RESTART_END)
    assert end.time - begin.time < 10, "the restart waited for the dropped node"
    loads = [e for e in run.kinds(ev.CHECKPOINT_LOAD) if e.generation == end.generation]
    assert {(e.rank, e.step, e.details["source"]) for e in loads} == {(0, 10, "storage"), (1, 10, "storage")}
    rerun = {r["rank"]: r["loaders"][0]["slots"] for r in run.samples()[12] if r["generation"] == end.generation}
    assert rerun == {0: 2, 1: 2}
    assert run.result["replicas"] == 2


# A loop as most scripts write it: one next() per step, its batches read by DataLoader workers.
ONE_BATCH_PER_STEP = '''
import argparse
import torch
import undying


class Points:
    def __len__(self):
        return 200

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        return torch.randn(4, generator=generator), torch.randn(1, generator=generator)


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int)
args = parser.parse_args()
ft = undying.init()
torch.manual_seed(0)
model = ft.wrap_model(torch.nn.Linear(4, 1))
opt = ft.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
batches = iter(ft.dataloader(Points(), batch_size=4, seed=1, num_workers=2))
for step in ft.steps(args.steps):
    x, y = next(batches)
    loss = torch.nn.functional.mse_loss(model(x.to(ft.device)), y.to(ft.device))
    loss.backward()
    opt.step()
    opt.zero_grad()
    ft.log(loss=loss.item())
ft.finish()
'''


def test_a_loop_taking_one_batch_per_step_trains_on_through_a_shrink(tmp_path: Path) -> None:
    """With the default elastic_batch (grow) a shrunk replica's next() returns its slots' samples in
    one batch: the unchanged loop commits every step with the fixed-size job's samples."""
    from undying.data.sampler import epoch_order

    script = tmp_path / "one_batch_per_step.py"
    script.write_text(ONE_BATCH_PER_STEP)
    run = run_job(tmp_path / "run", [*ELASTIC, "--inject", "node:node=1:step=10:down=600"], STEPS,
                  script=script, reschedule_wait=2.0)
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["final_step"] == STEPS and run.result["replicas"] == 2
    samples = run.samples()
    steps_per_epoch = 200 // 16  # global batch 4 slots x 4 samples; the remainder 8 is dropped
    for step in range(STEPS):
        epoch, start = divmod(step, steps_per_epoch)
        expected = sorted(epoch_order(1, epoch, 200)[start * 16:(start + 1) * 16])
        assert step_samples(samples[step]) == expected, f"step {step} used other samples"
    assert {r["rank"]: r["loaders"][0]["slots"] for r in samples[STEPS - 1]} == {0: 2, 1: 2}
