"""Process-level recovery with real processes and real faults: healthy ranks keep their processes
(same PIDs), only the failed ones restart, and the final parameters are bitwise equal to a
fault-free run. Also the dying checkpoint and the watchdog modes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import STEPS, JobRun, assert_ends_bitwise, run_job, start_job, wait_no_processes
from undying import events as ev
from undying.events import read_events

pytestmark = pytest.mark.faults

PROCESS_LEVEL = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
                 "--recover-strategy", "retry,recover-in-place,recover,dump"]
# T1 snapshots only at checkpoint steps: the restart after a dump must read the dump from storage.
DUMP_ONLY = ["--set", "process_recover=true", "--recover-strategy", "dump", "--checkpoint-interval", "100",
             "--set", "checkpoint.snapshot_interval=0"]


def first_pids(run: JobRun) -> dict[int, int]:
    """PID of every rank's first process (generation 1)."""
    return {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}


def assert_bitwise(run: JobRun, reference: JobRun) -> None:
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference)


def assert_survivors_kept(run: JobRun, restarted: set[int], strategy: str) -> None:
    """Every rank not in ``restarted`` recovered in its original process; no job-level restart."""
    assert not run.kinds(ev.RESTART_BEGIN), "a process-level fault must not restart the job"
    plan = run.kinds(ev.RECOVERY_PLAN)[-1]
    assert plan.details["strategy"] == strategy, plan.details
    pids = first_pids(run)
    recovered = {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED)}
    for rank in set(range(4)) - restarted:
        assert recovered[rank] == pids[rank], f"rank {rank} was restarted"
    for rank in restarted:
        assert recovered[rank] != pids[rank], f"rank {rank} should be a new process"
    new_workers = {e.rank for e in run.kinds(ev.WORKER_READY) if e.generation != 1}
    assert new_workers == restarted


def test_recover_in_place_after_killed_worker_uses_warm_standby(reference_run: JobRun, tmp_path: Path) -> None:
    """Every worker is forked from its node's warm standby, the first ones too, so a fault at the
    second step already finds it ready: the replacement is a fork as well."""
    run = run_job(tmp_path, [*PROCESS_LEVEL, "--set", "warm_standby=true", "--inject", "kill:rank=1:step=2"])
    assert_bitwise(run, reference_run)
    assert_survivors_kept(run, {1}, "recover-in-place")
    assert run.kinds(ev.RECOVERY_PLAN)[-1].details["receivers"] == [1]
    assert "(replacement, warm standby)" in (tmp_path / "logs" / "rank1.log").read_text()


def test_recover_onto_a_standby_agent_after_killed_node(reference_run: JobRun, tmp_path: Path) -> None:
    """`--standby 1`: a spare agent takes the lost node's place at once (pod-level rescheduling onto a
    standby node); only that node's ranks start, on the spare."""
    run = run_job(tmp_path, [*PROCESS_LEVEL, "--standby", "1", "--inject", "node:node=1:step=15"])
    assert_bitwise(run, reference_run)
    assert_survivors_kept(run, {2, 3}, "recover")
    [adopt] = run.kinds(ev.STANDBY_ADOPT)
    assert adopt.node == 1 and adopt.details["spare"] == 2
    fault = run.kinds(ev.FAULT_DETECTED)[0]
    registered = [e for e in run.kinds(ev.AGENT_REGISTERED) if e.node == 1 and e.time > fault.time]
    assert registered and not registered[0].details["standby"]
    assert "standby agent takes the place of node 1" in (tmp_path / "logs" / "agent2.log").read_text()


def test_recover_in_place_after_killed_rank0(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, [*PROCESS_LEVEL, "--inject", "kill:rank=0:step=15"])
    assert_bitwise(run, reference_run)
    assert_survivors_kept(run, {0}, "recover-in-place")
    assert run.kinds(ev.RECOVERY_PLAN)[-1].details["source_rank"] != 0


def test_recover_after_killed_node(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, [*PROCESS_LEVEL, "--inject", "node:node=1:step=15"])
    assert_bitwise(run, reference_run)
    assert_survivors_kept(run, {2, 3}, "recover")


def test_retry_after_exception_in_step_starts_no_process(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, [*PROCESS_LEVEL, "--inject", "raise:rank=2:step=15"])
    assert_bitwise(run, reference_run)
    assert_survivors_kept(run, set(), "retry")
    assert "exception in step" in run.kinds(ev.STEP_FAILED)[0].details["reason"] or any(
        "exception in step" in e.details["reason"] for e in run.kinds(ev.STEP_FAILED))


def test_recover_in_place_after_hang(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, [*PROCESS_LEVEL, "--inject", "hang:rank=3:step=15"])
    assert_bitwise(run, reference_run)
    assert run.kinds(ev.FAULT_DETECTED)[0].details["reason"] == "heartbeat_missed"
    assert_survivors_kept(run, {3}, "recover-in-place")


