"""``checkpoint.snapshot_interval: auto`` with real processes: every rank changes its interval at the
same step, and a job restart after a worker's death restores from T1 and ends bitwise equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import STEPS, JobRun, assert_ends_bitwise, run_job
from undying import events as ev

pytestmark = pytest.mark.faults


def test_auto_interval_is_agreed_by_every_rank_and_a_restart_restores_from_memory(
        reference_run: JobRun, tmp_path: Path) -> None:
    """A budget no snapshot can meet takes the interval to its cap, the checkpoint interval (10): the
    sums of the round ending at step 10 are read at step 20, where every rank moves from 1 to 10.
    Rank 1 dies as it begins step 25: no rank snapshotted steps 21-24, so every rank holds step 20
    in node memory (not 24, as with a snapshot every step), and the job restarts from it."""
    run = run_job(tmp_path, ["--set", "checkpoint.snapshot_interval=auto",
                             "--set", "checkpoint.snapshot_budget=0.000001",
                             "--inject", "kill:rank=1:step=25"])
    assert run.returncode == 0, run.output + run.logs()
    changes = [event for event in run.kinds(ev.SNAPSHOT_INTERVAL) if event.generation == 1]
    assert sorted(event.rank for event in changes) == [0, 1, 2, 3], [event.details for event in changes]
    assert {(event.step, event.details["previous"], event.details["interval"]) for event in changes} == {(20, 1, 10)}
    assert all(event.details["stall"] > 0 and event.details["step_seconds"] > 0 for event in changes)
    assert run.kinds(ev.DECISION)[0].details["strategy"] == "job-restart"
    loads = [event for event in run.kinds(ev.CHECKPOINT_LOAD) if event.generation == 2]
    assert sorted(event.rank for event in loads) == [0, 1, 2, 3]
    assert {(event.step, event.details["source"]) for event in loads} == {(20, "memory")}
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run)
