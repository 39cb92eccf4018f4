"""Crash loops stop with their cause: the job machine on a fake clock, and the pieces it reads."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.unit.job_harness import check_in_together
from undying import events as ev
from undying.controller.crash_loop import CrashLoop
from undying.controller.state import JobState
from undying.faults import Fault, FaultReason, exception_line
from undying.log_tail import exception_tail, read_tail
from undying.protocol import (
    WORKER_EXIT_REPAIR_REFUSED,
    OrderKind,
    Phase,
    PlanAction,
    RecoverRequest,
    WorkerState,
    WorkerStatus,
)

TRACEBACK = ["step 0 loss 4.2",
             "Traceback (most recent call last):",
             '  File "train.py", line 9, in <module>',
             "    raise RuntimeError('boom')",
             "RuntimeError: boom"]


def exited(job, node: int, generation: int, error: str = "", tail: list[str] | None = None,
           signal: str | None = None) -> list[dict]:
    """Node's agent reports its first rank ended badly (the others still running)."""
    ranks = job.ranks_of(node)
    statuses = [WorkerStatus(ranks[0], 0, 2000 + ranks[0], generation, WorkerState.EXITED,
                             -9 if signal else 1, signal, error=error, log_tail=tail or []).to_dict()]
    statuses += [WorkerStatus(rank, local, 2000 + rank, generation, WorkerState.RUNNING).to_dict()
                 for local, rank in enumerate(ranks) if local > 0]
    return statuses


# ---------------------------------------------------------------- the pieces


def test_the_exception_line_is_the_last_tracebacks_own_line():
    assert exception_line(TRACEBACK) == "RuntimeError: boom"
    chained = [*TRACEBACK, "", "During handling of the above exception, another exception occurred:", "",
               "Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: bad value",
               "  more of its message"]
    assert exception_line(chained) == "ValueError: bad value"
    assert exception_line(["[rank3]: " + line for line in TRACEBACK]) == "RuntimeError: boom"
    assert exception_line(["Segmentation fault", "done"]) == ""


