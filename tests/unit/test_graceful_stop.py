"""A job asked to stop persists its newest committed step first: the job machine on a fake clock."""

from __future__ import annotations

from tests.unit.job_harness import check_in_together
from undying import events as ev
from undying.controller.state import JobState
from undying.events import Event
from undying.protocol import OrderKind, Phase, PlanAction, RecoverRequest, WorkerState


def checkpoint_event(kind: str, rank: int, step: int, **details) -> dict:
    return Event(kind, rank=rank, node=rank, step=step, generation=1, details=details).__dict__


def test_a_stop_ends_the_generation_at_a_step_boundary_and_persists_the_newest_step(make_job):
    job = make_job(nnodes=2, nproc_per_node=1)
    job.start_running()
    for rank in (0, 1):
        job.beat(rank, step=7)
    job.controller._apply(lambda now: job.controller.machine.request_stop(now, "received SIGTERM"))
    assert job.controller.state is JobState.RECOVERING
    assert job.controller.machine.end_generation == 1  # each rank's next beat says: end at your boundary
    # A second request (another node of the step got the signal too) changes nothing.
    job.controller._apply(lambda now: job.controller.machine.request_stop(now, "agent 1 got SIGTERM"))
    assert job.controller.state is JobState.RECOVERING
    plans = check_in_together(job.controller, [RecoverRequest(rank, rank, 1, 8, 2000 + rank, "generation ended")
                                               for rank in (0, 1)])
    assert {plan.action for plan in plans.values()} == {PlanAction.PERSIST}
    assert {plan.target_step for plan in plans.values()} == {8}
    job.controller.worker_event(checkpoint_event(ev.CHECKPOINT_SAVE, 0, 8, path="/ckpt/step_000000008"))
    assert job.controller.state is JobState.STOPPED and job.exit_code == 75
    assert "step 8 persisted to /ckpt/step_000000008" in job.controller.message
    assert job.next_order(0, 1).kind == OrderKind.EXIT
    [begin] = job.events(ev.STOP_BEGIN)
    assert begin.details["why"] == "received SIGTERM"


def test_a_stop_whose_checkpoint_fails_cancels_the_job_naming_the_newest_durable_step(make_job):
    job = make_job(nnodes=1, nproc_per_node=2)
    job.start_running()
    job.controller.worker_event(checkpoint_event(ev.CHECKPOINT_SAVE, 0, 5, path="/ckpt/step_000000005"))
    job.controller._apply(lambda now: job.controller.machine.request_stop(now, "undying stop"))
    check_in_together(job.controller, [RecoverRequest(rank, 0, 1, 6, 2000 + rank, "ended") for rank in (0, 1)])
    job.controller.worker_event(checkpoint_event(ev.PERSIST_FAILED, 1, 6, reason="OSError: disk full"))
    assert job.controller.state is JobState.CANCELLED and job.exit_code == 130
    assert "OSError: disk full" in job.controller.message
    assert job.controller.message.endswith("newest durable checkpoint: step 5")


def test_a_stop_not_done_within_stop_timeout_cancels(make_job):
    job = make_job(nnodes=1, nproc_per_node=2, stop_timeout=2)
    job.start_running()
    job.controller._apply(lambda now: job.controller.machine.request_stop(now, "received SIGTERM"))
    job.advance(2.5)  # the ranks never reach a step boundary
    assert job.controller.state is JobState.CANCELLED
    assert "could not be persisted" in job.controller.message


def test_a_job_without_t2_or_not_yet_training_is_cancelled_at_once(make_job):
    job = make_job(nnodes=1, nproc_per_node=1, checkpoint={"persist": False})
    job.start_running()
    job.controller._apply(lambda now: job.controller.machine.request_stop(now, "received SIGTERM"))
    assert job.controller.state is JobState.CANCELLED
    waiting = make_job(nnodes=2, nproc_per_node=1)
    waiting.controller._apply(lambda now: waiting.controller.machine.request_stop(now, "received SIGTERM"))
    assert waiting.controller.state is JobState.CANCELLED


def test_a_stop_asked_during_a_job_restart_starts_once_the_job_trains_again(make_job):
    """The newest committed step may be in node memory only: the restart restores it, then it is persisted."""
    job = make_job(nnodes=1, nproc_per_node=1)
    job.start_running()
    job.poll(0, 1, job.statuses(0, 1, WorkerState.EXITED, 1))
    assert job.next_order(0, 1).kind == OrderKind.STOP
    job.controller._apply(lambda now: job.controller.machine.request_stop(now, "received SIGTERM"))
    assert job.controller.state is JobState.STOPPING
    start = job.next_order(0, 1, job.statuses(0, 1, WorkerState.EXITED, 1))
    assert start.kind == OrderKind.START
    job.advance(0.1)
    assert job.controller.state is JobState.RECOVERING
    assert job.controller.machine.recovery.strategy == "stop"


def test_a_stop_at_a_checkpoint_step_already_persisted_ends_without_a_second_write(make_job):
    """The newest committed step was a checkpoint step and its periodic checkpoint committed before
    the plan: the stop is done at once (no save event would come for it again)."""
    job = make_job(nnodes=1, nproc_per_node=2)
    job.start_running()
    job.controller.worker_event(checkpoint_event(ev.CHECKPOINT_SAVE, 0, 10, path="/ckpt/step_000000010"))
    job.controller._apply(lambda now: job.controller.machine.request_stop(now, "received SIGTERM"))
    plans = check_in_together(job.controller, [RecoverRequest(rank, 0, 1, 10, 2000 + rank, "ended") for rank in (0, 1)])
    job.advance(0.1)
    assert {plan.action for plan in plans.values()} <= {PlanAction.PERSIST, PlanAction.EXIT}, plans
    assert not job.events(ev.PERSIST_FAILED)
    assert job.controller.state is JobState.STOPPED and job.exit_code == 75
    assert "step 10 persisted by its periodic checkpoint" in job.controller.message


def test_a_stop_asked_as_training_ends_lets_the_job_finish(make_job):
    """A rank already done (its last step committed, its checkpoints closed) will never check in at a
    boundary: the stop does not begin, and the job ends as it would have, exit 0."""
    job = make_job(nnodes=2, nproc_per_node=1)
    job.start_running()
    job.beat(1, step=30, phase=Phase.DONE)
    job.controller._apply(lambda now: job.controller.machine.request_stop(now, "received SIGTERM"))
    job.advance(0.5)
    assert job.controller.state is JobState.RUNNING and not job.events(ev.STOP_BEGIN)
    job.beat(0, step=30, phase=Phase.DONE)
    for node in (0, 1):
        job.poll(node, 1, job.statuses(node, 1, WorkerState.EXITED, 0))
    job.advance(0.1)
    assert job.controller.state is JobState.SUCCEEDED and job.exit_code == 0
    assert job.controller.message == "finished at step 30"


def test_a_stop_whose_ranks_all_finish_their_last_step_instead_ends_the_job_as_finished(make_job):
    job = make_job(nnodes=2, nproc_per_node=1)
    job.start_running()
    job.controller._apply(lambda now: job.controller.machine.request_stop(now, "received SIGTERM"))
    assert job.controller.state is JobState.RECOVERING
    for rank in (0, 1):  # the stop came during the last step: each rank ends its loop instead of checking in
        job.beat(rank, step=30, phase=Phase.DONE)
    job.advance(0.5)
    assert job.controller.state is JobState.SUCCEEDED and job.exit_code == 0
    assert "before the stop (received SIGTERM) took effect" in job.controller.message
