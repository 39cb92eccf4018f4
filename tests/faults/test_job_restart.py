"""Job-level restart with real processes and real faults: the final parameters must be
bitwise equal to a fault-free run, and nothing may be left running."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import STEPS, JobRun, assert_ends_bitwise, run_job, start_job, wait_no_processes
from undying import events as ev
from undying.shm import job_dir

pytestmark = pytest.mark.faults


def assert_recovered_bitwise(run: JobRun, reference: JobRun, *reasons: str, source: str = "storage",
                             step: int | tuple[int, ...] = 10) -> None:
    """Recovered by a job restart that loaded ``step`` (or one of the steps given) from ``source``
    ("memory": every node's T1 snapshots survived the fault; "storage": the step-10 checkpoint),
    ending bitwise equal."""
    steps = step if isinstance(step, tuple) else (step,)
    assert run.returncode == 0, run.output + run.logs()
    faults = run.kinds(ev.FAULT_DETECTED)
    assert faults and faults[0].details["reason"] in reasons, [f.details for f in faults]
    assert run.kinds(ev.DECISION)[0].details["strategy"] == "job-restart"
    loads = [event for event in run.kinds(ev.CHECKPOINT_LOAD) if event.rank == 0]
    assert loads and loads[-1].step in steps and loads[-1].details["source"] == source, \
        [(event.step, event.details) for event in loads]
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference)


def test_fault_free_runs_are_bitwise_identical(reference_run: JobRun, tmp_path: Path) -> None:
    """The same job again, now with every worker a plain ``python`` process (warm_standby=false)
    instead of a fork of its node's warm standby: the same bits, and no fault detected, not even a
    host taken for frozen (0.85 s of silence). Every rank's state too,
    RNG included; and the four data-parallel replicas hold the same parameters and optimizer state."""
    again = run_job(tmp_path, ["--set", "warm_standby=false"])
    assert again.returncode == 0, again.output + again.logs()
    assert again.result["final_step"] == STEPS
    assert_ends_bitwise(again, reference_run, rng=True)
    replicas = {(d["params_sha256"], d["optimizer_sha256"]) for d in reference_run.rank_digests().values()}
    assert len(replicas) == 1 and len(reference_run.rank_digests()) == 4, reference_run.rank_digests()
    assert not again.kinds(ev.FAULT_DETECTED)
    assert not again.kinds(ev.AGENT_LOST)


def test_killed_worker_job_restarts_bitwise_equal(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, ["--inject", "kill:rank=1:step=15"])
    # Rank 1 snapshotted step 15 into its node's memory and died as it began step 15. Its peers
    # snapshot step 15 at the same moment, each after its own commit of step 14: the one that had
    # not finished when the agents stopped it holds 14, and then every rank restarts from 14. Either
    # way each reads its own snapshot; nobody falls back to the step-10 checkpoint in storage.
    assert_recovered_bitwise(run, reference_run, "worker_exit", source="memory", step=(14, 15))
    loads = [event for event in run.kinds(ev.CHECKPOINT_LOAD) if event.generation == 2]
    assert sorted(event.rank for event in loads) == [0, 1, 2, 3]
    assert len({(event.step, event.details["source"]) for event in loads}) == 1, loads
    saves = run.kinds(ev.CHECKPOINT_SAVE)
    # Step 10's commit is reported at the first step boundary after the persister finished it; the kill
    # five steps later (0.4 s on a quiet machine) may come first. Steps 20 and 30 are always reported.
    assert [event.step for event in saves] in ([10, 20, 30], [20, 30])
    assert all(event.details["stall"] < 0.5 for event in saves)
    assert not job_dir(run.kinds(ev.JOB_START)[0].details["job_id"]).exists(), "shared memory left behind"
    assert run.kinds(ev.FAULT_DETECTED)[0].details["signal"] == "SIGKILL"
    assert run.kinds(ev.GENERATION_START)[-1].generation == 2


def test_a_job_restart_starts_every_rank_from_a_warm_standby(reference_run: JobRun, tmp_path: Path) -> None:
    """Each agent keeps a warm standby (torch and torch._dynamo imported); a job restart forks all
    four ranks from the two standbys and ends bitwise equal."""
    run = run_job(tmp_path, ["--set", "warm_standby=true", "--inject", "kill:rank=1:step=25"])
    # 24 where a peer had not finished its snapshot of step 25 when it was stopped (as above).
    assert_recovered_bitwise(run, reference_run, "worker_exit", source="memory", step=(24, 25))
    for rank in range(4):
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert "--- generation 2 (warm standby) ---" in log, log[-2000:]


def test_a_worker_killed_during_an_overlapped_snapshot_restarts_from_a_complete_one(
        reference_run: JobRun, tmp_path: Path) -> None:
    """checkpoint.overlap=on: rank 1 is SIGKILLed as it begins step 15, right after handing step 15's
    parameters and optimizer state to its helper thread. That snapshot is in node memory only if
    the copy finished first; either way every rank restarts from one step all of them hold
    complete (15, or 14), from memory, and the run ends bitwise equal."""
    run = run_job(tmp_path, ["--set", "checkpoint.overlap=on", "--inject", "kill:rank=1:step=15"])
    assert run.returncode == 0, run.output + run.logs()
    assert run.kinds(ev.DECISION)[0].details["strategy"] == "job-restart"
    loads = [event for event in run.kinds(ev.CHECKPOINT_LOAD) if event.generation == 2]
    assert sorted(event.rank for event in loads) == [0, 1, 2, 3]
    assert len({event.step for event in loads}) == 1 and loads[0].step in (14, 15), loads
    assert {event.details["source"] for event in loads} == {"memory"}
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run)


def test_a_job_restart_right_before_a_t2_commit_keeps_that_checkpoint(reference_run: JobRun, tmp_path: Path) -> None:
    """Rank 0's persister has written step 10's shared shard and waits 4 s before its commit (a slow
    store: ``stall ... at=persist:seconds=4``); rank 3 is killed meanwhile, at step 12. Rank 3 stalls
    1 s at step 12 before it dies, so that both premises hold however loaded the machine: its own
    records of step 10 are in, and rank 0's heartbeat has told the controller that it commits step 10.
    The job restart holds its stop orders until rank 0 has committed step 10 (a survivor stopped at
    once would lose it), then restarts; bitwise equal."""
    run = run_job(tmp_path, ["--inject", "stall:rank=0:step=10:at=persist:seconds=4",
                             "--inject", "stall:rank=3:step=12:seconds=1",
                             "--inject", "kill:rank=3:step=12"])
    assert_recovered_bitwise(run, reference_run, "worker_exit", source="memory", step=(11, 12))
    [drain] = run.kinds(ev.COMMIT_DRAIN)
    assert (drain.rank, drain.step, drain.details["outcome"]) == (0, 10, "committed")
    saves = [event for event in run.kinds(ev.CHECKPOINT_SAVE) if event.step == 10]  # (pruned by step 30's)
    assert saves and saves[0].generation == 1
    [restart] = run.kinds(ev.RESTART_BEGIN)
    assert restart.time < saves[0].time < run.kinds(ev.GENERATION_START)[-1].time


def test_killed_node_job_restarts_bitwise_equal(reference_run: JobRun, tmp_path: Path) -> None:
    # The lost node's memory is gone with it: back to the step-10 checkpoint in storage. The node
    # dies once that checkpoint is committed (committed=10): the background persister may still be
    # writing it five steps later on a loaded machine, and then the restart rightly starts afresh.
    run = run_job(tmp_path, ["--inject", "node:node=1:step=15:committed=10"])
    assert_recovered_bitwise(run, reference_run, "agent_lost")
    assert run.kinds(ev.AGENT_RESPAWNED), "the lost node's agent must come back"
    # The node's ranks marked reaching the fault's step in the node's shared memory, gone with the job.
    assert not (run.run_dir / "injections").exists(), sorted(entry.name for entry in run.run_dir.iterdir())


def test_hung_worker_is_detected_and_restarted(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, ["--inject", "hang:rank=2:step=15"])
    assert_recovered_bitwise(run, reference_run, "heartbeat_missed", source="memory", step=15)


def test_exception_in_step_restarts(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, ["--inject", "raise:rank=0:step=15"])
    # The raising rank's exit, or its peers' report that the step failed: either is the fault.
    assert_recovered_bitwise(run, reference_run, "worker_exit", "step_failed", source="memory", step=15)
    exits = [e for e in run.kinds(ev.WORKER_EXIT) if e.rank == 0 and e.generation == 1]
    assert exits and exits[0].details["exitcode"] in (1, -9)


def test_max_restarts_exhausted_fails_cleanly(tmp_path: Path) -> None:
    run = run_job(tmp_path, ["--max-restarts", "1", "--inject", "kill:rank=1:step=5",
                             "--inject", "kill:rank=2:step=12"])
    assert run.returncode == 1, run.output
    assert "max_restarts (1) exhausted" in run.output
    end = run.kinds(ev.JOB_END)[-1]
    assert end.details["outcome"] == "failed"
    assert len(run.kinds(ev.FAULT_DETECTED)) == 2
    assert not (tmp_path / "result.json").exists()


def test_corrupt_newest_checkpoint_is_skipped(reference_run: JobRun, tmp_path: Path) -> None:
    first = run_job(tmp_path, steps=20)
    assert first.returncode == 0, first.output + first.logs()
    newest = tmp_path / "checkpoints" / "step_000000020" / "__0_0.distcp"  # the shared shard's data
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    (tmp_path / "result.json").unlink()
    second = run_job(tmp_path)
    assert second.returncode == 0, second.output + second.logs()
    corrupt = second.kinds(ev.CHECKPOINT_CORRUPT)
    assert corrupt and "step_000000020" in corrupt[0].details["path"]
    loads = [event for event in second.kinds(ev.CHECKPOINT_LOAD) if event.rank == 0]
    assert [event.step for event in loads] == [10]
    assert_ends_bitwise(second, reference_run)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_leaves_no_process(tmp_path: Path, signum: int) -> None:
    process, mark = start_job(tmp_path, [], steps=100_000)
    deadline = time.time() + 120
    events_file = tmp_path / "events.jsonl"
    while time.time() < deadline:
        if events_file.exists() and '"kind": "heartbeat"' in events_file.read_text():
            break
        time.sleep(0.2)
    else:
        process.kill()
        raise AssertionError("job never started training")
    # The newest committed step is persisted first (tests/faults/test_graceful_stop.py), then the job
    # ends as stopped, resumable (exit 75), with no process left.
    os.kill(process.pid, signum)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 75, output
    assert wait_no_processes(mark) == []
    from undying.events import read_events

    ends = [e for e in read_events(tmp_path) if e.kind == ev.JOB_END]
    assert len(ends) == 1 and ends[0].details["outcome"] == "stopped"
