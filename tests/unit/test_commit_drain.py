"""A job restart keeps a checkpoint whose records are all in: the stop orders wait while the rank
that commits it finishes (the job machine on a fake clock; the worker's side: tests/faults/test_job_restart.py)."""

from __future__ import annotations

from tests.unit.job_harness import Job
from undying import events as ev
from undying.controller.state import JobState
from undying.events import Event
from undying.protocol import Heartbeat, OrderKind, Phase, WorkerState


def restart_while_rank0_commits(job: Job, committing: int = 10, saved: int | None = None) -> None:
    job.start_running()
    if saved is not None:
        job.controller.worker_event(Event(ev.CHECKPOINT_SAVE, rank=0, node=0, step=saved, generation=1).__dict__)
    for rank in range(4):
        job.controller.heartbeat(Heartbeat(rank, rank // 2, 1, 12, Phase.COMPUTING, 2000 + rank,
                                           committing=committing if rank == 0 else 0))
    job.poll(1, 1, [*job.statuses(1, 1)[:1], *job.statuses(1, 1, WorkerState.EXITED, -9, "SIGKILL")[1:]])
    job.advance(0.1)
    assert [event.kind for event in job.events(ev.RESTART_BEGIN)] == [ev.RESTART_BEGIN]
    assert job.controller.state is JobState.STOPPING


def test_the_stop_waits_for_the_commit_then_goes_on(make_job):
    job = make_job(nnodes=2, nproc_per_node=2)
    restart_while_rank0_commits(job)
    assert job.poll(0, 1, job.statuses(0, 1), wait=1.0).kind == OrderKind.NONE  # rank 0 commits meanwhile
    job.controller.worker_event(Event(ev.CHECKPOINT_SAVE, rank=0, node=0, step=10, generation=1,
                                      details={"path": "/ckpt/step_000000010"}).__dict__)
    assert job.next_order(0, 1, job.statuses(0, 1)).kind == OrderKind.STOP
    [drain] = job.events(ev.COMMIT_DRAIN)
    assert (drain.rank, drain.step, drain.details["outcome"]) == (0, 10, "committed")


def test_the_wait_ends_when_the_commit_fails_or_its_writer_dies_or_at_the_deadline(make_job):
    failed = make_job(nnodes=2, nproc_per_node=2)
    restart_while_rank0_commits(failed)
    failed.controller.worker_event(Event(ev.PERSIST_FAILED, rank=0, node=0, step=10, generation=1,
                                         details={"reason": "records missing"}).__dict__)
    assert failed.next_order(0, 1, failed.statuses(0, 1)).kind == OrderKind.STOP
    assert failed.events(ev.COMMIT_DRAIN)[0].details["outcome"] == "failed"

    gone = make_job(nnodes=2, nproc_per_node=2)
    restart_while_rank0_commits(gone)
    assert gone.next_order(0, 1, gone.statuses(0, 1, WorkerState.EXITED, -9, "SIGKILL")).kind == OrderKind.STOP
    assert gone.events(ev.COMMIT_DRAIN)[0].details["outcome"] == "its writer is gone"

    late = make_job(nnodes=2, nproc_per_node=2)
    restart_while_rank0_commits(late)
    deadline = late.controller.machine.deadlines.commit_drain
    assert late.next_order(0, 1, late.statuses(0, 1), timeout=deadline + 1).kind == OrderKind.STOP
    [drain] = late.events(ev.COMMIT_DRAIN)
    assert drain.details["outcome"] == "timed out" and drain.details["seconds"] > deadline


def test_no_commit_in_flight_or_one_already_durable_holds_nothing(make_job):
    for committing, saved in ((0, None), (10, 10)):  # the beat was sent before the commit's event came
        job = make_job(nnodes=2, nproc_per_node=2)
        restart_while_rank0_commits(job, committing, saved)
        assert job.next_order(0, 1, job.statuses(0, 1)).kind == OrderKind.STOP
        assert job.events(ev.COMMIT_DRAIN) == []
