"""A script that never calls ``ft.finish()`` (as scripts from torchrun end: with their loop) is
finished at its exit, with real ``undying run`` jobs.

Property: when every rank's ``ft.steps(n)`` ran to its end and the script returned, the job ends
as if the script had called ``ft.finish()``: every rank says it is done at step n (the job's end
names step n, however far behind its last heartbeats were), the T2 checkpoint begun at the last
step is committed, rank 0 writes the run's result, and every rank's parameters and optimizer
state are bitwise those of the same script calling ``ft.finish()`` itself. A script whose exception ends it after the
loop is not finished: the job fails with that error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import RANK_DIGESTS, REPO, run_job
from undying import events as ev
from undying.events import read_events

pytestmark = pytest.mark.faults

SCRIPT = REPO / "tests" / "scripts" / "no_finish.py"
STEPS = 60
ARGS = ["--nnodes", "1", "--nproc-per-node", "2", "--checkpoint-interval", "30"]


def _ending(run_dir: Path) -> tuple[list, list, list]:
    events = read_events(run_dir)
    done = [event for event in events if event.kind == ev.WORKER_DONE]
    ends = [event for event in events if event.kind == ev.JOB_END]
    saved = [event.step for event in events if event.kind == ev.CHECKPOINT_SAVE]
    return done, ends, saved


@pytest.mark.parametrize("then", ["return", "finish"])
def test_a_script_that_ends_with_its_loop_is_finished_at_exit(tmp_path: Path, then: str) -> None:
    run = run_job(tmp_path / "run", ARGS, steps=STEPS, script=SCRIPT, script_args=["--then", then])
    assert run.returncode == 0, run.output
    done, ends, saved = _ending(run.run_dir)
    assert sorted((event.rank, event.step) for event in done) == [(0, STEPS), (1, STEPS)], run.output
    assert [event.step for event in ends] == [STEPS] and f"finished at step {STEPS}" in run.output
    assert STEPS in saved, saved  # the checkpoint begun at the last step was committed before the end
    assert json.loads((run.run_dir / "result.json").read_text())["final_step"] == STEPS


def test_a_script_whose_error_ends_it_after_the_loop_is_not_finished(tmp_path: Path) -> None:
    run = run_job(tmp_path / "run", ARGS + ["--max-restarts", "0"], steps=STEPS, script=SCRIPT,
                  script_args=["--then", "raise"])
    assert run.returncode != 0, run.output
    done, ends, _ = _ending(run.run_dir)
    assert not done and not (run.run_dir / "result.json").exists()
    assert "evaluation failed after training" in run.output


def test_finished_at_exit_ends_bitwise_where_a_script_calling_finish_ends(tmp_path: Path) -> None:
    """Every rank's parameters and optimizer state at the end (the digests its ``worker_done``
    carries, ``state_digests: true``) are those of the same script calling ``ft.finish()`` itself."""
    runs = {then: run_job(tmp_path / then, ARGS, steps=STEPS, script=SCRIPT, script_args=["--then", then])
            for then in ("return", "finish")}
    assert all(run.returncode == 0 for run in runs.values())
    ours, theirs = runs["return"].rank_digests(), runs["finish"].rank_digests()
    assert sorted(ours) == sorted(theirs) == [0, 1]
    assert all(ours[rank][key] == theirs[rank][key] for rank in theirs for key in RANK_DIGESTS), (ours, theirs)
