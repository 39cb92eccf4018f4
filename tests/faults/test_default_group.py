"""torch.distributed's default group under a real job: a script that all-reduces its loss with
``dist.all_reduce`` and calls ``dist.barrier()`` at every step (tests/scripts/dist_user.py) runs
fault-free, and after a SIGKILL of one worker recovers in place: the survivors' collective fails
on the dead peer and leads to the normal recovery, the default group is rebuilt for the new
generation, and the run ends where the fault-free one ends, with the same reduced losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FINAL_STATE, REPO, JobRun, assert_ends_bitwise, run_job
from tests.faults.test_process_recovery import PROCESS_LEVEL, assert_survivors_kept
from undying import events as ev

pytestmark = pytest.mark.faults

DIST_USER = REPO / "tests" / "scripts" / "dist_user.py"
STEPS = 10
FAULT_STEP = 5


def run_dist_user(run_dir: Path, extra: list[str] | None = None) -> JobRun:
    return run_job(run_dir, [*PROCESS_LEVEL, *(extra or [])], steps=STEPS, script=DIST_USER, timeout=150,
                   script_args=["--final-state", str(run_dir / FINAL_STATE)])


def step_records(run: JobRun) -> dict[int, dict[int, dict]]:
    """rank -> step -> the last record of that step (the run of it that committed)."""
    records: dict[int, dict[int, dict]] = {}
    for log in sorted((run.run_dir / "dist_user").glob("rank*.jsonl")):
        rank = int(log.stem.removeprefix("rank"))
        for line in log.read_text().splitlines():
            record = json.loads(line)
            records.setdefault(rank, {})[record["step"]] = record
    return records


def assert_collectives_agree(run: JobRun) -> dict[int, float]:
    """Every rank ran every step with torch.distributed initialized as its generation's group, and
    saw the same all-reduced loss; returns step -> that loss."""
    records = step_records(run)
    assert sorted(records) == [0, 1, 2, 3]
    losses = {}
    for step in range(STEPS):
        seen = [records[rank][step] for rank in range(4)]
        for record in seen:
            assert record["initialized"]
            assert (record["dist_rank"], record["dist_world_size"]) == (record["group_rank"], record["replicas"])
        assert len({record["mean_loss"] for record in seen}) == 1, seen
        losses[step] = seen[0]["mean_loss"]
    return losses


@pytest.fixture(scope="module")
def dist_reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    run = run_dist_user(tmp_path_factory.mktemp("dist-user-reference"))
    assert run.returncode == 0, run.output + run.logs()
    assert not run.kinds(ev.STEP_FAILED)
    return run


def test_user_collectives_run_on_the_default_group(dist_reference: JobRun) -> None:
    records = step_records(dist_reference)
    assert_collectives_agree(dist_reference)
    assert {record["generation"] for rank in records for record in records[rank].values()} == {1}


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    return run_dist_user(tmp_path_factory.mktemp("dist-user-killed"), ["--inject", f"kill:rank=1:step={FAULT_STEP}"])


def test_user_collectives_after_killed_worker_recover_in_place(dist_reference: JobRun, killed_run: JobRun) -> None:
    run = killed_run
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, dist_reference)
    assert assert_collectives_agree(run) == assert_collectives_agree(dist_reference)
    failed = run.kinds(ev.STEP_FAILED)
    assert failed and failed[0].step == FAULT_STEP, [(e.step, e.details) for e in failed]
    assert_survivors_kept(run, {1}, "recover-in-place")
    # The re-run of the failed step and every later one went through the new generation's group.
    records = step_records(run)
    assert all(records[rank][step]["generation"] > 1 for rank in range(4) for step in range(FAULT_STEP, STEPS))


def test_survivors_leave_the_dead_generation_without_waiting_for_comm_timeout(killed_run: JobRun) -> None:
    """A survivor whose user collective failed drops the generation's default group, which closes its
    connections: a survivor still waiting for it in a collective fails at once, not by timeout."""
    reasons = [event.details["reason"] for event in killed_run.kinds(ev.STEP_FAILED) if event.generation == 1]
    assert reasons and not [reason for reason in reasons if "Timed out" in reason], reasons


def test_a_failed_user_collective_without_retry_is_a_symptom_not_a_crash(dist_reference: JobRun,
                                                                          tmp_path: Path) -> None:
    """Without `retry`, a user collective that fails because a peer died is no error of the script:
    the controller aborts the generation (told within a moment), the step is re-run after a
    recover-in-place, and no survivor process is lost."""
    run = run_job(tmp_path, ["--set", "process_recover=true", "--recover-strategy", "recover-in-place",
                             "--inject", f"kill:rank=1:step={FAULT_STEP}"],
                  steps=STEPS, script=DIST_USER, timeout=150, script_args=["--final-state", str(tmp_path / FINAL_STATE)])
    assert run.returncode == 0, run.output + run.logs()
    assert_ends_bitwise(run, dist_reference)
    assert assert_collectives_agree(run) == assert_collectives_agree(dist_reference)
    assert_survivors_kept(run, {1}, "recover-in-place")
