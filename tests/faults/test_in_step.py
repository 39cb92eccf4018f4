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
# split over two runs of 30 steps.
IN_STEP = [(kind, point, index % 4) for index, (kind, point) in enumerate((k, p) for k in KINDS for p in POINTS)]
RUNS = {"first": IN_STEP[:5], "second": IN_STEP[5:]}
FIRST_FAULT_STEP, SPACING = 3, 5
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
    fired = [event.details["spec"] for event in run.kinds(ev.INJECTION)]
    assert sorted(fired) == sorted(specs), (fired, specs)
    decisions = [event.details["strategy"] for event in run.kinds(ev.DECISION)]
    assert decisions == strategies, (decisions, strategies, story)
    assert not run.kinds(ev.RNG_NOT_MIRRORED), [event.details for event in run.kinds(ev.RNG_NOT_MIRRORED)]
    assert not run.kinds(ev.CRASH_LOOP)


@pytest.fixture(scope="module")
def in_step_reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    return fault_free_run(tmp_path_factory, "in-step-reference", DP_ARGS)


@pytest.mark.parametrize("name", RUNS)
def test_data_parallel_faults_at_every_in_step_point(in_step_reference: JobRun, tmp_path: Path, name: str) -> None:
    faults = RUNS[name]
    args = injections(faults)
    run = run_job(tmp_path, [*PROCESS_LEVEL, *args], script_args=DP_ARGS)
    assert_every_fault_fired_and_recovered(run, args[1::2], [expected_strategy(kind, point)
                                                             for kind, point, _ in faults])
    assert not run.kinds(ev.RESTART_BEGIN)
    assert_ends_bitwise(run, in_step_reference, rng=True)
