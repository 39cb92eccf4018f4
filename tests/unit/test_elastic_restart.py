"""A job restart of a job that elastic training shrank: it restarts at the size it has, at once.

Decision tests on the fake clock (``job_harness.py``): 3 nodes x 2 ranks, node 1 lost and
never back, so the job trains on ranks [0, 1, 4, 5]; then a fault that only a job restart
handles. Without elastic training, or at full size, a job restart still waits for every node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.unit.job_harness import Job, check_in_together
from undying import events as ev
from undying.controller.state import JobState
from undying.controller.strategies.job_restart import shrunk_restart_members
from undying.protocol import (
    AgentPoll,
    OrderKind,
    Phase,
    PlanAction,
    RecoverRequest,
    WorkerState,
    WorkerStatus,
)

ELASTIC_ONLY = {
    "process_recover": True,
    "recover_strategy": ["elastic-training"],
    "nnodes": 3,
    "nproc_per_node": 2,
    "max_restarts": 3,
    "heartbeat_timeout": 5.0,  # survivors wait for their plan longer than FAST's timeout
}
SURVIVORS = (0, 1, 4, 5)
SHRUNK_NODES = (0, 2)


def survivor(rank: int, wait: float) -> RecoverRequest:
    return RecoverRequest(rank, rank // 2, 1, 7, 2000 + rank, newcomer=False, wait=wait)


def shrunk_job(make_job: Callable[..., Job], **spec_fields: Any) -> Job:
    """Generation 2 trains on ranks [0, 1, 4, 5]: node 1 was lost at step 7 and did not come back."""
    job = make_job(**{**ELASTIC_ONLY, **spec_fields})
    job.start_running()
    for rank in range(job.spec.world_size):
        job.beat(rank, 7)
    job.controller.report_agent_exit(1, -9)
    assert job.wait_for(lambda: bool(job.events(ev.DECISION)))
    for rank in SURVIVORS:
        assert job.controller.check_in(survivor(rank, wait=0.0)).action == PlanAction.WAIT
    deadline = job.now() + job.spec.wait_reschedule_timeout + 5
    while not job.events(ev.ELASTIC_SHRINK) and job.now() < deadline:  # the survivors wait, alive
        for rank in SURVIVORS:
            job.beat(rank, 7, phase=Phase.RECOVERING)
        for node in SHRUNK_NODES:
            job.poll(node, 1, job.statuses(node, 1))
        job.advance(1.0)
    plans = check_in_together(job.controller, [survivor(rank, wait=2.0) for rank in SURVIVORS])
    assert {(plan.action, tuple(plan.members)) for plan in plans.values()} == {(PlanAction.RESUME, SURVIVORS)}
    for rank in SURVIVORS:
        job.beat(rank, 9, generation=2)
    assert job.controller.members == list(SURVIVORS)
    return job


def kill_worker_and_stop(job: Job, rank: int) -> None:
    """``rank``'s process is SIGKILLed; the chain's job restart stops the shrunk job's workers."""
    node = rank // job.spec.nproc_per_node
    status = WorkerStatus(rank, rank % 2, 2000 + rank, 1, WorkerState.EXITED, -9, "SIGKILL")
    job.controller.report(AgentPoll(node, 1, [status.to_dict()]))
    assert job.wait_for(lambda: job.controller.state is JobState.STOPPING)
    assert job.events(ev.DECISION)[-1].details["strategy"] == "job-restart"
    for node in SHRUNK_NODES:
        job.poll(node, 1, stopped(job, node))


def stopped(job: Job, node: int) -> list[dict[str, Any]]:
    return job.statuses(node, 1, WorkerState.EXITED, -15, "SIGTERM")


def grows(job: Job) -> list[ev.Event]:
    return [event for event in job.events(ev.RECOVERY_BEGIN) if event.details.get("grow")]


def test_a_shrunk_job_restarts_at_once_with_its_members_only(make_job):
    job = shrunk_job(make_job)
    kill_worker_and_stop(job, 4)
    starts = [job.next_order(node, 1, stopped(job, node)) for node in SHRUNK_NODES]
    assert [(o.kind, o.generation, o.ranks, o.members, o.world_size) for o in starts] == [
        (OrderKind.START, 3, [0, 1], list(SURVIVORS), 6), (OrderKind.START, 3, [4, 5], list(SURVIVORS), 6)]
    assert job.controller.state is JobState.RUNNING
    assert (job.controller.members, sorted(job.controller.ranks)) == (list(SURVIVORS), list(SURVIVORS))
    [begin] = job.events(ev.RESTART_BEGIN)
    [end] = job.events(ev.RESTART_END)
    assert end.time - begin.time < 1.0 < job.spec.node_return_timeout  # no wait for node 1
    start = job.events(ev.GENERATION_START)[-1]
    assert (start.generation, start.details["world_size"], start.details["members"]) == (3, 6, list(SURVIVORS))
    assert (job.poll(1).kind, job.poll(1).reason) == (OrderKind.NONE, "hello")  # node 1 is still gone


