"""A bad step is not committed, with real processes: a NaN injected into one rank's model output at
step N (its loss, and through the average every rank's gradients). No rank commits the first attempt;
the step is replayed from the committed state. Transient: the replay commits and the final parameters
equal the fault-free run's. Persistent: the replay is bad again, and the batch is skipped or the job
stops, as bad_step_repeat says; the report says which."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import STEPS, JobRun, run_job
from undying import events as ev
from undying.report import render_summary, summarize

pytestmark = pytest.mark.faults

NAN_AT = 12


def bad_steps(run: JobRun) -> list[tuple[int | None, int, str, list[int]]]:
    return [(event.step, event.details["attempt"], event.details["action"], event.details["ranks"])
            for event in run.kinds(ev.BAD_STEP)]


def test_a_transient_nan_is_replayed_and_the_run_ends_bitwise_equal(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, ["--inject", f"nan:rank=1:step={NAN_AT}"])
    assert run.returncode == 0, run.output + run.logs()
    assert bad_steps(run) == [(NAN_AT, 1, "replay", [1]), (NAN_AT, 2, "replayed", [1])]
    first = run.kinds(ev.BAD_STEP)[0]
    assert first.rank == 0 and first.details["named_count"] == 1  # the vote named rank 1 to every rank
    # The first attempt was committed by nobody: each rank's sample log has step 12 once (the replay's).
    samples = run.samples()
    assert sorted(record["rank"] for record in samples[NAN_AT]) == [0, 1, 2, 3]
    assert not run.kinds(ev.FAULT_DETECTED) and not run.kinds(ev.RECOVERY_BEGIN)
    assert "suspected of a hardware fault" in run.output
    assert run.result["param_sha256"] == reference_run.result["param_sha256"]


def test_a_persistent_nan_skips_the_batch_when_asked(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, ["--set", "bad_step_repeat=skip", "--inject", f"nan:rank=1:step={NAN_AT}:persistent"])
    assert run.returncode == 0, run.output + run.logs()
    assert bad_steps(run) == [(NAN_AT, 1, "replay", [1]), (NAN_AT, 2, "skip", [1])]
    samples, reference = run.samples(), reference_run.samples()
    assert NAN_AT not in samples  # committed without its update: nobody trained on its batch
    # The data position moved past it: every later step trains on the batch it has in the fault-free run.
    for step in range(NAN_AT + 1, STEPS):
        assert sorted(map(str, (r["loaders"] for r in samples[step]))) == \
            sorted(map(str, (r["loaders"] for r in reference[step])))
    assert run.result["final_step"] == STEPS
    assert run.result["param_sha256"] != reference_run.result["param_sha256"]
    assert "bad again: skipped" in render_summary(summarize(run.events))


def test_a_persistent_nan_stops_the_job_with_its_cause(tmp_path: Path) -> None:
    run = run_job(tmp_path, ["--inject", f"nan:rank=1:step={NAN_AT}:persistent"], steps=NAN_AT + 4)
    assert run.returncode == 1, run.output + run.logs()
    assert bad_steps(run) == [(NAN_AT, 1, "replay", [1]), (NAN_AT, 2, "stop", [1])]
    [end] = run.kinds(ev.JOB_END)
    assert end.details["message"] == (f"step {NAN_AT} was bad again when replayed (non-finite values on 4 rank(s); "
                                      f"bad values on rank(s) [1]); stopped by bad_step_repeat: stop")
    # Nothing of the bad step was committed, and every rank joined its vote: the job ends at it,
    # whatever the ranks' last heartbeats said.
    assert end.step == NAN_AT, end
    assert f"undying: job failed: step {NAN_AT} was bad again" in run.output
    assert "bad again: the job stops" in render_summary(summarize(run.events))
