"""Faults inside the step, where the step-commit guarantee is decided: in the middle of the gradient
averaging (``at=allreduce``: some buckets, or FSDP2's reduce-scatters, in flight), between the commit
vote and the update (``at=after_vote``: every rank voted yes, the peers apply the step) and inside the
optimizer's ``step()`` (``at=optimizer``: this rank's update done, its commit not recorded yet). Each
point is hit with SIGKILL, SIGSTOP and an exception, on every rank position (rank 0, the source of a
repair and of the buffers' broadcast, among them), data-parallel and sharded (HSDP, pure FSDP), under
each strategy that applies, and every rank of every run ends bitwise where the fault-free run ends:
parameters, optimizer state and RNG (dropout draws every step, so a replacement's RNG must be exactly
its predecessor's as of the step the survivors applied). Several faults share one run, each at its
own step, so that a step commits between two of them (no crash loop)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import (
    DROPOUT_ARGS,
    STEPS,
    JobRun,
    assert_ends_bitwise,
    fault_free_run,
    run_job,
)
from undying import events as ev

pytestmark = pytest.mark.faults

POINTS = ("allreduce", "after_vote", "optimizer")
KINDS = ("kill", "hang", "raise")
# Each (kind, point) on a rank of its own, rotating over the four ranks (rank 0 meets every kind),
# all nine in one run of 30 steps, three steps apart.
IN_STEP = [(kind, point, index % 4) for index, (kind, point) in enumerate((k, p) for k in KINDS for p in POINTS)]
FIRST_FAULT_STEP, SPACING = 2, 3
# Five gradient buckets per step (the model's 61k float32 gradients in 50 kB buckets): at=allreduce
# fires with the first in flight and four to go. Dropout 0.1: every step draws random numbers.
DP_ARGS = [*DROPOUT_ARGS, "--bucket-cap-mb", "0.05"]
PROCESS_LEVEL = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
                 "--recover-strategy", "retry,recover-in-place,recover"]


def injections(faults: list[tuple[str, str, int]]) -> list[str]:
    args = []
    for index, (kind, point, rank) in enumerate(faults):
        args += ["--inject", f"{kind}:rank={rank}:step={FIRST_FAULT_STEP + SPACING * index}:at={point}"]
    return args


def expected_strategy(kind: str, point: str) -> str:
    """A process killed or stopped is replaced in place. An exception before the update is retried in
    the same processes (after the vote: the rank that raised receives the step its peers applied);
    one inside the optimizer's step left this rank's update applied but not committed, so it is not
    suppressed: the process ends with it and is replaced."""
    if kind == "raise" and point != "optimizer":
        return "retry"
    return "recover-in-place"


def assert_every_fault_fired_and_recovered(run: JobRun, specs: list[str], strategies: list[str]) -> None:
    story = run.output + run.logs()
    assert run.returncode == 0, story
    assert run.result["final_step"] == STEPS, story
    fired = run.kinds(ev.INJECTION)
    assert sorted(event.details["spec"] for event in fired) == sorted(specs), (fired, specs)
    # The chain's first answer to each fault (a later one may follow it: a replacement forked from a
    # spare's standby still importing under load can miss its heartbeats, a second fault).
    decisions = run.kinds(ev.DECISION)
    answers = {event.details["spec"]: next((d.details["strategy"] for d in decisions if d.time >= event.time), None)
               for event in fired}
    assert [answers[spec] for spec in specs] == strategies, (answers, strategies, story)
    assert not run.kinds(ev.RNG_NOT_MIRRORED), [event.details for event in run.kinds(ev.RNG_NOT_MIRRORED)]
    assert not run.kinds(ev.CRASH_LOOP)


@pytest.fixture(scope="module")
def in_step_reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    return fault_free_run(tmp_path_factory, "in-step-reference", DP_ARGS)


def test_data_parallel_faults_at_every_in_step_point(in_step_reference: JobRun, tmp_path: Path) -> None:
    args = injections(IN_STEP)
    run = run_job(tmp_path, [*PROCESS_LEVEL, *args], script_args=DP_ARGS)
    assert_every_fault_fired_and_recovered(run, args[1::2], [expected_strategy(kind, point)
                                                             for kind, point, _ in IN_STEP])
    assert not run.kinds(ev.RESTART_BEGIN)
    assert_ends_bitwise(run, in_step_reference, rng=True)


# Each other strategy that takes a data-parallel job's in-step fault: the chain, the faults (one run
# each), the decisions expected. ``recover``: a whole node lost at a point inside the step (rank 0's
# node among them) comes back on a spare. ``dump``: the survivors hold the step the lost rank voted
# for, and the dump writes it with that rank's mirrored RNG. Job restart: from node memory.
STRATEGY_RUNS = {
    "recover": ([*PROCESS_LEVEL, "--standby", "2"],
                ["node:node=0:step=4:at=allreduce", "node:node=1:step=14:at=after_vote"],
                ["recover", "recover"]),
    "dump": (["--set", "process_recover=true", "--recover-strategy", "dump", "--checkpoint-interval", "100",
              "--set", "checkpoint.snapshot_interval=0"],
             ["kill:rank=3:step=8:at=after_vote", "kill:rank=0:step=20:at=optimizer"],
             ["dump", "dump"]),
    "job-restart": ([],
                    ["kill:rank=1:step=6:at=optimizer", "hang:rank=2:step=14:at=after_vote",
                     "raise:rank=3:step=22:at=allreduce"],
                    ["job-restart", "job-restart", "job-restart"]),
}


@pytest.mark.parametrize("strategy", STRATEGY_RUNS)
def test_data_parallel_in_step_faults_under_each_strategy(in_step_reference: JobRun, tmp_path: Path,
                                                          strategy: str) -> None:
    chain, specs, decisions = STRATEGY_RUNS[strategy]
    run = run_job(tmp_path, [*chain, *(arg for spec in specs for arg in ("--inject", spec))], script_args=DP_ARGS)
    assert_every_fault_fired_and_recovered(run, specs, decisions)
    if strategy == "dump":
        # The step the lost rank voted for and its peers applied: the dump holds it, not the one before.
        assert [event.step for event in run.kinds(ev.DUMP_COMMITTED)] == [9, 21]
    assert_ends_bitwise(run, in_step_reference, rng=True)


# Sharded: the same faults on HSDP (2 x 2: the reduce-scatters over each replica's shard dim, then
# the all-reduce over the replicate dim; a lost rank's shard comes from the other replica), and on
# pure FSDP (1 x 4: no other replica; a replacement takes its shard from its node's T1 snapshot,
# and when that lacks the step the survivors applied, every rank goes back to the newest step all
# hold in T1 and replays).
HSDP_ARGS = ["--mesh", "2x2", *DROPOUT_ARGS]
FSDP_RUN = (["--set", "process_recover=true", "--recover-strategy", "retry,recover-in-place"],
            ["kill:rank=1:step=5:at=after_vote", "raise:rank=2:step=12:at=allreduce",
             "hang:rank=0:step=20:at=optimizer"],
            ["recover-in-place", "retry", "recover-in-place"])


def test_hsdp_faults_at_every_in_step_point(hsdp_dropout_reference: JobRun, tmp_path: Path) -> None:
    args = injections(IN_STEP)
    run = run_job(tmp_path, [*PROCESS_LEVEL, *args], script_args=HSDP_ARGS)
    assert_every_fault_fired_and_recovered(run, args[1::2], [expected_strategy(kind, point)
                                                             for kind, point, _ in IN_STEP])
    assert not run.kinds(ev.RESTART_BEGIN)
    assert_ends_bitwise(run, hsdp_dropout_reference, rng=True)


def test_pure_fsdp_in_step_faults(fsdp_reference: JobRun, tmp_path: Path) -> None:
    chain, specs, decisions = FSDP_RUN
    run = run_job(tmp_path, [*chain, *(arg for spec in specs for arg in ("--inject", spec))],
                  script_args=["--mesh", "1x4"])
    assert_every_fault_fired_and_recovered(run, specs, decisions)
    assert not run.kinds(ev.RESTART_BEGIN)
    assert_ends_bitwise(run, fsdp_reference, rng=True)