def test_recover_in_place_after_stalled_training_thread(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, [*PROCESS_LEVEL, "--set", "step_timeout=3", "--inject", "stall:rank=2:step=15"])
    assert_bitwise(run, reference_run)
    assert run.kinds(ev.FAULT_DETECTED)[0].details["reason"] == "step_stalled"
    assert_survivors_kept(run, {2}, "recover-in-place")


def test_second_fault_during_recovery(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, [*PROCESS_LEVEL, "--inject", "kill:rank=1:step=15",
                             "--inject", "kill:rank=2:at=recovery"])
    assert_bitwise(run, reference_run)
    assert len(run.kinds(ev.FAULT_DETECTED)) >= 2
    assert any(e.details["spec"] == "kill:rank=2:at=recovery" for e in run.kinds(ev.INJECTION))


def test_dump_loses_at_most_one_step(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, [*DUMP_ONLY, "--inject", "kill:rank=1:step=15"])
    assert_bitwise(run, reference_run)
    assert run.kinds(ev.DUMP_COMMITTED)
    loads = [e for e in run.kinds(ev.CHECKPOINT_LOAD) if e.rank == 0]
    assert loads and loads[-1].details["dump"] and loads[-1].step in (14, 15), [e.step for e in loads]


def test_fault_during_dump_falls_back_to_periodic_checkpoint(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, [*DUMP_ONLY, "--checkpoint-interval", "10", "--inject", "kill:rank=1:step=15",
                             "--inject", "kill:rank=0:at=dump"])
    assert_bitwise(run, reference_run)
    assert not run.kinds(ev.DUMP_COMMITTED)
    assert run.kinds(ev.RECOVERY_FAILED)
    loads = [e for e in run.kinds(ev.CHECKPOINT_LOAD) if e.rank == 0]
    assert loads and loads[-1].step == 10 and not loads[-1].details["dump"]
    assert all(c.step != 15 for c in __import__("undying.checkpoint", fromlist=["x"]).list_committed(tmp_path / "checkpoints"))


def test_watchdog_off_leaves_a_hang_alone(tmp_path: Path) -> None:
    process, mark = start_job(tmp_path, ["--set", "watchdog=off", "--inject", "hang:rank=1:step=10"], steps=STEPS)
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            events = read_events(tmp_path) if (tmp_path / "events.jsonl").exists() else []
            if any(e.kind == ev.HANG_SUSPECTED for e in events):
                break
            time.sleep(0.3)
        else:
            raise AssertionError("the hang was never noticed")
        time.sleep(3)
        events = read_events(tmp_path)
        assert not any(e.kind == ev.FAULT_DETECTED for e in events), "watchdog off must not act on a hang"
        assert process.poll() is None, "the job hangs, as documented for watchdog: off"
        # A graceful stop waits for a step boundary the hung rank never reaches: a second signal stops at once.
        os.kill(process.pid, signal.SIGTERM)
        time.sleep(1)
        os.kill(process.pid, signal.SIGTERM)
        process.communicate(timeout=60)
        assert process.returncode == 130
    finally:
        if process.poll() is None:
            process.kill()
    assert wait_no_processes(mark) == []


def test_a_killed_warm_standby_takes_its_nodes_workers_and_the_job_recovers_bitwise(
        reference_run: JobRun, tmp_path: Path) -> None:
    """Node 1's workers are forks of its warm standby and die with it (PR_SET_PDEATHSIG). SIGKILL of
    that standby mid-run: the agent reads both ranks as killed, the ranks are replaced (as plain
    processes or from the agent's next standby), the other node keeps its processes, and the run
    ends bitwise equal."""
    process, mark = start_job(tmp_path, PROCESS_LEVEL, script_args=["--step-sleep", "0.2"])
    try:
        ready = wait_for_events(tmp_path, lambda e: e.kind == ev.HEARTBEAT and e.rank == 2 and (e.step or 0) >= 8)
        rank2 = next(e for e in ready if e.kind == ev.WORKER_READY and e.rank == 2)
        standby = parent_pid(rank2.details["pid"])
        assert "undying.agent.standby" in Path(f"/proc/{standby}/cmdline").read_bytes().decode().replace("\0", " ")
        os.kill(standby, signal.SIGKILL)
        output, _ = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
    run = JobRun(process.returncode, output, tmp_path, mark)
    assert wait_no_processes(mark) == []
    assert_bitwise(run, reference_run)
    faults = run.kinds(ev.FAULT_DETECTED)
    assert faults and {fault.details.get("signal") for fault in faults} == {"SIGKILL"}, [f.details for f in faults]
    assert not run.kinds(ev.RESTART_BEGIN), "the node's agent lives: a process-level recovery"
    assert_survivors_kept(run, {2, 3}, "recover-in-place")


def wait_for_events(run_dir: Path, found, timeout: float = 120) -> list:
    deadline = time.time() + timeout
    while time.time() < deadline:
        events = read_events(run_dir) if (run_dir / "events.jsonl").exists() else []
        if any(found(event) for event in events):
            return events
        time.sleep(0.1)
    raise AssertionError("the event never came")


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