def test_a_log_tail_is_its_last_lines_and_the_exception(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_text("\n".join(["noise"] * 5000 + TRACEBACK) + "\n")
    tail, error = read_tail(log, lines=3)
    assert tail == ["    raise RuntimeError('boom')", "RuntimeError: boom"][-3:] or len(tail) == 3
    assert tail[-1] == "RuntimeError: boom" and len(tail) == 3
    assert error == "RuntimeError: boom"
    assert read_tail(tmp_path / "missing.log") == ([], "")


def test_an_exceptions_tail_names_it():
    try:
        raise KeyError("missing-key")
    except KeyError as error:
        tail, line = exception_tail(error)
    assert line == "KeyError: 'missing-key'"
    assert tail[0] == "Traceback (most recent call last):" and tail[-1] == line


def test_the_guard_counts_recoveries_without_progress_and_repeated_exceptions():
    guard = CrashLoop(limit=2)
    guard.watch(generation=1)
    killed = [Fault(FaultReason.WORKER_EXIT, rank=1, step=step, signal="SIGKILL") for step in (5, 5, 5)]
    assert guard.verdict(killed[0]) is None
    assert guard.verdict(killed[0]) is None  # the same fault decided again after a failed recovery
    assert guard.verdict(killed[1]) is None
    assert "2 recoveries in a row" in guard.verdict(killed[2])
    assert guard.root_cause() is killed[0]

    guard = CrashLoop(limit=3)
    guard.watch(generation=2, resume_step=7)
    boom = Fault(FaultReason.WORKER_EXIT, rank=2, step=7, exitcode=1, error="RuntimeError: boom")
    assert guard.verdict(boom) is None
    guard.heard(1, 9, Phase.UPDATED)  # an older generation's beat says nothing of this one
    guard.heard(2, 7, Phase.COMPUTING)
    assert guard.verdict(Fault(FaultReason.WORKER_EXIT, rank=2, step=7, exitcode=1,
                               error="RuntimeError: boom")) == "the same exception again at step 7"
    assert guard.root_cause() is boom


LOST = "undying.runtime.sharded.ShardLost: no replica holds the shard of group rank(s) [2]"


def test_a_refused_repair_that_comes_back_is_left_to_the_chain_and_to_the_limit():
    """No replica holds a lost shard: every repair attempt ends the worker with the refusal's exit
    status at the same step until the chain reaches a job restart; that is no script bug, so only
    crash_loop_limit can stop it, and the loop's cause is the fault that started it."""
    guard = CrashLoop(limit=3)
    killed = Fault(FaultReason.WORKER_EXIT, rank=2, step=15, signal="SIGKILL")
    assert guard.verdict(killed) is None
    refused = [Fault(FaultReason.WORKER_EXIT, rank=3, step=15, exitcode=WORKER_EXIT_REPAIR_REFUSED, error=LOST,
                     repair_refused=True) for _ in range(3)]
    for fault in refused[:2]:  # generations 2 and 3
        assert guard.verdict(fault) is None
    assert guard.verdict(refused[2]) == "3 recoveries in a row committed no step (crash_loop_limit 3)"
    assert guard.root_cause() is killed  # a refusal is undying's exception, never the script's


def test_only_the_workers_flag_makes_a_refusal_the_same_text_without_it_is_the_same_exception_again():
    """The refusal is told by the worker's exit status, not read from the text: a script that raises
    an exception of the same line at the same step twice is a crash loop."""
    guard = CrashLoop(limit=3)
    guard.verdict(Fault(FaultReason.WORKER_EXIT, rank=3, step=15, exitcode=WORKER_EXIT_REPAIR_REFUSED, error=LOST,
                        repair_refused=True))
    raised = Fault(FaultReason.WORKER_EXIT, rank=3, step=15, exitcode=1, error=LOST)
    assert guard.verdict(raised) is None  # an earlier refusal is not the same exception either
    assert guard.verdict(Fault(FaultReason.WORKER_EXIT, rank=3, step=15, exitcode=1, error=LOST)) == \
        "the same exception again at step 15"
    assert guard.root_cause() is raised


REFUSING_WORKER = """
from undying.runtime.process_exit import repair_refusal_exits
from undying.runtime.sharded import ShardLost

def repair():
    raise ShardLost("no replica holds the shard of group rank(s) [2]")

with repair_refusal_exits():
    repair()
print("not reached")
"""


def test_a_refusal_travels_as_the_workers_exit_status_to_a_typed_fault(make_job, tmp_path):
    """A worker process whose repair raises ShardLost exits with WORKER_EXIT_REPAIR_REFUSED, its
    log naming the exception; its agent's report of that exit, through JSON, becomes a fault flagged
    as a refusal, and the same refusal at the same step after a job restart is not a crash loop."""
    log = tmp_path / "rank2.log"
    with log.open("w") as output:
        done = subprocess.run([sys.executable, "-c", REFUSING_WORKER], stdout=output, stderr=subprocess.STDOUT,
                              timeout=120)
    assert done.returncode == WORKER_EXIT_REPAIR_REFUSED, log.read_text()
    tail, error = read_tail(log)  # as the agent reads it (agent/workers.py)
    assert error == LOST and "not reached" not in tail

    job = make_job(nnodes=2, nproc_per_node=2)
    job.start_running()
    for generation in (1, 2):
        status = WorkerStatus(2, 0, 2002, generation, WorkerState.EXITED, done.returncode, None, error=error,
                              log_tail=tail)
        running = WorkerStatus(3, 1, 2003, generation, WorkerState.RUNNING)
        job.poll(1, generation, [json.loads(json.dumps(status.to_dict())), running.to_dict()])
        assert [job.next_order(node, generation).kind for node in (1, 0)] == [OrderKind.STOP] * 2
        for node in (0, 1):
            job.poll(node, generation, job.statuses(node, generation, WorkerState.EXITED, 1))
        starts = [job.next_order(node, generation, job.statuses(node, generation, WorkerState.EXITED, 1))
                  for node in (0, 1)]
        assert [order.kind for order in starts] == [OrderKind.START] * 2  # a job restart, not a crash loop
    assert job.controller.state is JobState.RUNNING and job.events(ev.CRASH_LOOP) == []
    faults = job.events(ev.FAULT_DETECTED)
    assert [(fault.rank, fault.details["repair_refused"], fault.details["exitcode"]) for fault in faults] == \
        [(2, True, WORKER_EXIT_REPAIR_REFUSED)] * 2
    assert faults[0].details["description"] == f"rank 2 exited (repair refused): {LOST}"


def test_a_committed_step_ends_the_streak_and_a_planned_leave_is_no_part_of_it():
    guard = CrashLoop(limit=1)
    guard.watch(generation=3)
    guard.heard(3, 0, Phase.STARTING)  # not yet restored: not the resume step
    guard.heard(3, 10, Phase.COMPUTING)  # restored at 10
    assert guard.verdict(Fault(FaultReason.WORKER_EXIT, rank=0, step=12, signal="SIGKILL")) is None
    guard.watch(generation=4, resume_step=12)
    guard.heard(4, 13, Phase.UPDATED)  # step 12 committed after the recovery
    assert guard.verdict(Fault(FaultReason.WORKER_EXIT, rank=0, step=14, signal="SIGKILL")) is None
    assert guard.verdict(Fault(FaultReason.AGENT_LOST, node=1, step=14, planned=True)) is None
    assert guard.verdict(Fault(FaultReason.WORKER_EXIT, rank=0, step=14, signal="SIGKILL")) is not None
    assert CrashLoop(limit=0).verdict(Fault(FaultReason.WORKER_EXIT, rank=0, error="E")) is None


# ---------------------------------------------------------------- the job machine


def test_a_script_that_raises_at_its_first_step_stops_at_its_second_try_with_its_cause(make_job):
    """Job restarts only: the same exception at the same step after a restart stops the job (exit 1)."""
    job = make_job(nnodes=2, nproc_per_node=2)
    job.start_running()
    job.poll(1, 1, exited(job, 1, 1, "RuntimeError: boom", TRACEBACK))
    assert [job.next_order(node, 1).kind for node in (1, 0)] == [OrderKind.STOP] * 2
    for node in (0, 1):
        job.poll(node, 1, job.statuses(node, 1, WorkerState.EXITED, 1))
    starts = [job.next_order(node, 1, job.statuses(node, 1, WorkerState.EXITED, 1)) for node in (0, 1)]
    assert [order.kind for order in starts] == [OrderKind.START] * 2
    job.poll(1, 2, exited(job, 1, 2, "RuntimeError: boom", TRACEBACK))
    assert job.next_order(1, 2).kind == OrderKind.EXIT
    assert job.join() == 1
    assert job.controller.state is JobState.FAILED
    [loop] = job.events(ev.CRASH_LOOP)
    assert loop.rank == 2 and loop.details["error"] == "RuntimeError: boom"
    assert loop.details["log_tail"] == TRACEBACK and loop.details["recoveries"] == 1
    assert job.controller.message.startswith("crash loop (the same exception again at step 0); "
                                             "root cause: rank 2 exited (exit code 1): RuntimeError: boom")
    faults = job.events(ev.FAULT_DETECTED)
    assert [fault.details["description"] for fault in faults] == \
        ["rank 2 exited (exit code 1): RuntimeError: boom"] * 2
    [end] = job.events(ev.JOB_END)
    assert (end.details["recoveries"], end.details["job_restarts"]) == (1, 1)


def test_crashes_without_progress_stop_after_crash_loop_limit_recoveries(make_job):
    """Killed again and again before any step commits: recover-in-place twice, then the loop stops it."""
    job = make_job(nnodes=1, nproc_per_node=2, process_recover=True, recover_strategy=["recover-in-place"],
                   crash_loop_limit=2)
    job.start_running()
    for generation in (1, 2):
        job.beat(1, step=0, generation=generation)
        job.poll(0, generation, exited(job, 0, generation, signal="SIGKILL"))
        order = job.next_order(0, generation)
        assert (order.kind, order.ranks) == (OrderKind.REPLACE, [0])
        plan = job.controller.recover(RecoverRequest(1, 0, generation, 0, 2001, "peer gone"))
        job.controller.recover(RecoverRequest(0, 0, generation + 1, 0, 2000, "joining", newcomer=True))
        plan = job.controller.recover(RecoverRequest(1, 0, generation, 0, 2001, "peer gone"))
        assert plan.action == PlanAction.RESUME
    job.poll(0, 3, exited(job, 0, 3, signal="SIGKILL"))
    assert job.next_order(0, 3).kind == OrderKind.EXIT
    assert job.join() == 1
    [loop] = job.events(ev.CRASH_LOOP)
    assert loop.details["recoveries"] == 2
    assert "2 recoveries in a row committed no step (crash_loop_limit 2)" in job.controller.message


def test_a_fault_after_committed_steps_is_recovered_however_many_came_before(make_job):
    job = make_job(nnodes=1, nproc_per_node=2, process_recover=True, recover_strategy=["recover-in-place"],
                   crash_loop_limit=1)
    job.start_running()
    step = 0
    for generation in (1, 2, 3):
        job.beat(1, step=step, generation=generation)
        job.beat(1, step=step + 2, generation=generation, phase=Phase.UPDATED)  # two steps committed
        step += 2
        job.poll(0, generation, exited(job, 0, generation, signal="SIGKILL"))
        assert job.next_order(0, generation).kind == OrderKind.REPLACE
        job.controller.recover(RecoverRequest(1, 0, generation, step, 2001, "peer gone"))
        job.controller.recover(RecoverRequest(0, 0, generation + 1, 0, 2000, "joining", newcomer=True))
        assert job.controller.recover(RecoverRequest(1, 0, generation, step, 2001, "peer gone")).action \
            == PlanAction.RESUME
    assert job.controller.state is JobState.RUNNING
    assert job.events(ev.CRASH_LOOP) == []


def test_a_retried_exception_is_blamed_on_the_rank_that_raised_it(make_job):
    """retry: every rank checks in; the one whose own exception failed the step is the fault, and the
    same exception at the same step after the retry stops the job."""
    job = make_job(nnodes=2, nproc_per_node=1, process_recover=True, recover_strategy=["retry"])
    job.start_running()
    for generation in (1, 2):
        for rank in (0, 1):
            job.beat(rank, step=3, generation=generation)
        voted_no = RecoverRequest(0, 0, generation, 3, 2000, "a rank voted against this step")
        raised = RecoverRequest(1, 1, generation, 3, 2001, "exception in step: RuntimeError('boom')",
                                error="RuntimeError: boom", error_tail=TRACEBACK)
        plans = check_in_together(job.controller, [voted_no, raised])
        if generation == 1:
            assert [plan.action for plan in plans.values()] == [PlanAction.RESUME] * 2
    assert job.join() == 1
    first = job.events(ev.FAULT_DETECTED)[0]
    assert (first.rank, first.details["description"]) == (1, "rank 1 raised in its step: RuntimeError: boom")
    [loop] = job.events(ev.CRASH_LOOP)
    assert (loop.rank, loop.step, loop.details["log_tail"]) == (1, 3, TRACEBACK)