def test_a_dropped_node_back_after_a_shrunk_restart_grows_the_job_once_the_members_train(make_job):
    job = shrunk_job(make_job)
    kill_worker_and_stop(job, 4)
    for node in SHRUNK_NODES:
        assert job.next_order(node, 1, stopped(job, node)).kind == OrderKind.START
    assert job.hello(1).accepted
    replace = job.next_order(1)
    assert (replace.kind, replace.generation, replace.ranks) == (OrderKind.REPLACE, 4, [2, 3])
    for rank in (2, 3):  # the returned ranks are up and ask for their plan
        request = RecoverRequest(rank, 1, 4, 0, 3000 + rank, newcomer=True, wait=0.0)
        assert job.controller.check_in(request).action == PlanAction.WAIT
    job.advance(0.5)  # the members still restore at start: their generation is not ended under them
    assert grows(job) == []
    for rank in SURVIVORS:
        job.beat(rank, 9, generation=3)
    assert job.wait_for(lambda: bool(grows(job)))
    [grow] = grows(job)
    assert grow.details["grow"] and grow.details["newcomers"] == [2, 3]
    assert grow.details["survivors"] == list(SURVIVORS)


def test_a_shrunk_job_below_min_nodes_waits_for_every_node_and_fails(make_job):
    """Node 2 is lost too: one node left, below min_nodes 2. The restart waits for every node, as
    any job restart does, and fails after node_return_timeout."""
    job = shrunk_job(make_job, min_nodes=2)
    job.controller.report_agent_exit(2, -9)
    assert job.wait_for(lambda: job.controller.state is JobState.STOPPING)
    decision = job.events(ev.DECISION)[-1]
    assert decision.details["strategy"] == "job-restart"
    assert "below min_nodes (2)" in decision.details["reason"]
    job.poll(0, 1, stopped(job, 0))
    job.wait_state(JobState.RESTARTING)
    assert job.poll(0, 1, stopped(job, 0), wait=0.3).kind == OrderKind.NONE  # not started with node 0 alone
    assert job.join(timeout=job.spec.node_return_timeout + 2) == 1
    assert "node_return_timeout" in job.controller.message and "at restart" in job.controller.message


def test_a_full_size_elastic_job_restart_still_waits_for_the_lost_node(make_job):
    """Elastic training refuses (min_nodes is every node): the restart waits for node 1's hello."""
    job = make_job(**{**ELASTIC_ONLY, "min_nodes": 3})
    job.start_running()
    job.controller.report_agent_exit(1, -9)
    assert job.next_order(0, 1, job.statuses(0, 1)).kind == OrderKind.STOP
    for node in SHRUNK_NODES:
        job.poll(node, 1, stopped(job, node))
    job.wait_state(JobState.RESTARTING)
    assert job.poll(0, 1, stopped(job, 0), wait=1.0).kind == OrderKind.NONE
    assert job.hello(1).accepted
    starts = [job.next_order(node, 1, stopped(job, node)) for node in (0, 1, 2)]
    assert [(o.kind, o.generation, o.ranks, o.members) for o in starts] == [
        (OrderKind.START, 2, [0, 1], []), (OrderKind.START, 2, [2, 3], []), (OrderKind.START, 2, [4, 5], [])]


def test_without_elastic_training_a_shrunk_membership_restarts_every_rank(make_job):
    job = make_job(**{**ELASTIC_ONLY, "recover_strategy": ["recover-in-place"]})
    job.start_running()
    machine = job.controller.machine
    machine.membership.members = list(SURVIVORS)  # as an elastic shrink would have left it
    assert shrunk_restart_members(machine) is None
    elastic = make_job(**ELASTIC_ONLY)
    elastic.start_running()
    elastic.controller.machine.membership.members = list(SURVIVORS)
    assert shrunk_restart_members(elastic.controller.machine) == list(SURVIVORS)
