"""Nothing lost on a stop: a job stopped by SIGTERM persists its newest committed step, and a rerun
with the same checkpoint directory resumes there and ends bitwise equal to an uninterrupted run.

Real processes: the example GPT job on 2 simulated nodes x 2 workers, SIGTERM to its `undying run`.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import STEPS, JobRun, assert_ends_bitwise, run_job, start_job, wait_no_processes
from undying import events as ev
from undying.events import read_events

pytestmark = pytest.mark.faults


def wait_for_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        events = read_events(run_dir) if (run_dir / "events.jsonl").exists() else []
        if any(event.kind == ev.HEARTBEAT and (event.step or 0) >= step for event in events):
            return
        time.sleep(0.2)
    raise AssertionError(f"no rank reached step {step} in {timeout} s")


def test_sigterm_persists_the_newest_step_and_a_rerun_resumes_there_bitwise(reference_run: JobRun,
                                                                             tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    args = ["--checkpoint-dir", str(checkpoints)]
    # Steps of at least 0.1 s: the SIGTERM after step 13 lands well before the job's last step (30).
    process, mark = start_job(tmp_path / "first", args, script_args=["--step-sleep", "0.1"])
    wait_for_step(tmp_path / "first", 13)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert not wait_no_processes(mark)
    assert process.returncode == 75, output
    events = read_events(tmp_path / "first")
    [begin] = [event for event in events if event.kind == ev.STOP_BEGIN]
    [end] = [event for event in events if event.kind == ev.JOB_END]
    assert end.details["outcome"] == "stopped"
    # The newest committed step is persisted, not only the last periodic one (on a slow machine the
    # stop may land on a checkpoint step: its periodic checkpoint is then the stop's).
    stopped = int(re.search(r"with step (\d+) persisted", end.details["message"])[1])
    saves = [event.step for event in events if event.kind == ev.CHECKPOINT_SAVE]
    assert stopped >= 13 and stopped == max(saves) and saves.count(stopped) == 1, (stopped, saves)
    assert f"step {stopped} persisted" in output and "stopping once the newest step is persisted" in output
    persisted = [stopped]

    rerun = run_job(tmp_path / "second", args)
    assert rerun.returncode == 0, rerun.output + rerun.logs()
    loads = [event for event in rerun.kinds(ev.CHECKPOINT_LOAD) if event.rank == 0]
    assert [(event.step, event.details["source"]) for event in loads] == [(persisted[0], "storage")]
    assert rerun.result["final_step"] == STEPS
    assert_ends_bitwise(rerun, reference_run)
    assert begin.step is not None
