"""The controller's decisions: the job machine driven by plain calls on a fake clock.

The test plays every agent (``hello``/``poll``) and worker (``heartbeat``/``recover``/
``worker_event``): no threads, no sleeps, no processes, no sockets (``job_harness.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.unit.job_harness import JOB_ID, STORE_PORT, Job
from tests.unit.job_harness import check_in_together as harness_check_in_together
from undying import events as ev
from undying.config import spec_to_dict
from undying.controller.state import ALLOWED_TRANSITIONS, IllegalTransition, JobState, check_transition
from undying.events import Event
from undying.inject import encode, parse_injections
from undying.protocol import (
    AgentHello,
    AgentLeave,
    AgentPoll,
    Heartbeat,
    InjectionClaim,
    OrderKind,
    Phase,
    Plan,
    PlanAction,
    RecoverRequest,
    WorkerState,
    WorkerStatus,
)

# ---------------------------------------------------------------- start


def test_waits_for_every_node_then_orders_generation_one(make_job):
    job = make_job(nnodes=2, nproc_per_node=2)
    job.start()
    assert job.hello(0).accepted
    assert job.poll(0, wait=0.3).kind == OrderKind.NONE
    assert job.controller.state is JobState.WAITING_FOR_NODES
    assert job.controller.generation == 0

    reply = job.hello(1)
    assert (reply.accepted, reply.job_id, reply.store_port) == (True, JOB_ID, STORE_PORT)
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        order = job.next_order(node)
        assert order.kind == OrderKind.START
        assert order.generation == 1
        assert order.ranks == ranks
        assert (order.world_size, order.store_port, order.restart_count) == (4, STORE_PORT, 0)
    assert job.controller.state is JobState.RUNNING
    assert [event.node for event in job.events(ev.AGENT_REGISTERED)] == [0, 1]
    assert [event.generation for event in job.events(ev.GENERATION_START)] == [1]
    assert job.events(ev.RESTART_END) == []


def test_hello_is_refused_for_a_node_outside_the_job_a_wrong_nproc_or_a_finished_job(make_job):
    job = make_job(nnodes=2, nproc_per_node=2)
    reply = job.hello(2)
    assert not reply.accepted and "nnodes" in reply.reason
    reply = job.hello(0, nproc=3)
    assert not reply.accepted and "nproc_per_node" in reply.reason
    assert job.controller.nodes == {}
    job.controller.cancel("stop")
    reply = job.hello(0)
    assert not reply.accepted and "cancelled" in reply.reason


def test_an_agent_started_with_another_job_spec_is_refused_naming_the_fields(make_job):
    """The spec travels with the job: every node must run the controller's, or its workers would
    keep other timeouts than the controller's deadlines assume."""
    job = make_job(nnodes=2, nproc_per_node=2, comm_timeout=30.0)
    ours = spec_to_dict(job.spec)
    theirs = {**ours, "comm_timeout": 90.0, "max_restarts": 3}
    reply = job.controller.hello(AgentHello(1, 1001, "host1", 2, spec=theirs))
    assert not reply.accepted
    assert reply.reason == "the agent's job spec differs from the controller's in: comm_timeout, max_restarts"
    assert job.controller.nodes == {}
    assert [event.kind for event in job.events()] == []
    assert job.controller.hello(AgentHello(1, 1001, "host1", 2, spec=ours)).accepted


def test_a_node_that_never_says_hello_fails_the_start(make_job):
    job = make_job(nnodes=2, node_return_timeout=0.3)
    job.hello(0)
    job.start()
    order = job.next_order(0)
    assert order.kind == OrderKind.EXIT
    assert job.join() == 1
    assert job.controller.state is JobState.FAILED
    assert "[1]" in job.controller.message
    assert "node_return_timeout" in job.controller.message and "at start" in job.controller.message


def test_a_poll_from_an_unknown_node_asks_for_hello(make_job):
    job = make_job()
    order = job.poll(0)
    assert (order.kind, order.reason) == (OrderKind.NONE, "hello")


# ---------------------------------------------------------------- worker faults


@pytest.mark.parametrize(
    ("exitcode", "signal", "described"),
    [(1, None, "rank 3 exited (exit code 1)"), (-9, "SIGKILL", "rank 3 exited (killed by SIGKILL)")],
    ids=["exit-code", "signal"],
)
def test_a_worker_exit_stops_every_node_then_starts_generation_two(make_job, exitcode, signal, described):
    job = make_job(nnodes=2, nproc_per_node=2, max_restarts=3)
    job.start_running()
    for rank in range(4):
        job.beat(rank, step=7)
    node1 = job.statuses(1, 1)
    node1[1] = WorkerStatus(3, 1, 2003, 1, WorkerState.EXITED, exitcode, signal).to_dict()

    stop = job.next_order(1, 1, node1)
    assert (stop.kind, stop.generation, stop.reason) == (OrderKind.STOP, 1, described)
    stop = job.next_order(0, 1, job.statuses(0, 1))
    assert (stop.kind, stop.generation) == (OrderKind.STOP, 1)
    assert job.controller.state is JobState.STOPPING

    [fault] = job.events(ev.FAULT_DETECTED)
    assert (fault.node, fault.rank, fault.step, fault.generation) == (1, 3, 7, 1)
    assert fault.details["reason"] == "worker_exit"
    assert (fault.details["exitcode"], fault.details["signal"]) == (exitcode, signal)
    assert fault.details["description"] == described
    [decision] = job.events(ev.DECISION)
    assert decision.details["strategy"] == "job-restart"
    assert (decision.details["restart_count"], decision.details["max_restarts"]) == (0, 3)
    assert [event.kind for event in job.events() if event.kind in (ev.FAULT_DETECTED, ev.DECISION,
                                                                  ev.RESTART_BEGIN)] == [
        ev.FAULT_DETECTED, ev.DECISION, ev.RESTART_BEGIN]

    # Node 0's workers are still running: no new generation until they are gone.
    assert job.poll(0, 1, job.statuses(0, 1), wait=0.3).kind == OrderKind.NONE
    assert job.controller.state is JobState.STOPPING
    job.poll(1, 1, job.statuses(1, 1, WorkerState.EXITED, -15, "SIGTERM"))
    starts = [job.next_order(node, 1, job.statuses(node, 1, WorkerState.EXITED, -15, "SIGTERM"))
              for node in (0, 1)]
    assert [(o.kind, o.generation, o.ranks, o.restart_count) for o in starts] == [
        (OrderKind.START, 2, [0, 1], 1), (OrderKind.START, 2, [2, 3], 1)]
    assert job.controller.state is JobState.RUNNING
    assert [event.generation for event in job.events(ev.GENERATION_START)] == [1, 2]
    assert [event.generation for event in job.events(ev.RESTART_END)] == [2]
    status = job.controller.status()
    assert (status["generation"], status["restart_count"], status["faults"]) == (2, 1, {"worker_exit": 1})

    # Stragglers from generation 1 change nothing in generation 2.
    job.beat(0, step=99, generation=1)
    assert job.controller.status()["ranks"]["0"]["step"] == 0


def test_max_restarts_zero_fails_the_job_and_orders_every_agent_to_exit(make_job):
    job = make_job(nnodes=2, nproc_per_node=1, max_restarts=0)
    job.start_running()
    job.poll(0, 1, job.statuses(0, 1, WorkerState.EXITED, 1))

    exits = [job.next_order(node, 1) for node in (0, 1)]
    assert [order.kind for order in exits] == [OrderKind.EXIT, OrderKind.EXIT]
    assert job.join() == 1
    assert job.controller.state is JobState.FAILED
    assert job.controller.exit_code == 1
    assert "max_restarts" in job.controller.message
    assert exits[0].reason == job.controller.message
    [decision] = job.events(ev.DECISION)
    assert decision.details["strategy"] == "exit"
    assert "max_restarts (0)" in decision.details["reason"]
    [end] = job.events(ev.JOB_END)
    assert (end.details["outcome"], end.details["exit_code"], end.details["recoveries"]) == ("failed", 1, 0)
    assert job.events(ev.RESTART_BEGIN) == []


def test_restarts_stop_once_max_restarts_are_used(make_job):
    job = make_job(nproc_per_node=1, max_restarts=1)
    job.start_running()
    job.poll(0, 1, job.statuses(0, 1, WorkerState.EXITED, 1))
    assert job.next_order(0, 1).kind == OrderKind.STOP
    start = job.next_order(0, 1, job.statuses(0, 1, WorkerState.EXITED, 1))
    assert (start.kind, start.generation) == (OrderKind.START, 2)
    job.poll(0, 2, job.statuses(0, 2, WorkerState.EXITED, 1))
    assert job.next_order(0, 2).kind == OrderKind.EXIT
    assert job.join() == 1
    assert "max_restarts (1)" in job.controller.message


def test_every_rank_exiting_zero_succeeds(make_job):
    job = make_job(nnodes=2, nproc_per_node=2)
    job.start_running()
    for rank in range(4):
        job.beat(rank, step=5, phase=Phase.DONE)
    # One node finishing is not the job finishing.
    assert job.poll(0, 1, job.statuses(0, 1, WorkerState.EXITED, 0), wait=0.3).kind == OrderKind.NONE
    assert job.controller.state is JobState.RUNNING

    job.poll(1, 1, job.statuses(1, 1, WorkerState.EXITED, 0))
    exits = [job.next_order(node, 1) for node in (0, 1)]
    assert [order.kind for order in exits] == [OrderKind.EXIT, OrderKind.EXIT]
    assert job.join() == 0
    assert job.controller.state is JobState.SUCCEEDED
    assert job.controller.message == "finished at step 5"
    [end] = job.events(ev.JOB_END)
    assert (end.details["outcome"], end.details["exit_code"], end.step) == ("succeeded", 0, 5)
    assert job.events(ev.FAULT_DETECTED) == []
    assert len(job.events(ev.WORKER_EXIT)) == 4


def test_worker_done_event_marks_the_rank_done_and_is_logged(make_job):
    job = make_job(nproc_per_node=1)
    job.start_running()
    job.controller.worker_event(Event(ev.WORKER_DONE, node=0, rank=0, step=12, generation=1).__dict__)
    record = job.controller.ranks[0]
    assert (record.done, record.step) == (True, 12)
    [done] = job.events(ev.WORKER_DONE)
    assert (done.rank, done.step) == (0, 12)


# ---------------------------------------------------------------- hangs


def test_a_rank_that_stops_heartbeating_is_a_heartbeat_missed_fault(make_job):
    job = make_job(nproc_per_node=2, heartbeat_timeout=0.25)
    job.start_running()
    # Rank 0 beats for three timeouts; rank 1 never beats, so only start_timeout applies to it.
    until = job.now() + 0.75
    step = 0
    while job.now() < until:
        step += 1
        job.beat(0, step)
        job.poll(0, 1, job.statuses(0, 1), wait=0.05)
    assert job.controller.state is JobState.RUNNING
    assert job.events(ev.FAULT_DETECTED) == []

    stop = job.next_order(0, 1, job.statuses(0, 1))
    assert stop.kind == OrderKind.STOP
    [fault] = job.events(ev.FAULT_DETECTED)
    assert fault.details["reason"] == "heartbeat_missed"
    assert (fault.node, fault.rank) == (0, 0)
    assert "missed its heartbeats" in fault.details["description"]
    assert job.controller.faults_total == {"heartbeat_missed": 1}


def test_a_live_rank_that_commits_no_step_is_a_step_stalled_fault(make_job):
    job = make_job(nproc_per_node=1, heartbeat_timeout=5.0, step_timeout=0.3)
    job.start_running()
    # The rank keeps beating (its heartbeat thread is alive) but its step never moves after step 7.
    job.beat(0, 6)
    job.keep_beating(0, 7, seconds=0.2, poll_wait=0.02)
    assert job.events(ev.FAULT_DETECTED) == []
    job.keep_beating(0, 7, seconds=3.0, until=lambda: bool(job.events(ev.FAULT_DETECTED)))
    [fault] = job.events(ev.FAULT_DETECTED)
    assert (fault.details["reason"], fault.rank, fault.step) == ("step_stalled", 0, 7)
    assert "committed no step within step_timeout" in fault.details["description"]


def test_step_stall_is_only_reported_with_watchdog_detect_only(make_job):
    job = make_job(nproc_per_node=1, heartbeat_timeout=5.0, step_timeout=0.2, watchdog="detect-only")
    job.start_running()
    job.beat(0, 2)
    job.keep_beating(0, 3, seconds=1.0)
    assert job.events(ev.FAULT_DETECTED) == []
    assert len(job.events(ev.HANG_SUSPECTED)) == 1
    assert job.controller.state is JobState.RUNNING


def test_a_rank_that_never_heartbeats_is_a_start_timeout_fault(make_job):
    job = make_job(nproc_per_node=1, start_timeout=0.3)
    job.start_running()
    assert job.next_order(0, 1, job.statuses(0, 1)).kind == OrderKind.STOP
    [fault] = job.events(ev.FAULT_DETECTED)
    assert (fault.details["reason"], fault.rank) == ("start_timeout", 0)


# ---------------------------------------------------------------- lost nodes


def test_a_lost_agent_is_a_fault_and_the_restart_waits_for_its_hello(make_job):
    job = make_job(nnodes=2, nproc_per_node=2)
    job.start_running()
    job.controller.report_agent_exit(1, -9)
    assert job.lost_nodes == [1]
    [lost] = job.events(ev.AGENT_LOST)
    assert lost.node == 1 and "-9" in lost.details["why"]
    # The lost node's agent is told to say hello again, not given the stop.
    assert (job.poll(1).kind, job.poll(1).reason) == (OrderKind.NONE, "hello")

    assert job.next_order(0, 1, job.statuses(0, 1)).kind == OrderKind.STOP
    [fault] = job.events(ev.FAULT_DETECTED)
    assert (fault.details["reason"], fault.node) == ("agent_lost", 1)
    assert fault.details["description"] == "node 1 lost (agent gone)"

    stopped = job.statuses(0, 1, WorkerState.EXITED, -15, "SIGTERM")
    job.poll(0, 1, stopped)
    job.wait_state(JobState.RESTARTING)
    assert job.poll(0, 1, stopped, wait=0.3).kind == OrderKind.NONE
    assert job.controller.generation == 1

    assert job.hello(1).accepted
    start0 = job.next_order(0, 1, stopped)
    start1 = job.next_order(1)
    assert (start0.kind, start0.generation, start0.ranks) == (OrderKind.START, 2, [0, 1])
    assert (start1.kind, start1.generation, start1.ranks) == (OrderKind.START, 2, [2, 3])
    assert [event.node for event in job.events(ev.AGENT_REGISTERED)] == [0, 1, 1]


def test_agent_exit_after_its_exit_order_is_not_a_loss(make_job):
    job = make_job(nnodes=2, nproc_per_node=1)
    job.start_running()
    job.controller.cancel("done with it")
    assert job.next_order(1, 1).kind == OrderKind.EXIT
    job.controller.report_agent_exit(1, 0)
    assert job.events(ev.AGENT_LOST) == []
    assert job.lost_nodes == []


def test_a_node_that_never_returns_fails_the_job(make_job):
    job = make_job(nnodes=2, nproc_per_node=1, node_return_timeout=0.5)
    job.start_running()
    job.controller.report_agent_exit(1, None)
    assert job.next_order(0, 1, job.statuses(0, 1)).kind == OrderKind.STOP
    order = job.next_order(0, 1, job.statuses(0, 1, WorkerState.EXITED, -15, "SIGTERM"))
    assert order.kind == OrderKind.EXIT
    assert job.join() == 1
    assert job.controller.state is JobState.FAILED
    message = job.controller.message
    assert "[1]" in message and "node_return_timeout (0.5 s)" in message and "at restart" in message


def test_hello_again_from_a_live_node_is_a_loss_and_a_restart(make_job):
    job = make_job(nnodes=2, nproc_per_node=1)
    job.start_running()
    assert job.hello(1).accepted  # the same agent's hello again (a retry whose first answer was lost): no news
    assert not job.events(ev.AGENT_LOST)
    assert job.controller.hello(AgentHello(1, 5001, "host1", 1)).accepted  # a new agent process: restarted
    assert job.next_order(0, 1, job.statuses(0, 1)).kind == OrderKind.STOP
    [lost] = job.events(ev.AGENT_LOST)
    assert lost.node == 1
    assert job.lost_nodes == []  # the agent is already back: nothing to respawn


# ---------------------------------------------------------------- cancel, injections, status


def test_cancel_ends_the_job_with_130_and_orders_agents_to_exit(make_job):
    job = make_job(nnodes=2, nproc_per_node=1)
    job.start_running()
    job.controller.cancel("interrupted by the user")
    orders = [job.next_order(node, 1) for node in (0, 1)]
    assert [(o.kind, o.reason) for o in orders] == [(OrderKind.EXIT, "interrupted by the user")] * 2
    assert job.join() == 130
    assert job.controller.state is JobState.CANCELLED
    job.controller.cancel("again")
    assert (job.controller.exit_code, job.controller.message) == (130, "interrupted by the user")
    [end] = job.events(ev.JOB_END)
    assert (end.details["outcome"], end.details["exit_code"]) == ("cancelled", 130)


def test_an_injection_is_granted_once_and_only_in_the_current_generation(make_job):
    job = make_job(nproc_per_node=2)
    job.controller.machine.injections_text = encode(parse_injections(["raise:rank=0:step=3"] * 2))
    job.start_running()
    claim = job.controller.claim_injection
    assert claim(InjectionClaim(index=0, rank=0, node=0, generation=1, step=3))
    assert not claim(InjectionClaim(index=0, rank=1, node=0, generation=1, step=3))
    assert not claim(InjectionClaim(index=0, rank=0, node=0, generation=1, step=4))
    assert not claim(InjectionClaim(index=1, rank=0, node=0, generation=0, step=3))
    assert claim(InjectionClaim(index=1, rank=0, node=0, generation=1, step=3))
    assert not claim(InjectionClaim(index=2, rank=0, node=0, generation=1, step=3))  # the job has no third
    assert job.controller.claimed_injections == {0, 1}


def test_status_reports_nodes_ranks_and_progress(make_job):
    job = make_job(nnodes=2, nproc_per_node=2, max_restarts=4)
    status = job.controller.status()
    assert (status["state"], status["generation"], status["nodes"], status["ranks"]) == (
        "waiting_for_nodes", 0, {}, {})
    job.start_running()
    for rank, step in ((0, 10), (1, 12), (2, 9)):
        job.beat(rank, step)

    status = job.controller.status()
    assert status["job_id"] == JOB_ID
    assert status["state"] == "running"
    assert (status["generation"], status["restart_count"], status["max_restarts"]) == (1, 0, 4)
    assert status["world_size"] == 4
    assert status["committed_step"] == 0  # rank 3 has not committed a step
    assert status["message"] == "" and status["faults"] == {}
    assert status["uptime_seconds"] >= 0
    assert set(status["nodes"]) == {"0", "1"}
    node = status["nodes"]["1"]
    assert (node["alive"], node["pid"], node["host"], node["running_workers"]) == (True, 1001, "host1", 2)
    assert node["seconds_since_poll"] >= 0
    assert set(status["ranks"]) == {"0", "1", "2", "3"}
    rank = status["ranks"]["1"]
    assert (rank["node"], rank["step"], rank["phase"], rank["pid"]) == (0, 12, Phase.COMPUTING, 2001)
    assert (rank["done"], rank["exitcode"]) == (False, None)
    assert rank["seconds_since_heartbeat"] >= 0
    assert status["ranks"]["3"]["seconds_since_heartbeat"] is None

    job.beat(3, 11)
    assert job.controller.status()["committed_step"] == 9


# ---------------------------------------------------------------- process-level recovery

# Every built process-level strategy on, 2 nodes x 2 ranks.
RECOVERY = {
    "process_recover": True,
    "recover_strategy": ["retry", "recover-in-place", "recover", "dump"],
    "pod_rescheduling": "on",
    "nnodes": 2,
    "nproc_per_node": 2,
    # A survivor waits for its plan longer than FAST's heartbeat timeout; a real one keeps beating meanwhile.
    "heartbeat_timeout": 5.0,
}
# How long a worker's check-in waits for its plan in these tests.
PLAN_WAIT_S = 2.0


def recovering_job(make_job: Callable[..., Job], step: int = 7, **spec_fields: Any) -> Job:
    """A running generation 1 with every process-level strategy on; every rank has committed ``step``."""
    job = make_job(**{**RECOVERY, **spec_fields})
    job.start_running()
    for rank in range(job.spec.world_size):
        job.beat(rank, step)
    return job


def report_exit(job: Job, rank: int, generation: int = 1) -> None:
    """The agent's immediate report that ``rank``'s process (spawned in ``generation``) was killed."""
    node = rank // job.spec.nproc_per_node
    status = WorkerStatus(rank, rank % job.spec.nproc_per_node, 2000 + rank, generation, WorkerState.EXITED,
                          -9, "SIGKILL")
    job.controller.report(AgentPoll(node, generation, [status.to_dict()]))


def survivor(job: Job, rank: int, committed_step: int, wait: float = PLAN_WAIT_S,
             reason: str = "") -> RecoverRequest:
    """The check-in of a rank that keeps its memory: it is still in generation 1."""
    return RecoverRequest(rank, rank // job.spec.nproc_per_node, 1, committed_step, 2000 + rank, reason,
                          newcomer=False, wait=wait)


def newcomer(job: Job, rank: int, generation: int = 2, wait: float = PLAN_WAIT_S) -> RecoverRequest:
    """The check-in of a replacement process, started in the recovery's generation."""
    return RecoverRequest(rank, rank // job.spec.nproc_per_node, generation, 0, 3000 + rank,
                          newcomer=True, wait=wait)


def check_in_together(job: Job, requests: list[RecoverRequest]) -> dict[int, Plan]:
    """Every request long-polls for its plan, as the workers do."""
    return harness_check_in_together(job.controller, requests)


def test_a_killed_worker_is_recovered_in_place_and_only_it_restarts(make_job):
    job = recovering_job(make_job)
    assert job.controller.heartbeat(Heartbeat(0, 0, 1, 7, Phase.COMPUTING, 2000)).abort_generation == 0
    report_exit(job, 3)

    node1 = job.statuses(1, 1)
    node1[1] = WorkerStatus(3, 1, 2003, 1, WorkerState.EXITED, -9, "SIGKILL").to_dict()
    replace = job.next_order(1, 1, node1)
    assert (replace.kind, replace.generation, replace.ranks) == (OrderKind.REPLACE, 2, [3])
    assert (replace.world_size, replace.store_port, replace.restart_count) == (4, STORE_PORT, 1)
    assert job.controller.state is JobState.RECOVERING
    # Node 0's workers keep running: it gets no order at all.
    assert job.poll(0, 1, job.statuses(0, 1), wait=0.2).kind == OrderKind.NONE
    [decision] = job.events(ev.DECISION)
    assert decision.details["strategy"] == "recover-in-place"
    assert decision.details["lost_ranks"] == [3]
    [begin] = job.events(ev.RECOVERY_BEGIN)
    assert begin.generation == 2
    assert begin.details == {"strategy": "recover-in-place", "old_generation": 1, "survivors": [0, 1, 2],
                             "newcomers": [3], "awaited_nodes": []}
    [replaced] = job.events(ev.REPLACE)
    assert (replaced.node, replaced.generation, replaced.details) == (1, 2, {"ranks": [3]})
    # Heartbeats tell the survivors to leave generation 1's collectives.
    for rank in (0, 1, 2):
        assert job.controller.heartbeat(Heartbeat(rank, rank // 2, 1, 7, Phase.COMPUTING, 2000 + rank)) \
            .abort_generation == 1
    assert job.controller.status()["recovery"] == {
        "strategy": "recover-in-place", "generation": 2, "waiting_for": [0, 1, 2, 3], "awaited_nodes": []}

    plans = check_in_together(job, [survivor(job, 0, 7), survivor(job, 1, 7), survivor(job, 2, 7),
                                    newcomer(job, 3)])
    expected = Plan(action=PlanAction.RESUME, strategy="recover-in-place", generation=2, world_size=4, target_step=7,
                    source_rank=0, receivers=[3], reason="rank 3 exited (killed by SIGKILL)", members=[0, 1, 2, 3],
                    store=f"127.0.0.1:{STORE_PORT}", holders=[0, 1, 2])
    assert plans == {rank: expected for rank in range(4)}
    assert job.controller.state is JobState.RUNNING
    status = job.controller.status()
    assert (status["generation"], status["restart_count"], status["recovery"]) == (2, 1, None)
    [published] = job.events(ev.RECOVERY_PLAN)
    assert (published.generation, published.step) == (2, 7)
    assert (published.details["action"], published.details["source_rank"], published.details["receivers"]) == (
        PlanAction.RESUME, 0, [3])
    assert job.events(ev.RESTART_BEGIN) == [] and job.events(ev.RECOVERY_FAILED) == []

    # A rank that asks again after the plan was published gets the same plan.
    assert job.controller.recover(survivor(job, 1, 7, wait=0.0)) == expected
    # The replacement runs in generation 2; the job carries on from step 7.
    job.poll(1, 2, job.statuses(1, 2))
    job.beat(3, 8, generation=2)
    for rank in (0, 1, 2):
        job.beat(rank, 8, generation=2)
    assert job.controller.status()["committed_step"] == 8
    assert job.poll(0, 2, job.statuses(0, 2), wait=0.3).kind == OrderKind.NONE
    assert job.controller.state is JobState.RUNNING


def test_a_kill_right_after_the_start_is_recovered_in_place_once_every_rank_said_it_restored(make_job):
    """A worker tells the controller it has restored (a beat of its own, answered) before its first
    step; its heartbeat thread's older beat, still saying "starting", may arrive after that and must
    not make it look as if it were restoring again: a peer killed a few steps into the run is then
    recovered in place, not by a job restart. A rank that never said so still is restoring."""
    job = make_job(**RECOVERY)
    job.start_running()
    for rank in range(job.spec.world_size):
        job.beat(rank, 0, Phase.COMPUTING)  # restored
        job.beat(rank, 0, Phase.STARTING)  # the heartbeat thread's beat, overtaken
    report_exit(job, 3)
    assert job.next_order(1, 1).kind == OrderKind.REPLACE
    [decision] = job.events(ev.DECISION)
    assert decision.details["strategy"] == "recover-in-place", decision.details["reason"]

    late = make_job(**RECOVERY)
    late.start_running()
    for rank in range(late.spec.world_size):
        late.beat(rank, 0, Phase.STARTING)
    report_exit(late, 3)
    assert late.next_order(1, 1).kind == OrderKind.STOP
    [decision] = late.events(ev.DECISION)
    assert "still restoring" in decision.details["reason"], decision.details


def test_an_agent_whose_connection_closed_is_lost_within_half_a_second_and_blamed_before_a_survivor(make_job):
    """A real host's node dies (its `undying run` killed): its agent's poll connection closes. The
    survivors' failed all-reduce arrives first, but the decision waits for the node and is the
    lost node's strategy (recover), not a survivor's."""
    job = recovering_job(make_job, monitor_interval=5.0)
    job.controller.agent_disconnected(1, 1001)
    [disconnected] = job.events(ev.AGENT_DISCONNECTED)
    assert disconnected.node == 1
    assert job.controller.recover(survivor(job, 0, 7, wait=0.0, reason="allreduce failed")).action \
        == PlanAction.WAIT
    job.advance(0.35)  # node 1 may still reconnect: no decision yet
    assert job.events(ev.DECISION) == []
    assert job.wait_for(lambda: bool(job.events(ev.DECISION)), timeout=0.5)
    [lost] = job.events(ev.AGENT_LOST)
    assert lost.node == 1 and "connection closed" in lost.details["why"]
    [decision] = job.events(ev.DECISION)
    assert (decision.details["strategy"], decision.details["lost_ranks"]) == ("recover", [2, 3])
    assert job.now() - lost.time + job.controller.machine.wall_offset < 0.1  # decided at once


def test_an_agent_that_polls_again_after_its_connection_closed_is_not_lost(make_job):
    job = recovering_job(make_job, monitor_interval=5.0)
    job.controller.agent_disconnected(1, 1001)
    job.advance(0.3)
    job.poll(1, 1, job.statuses(1, 1))  # its client reconnected
    job.keep_beating(2, 7, seconds=3.0, agents=[0])
    assert job.events(ev.AGENT_LOST) == [] and job.events(ev.DECISION) == []
    # A close seen from another process than the node's agent changes nothing.
    job.controller.agent_disconnected(1, 4242)
    job.keep_beating(2, 7, seconds=2.0, agents=[0])
    assert job.events(ev.AGENT_LOST) == []


def leave(job: Job, node: int, pid: int | None = None) -> bool:
    """Node ``node``'s agent got SIGTERM (a preempted or drained pod) and says it is leaving."""
    return job.controller.agent_leaving(AgentLeave(node, 1000 + node if pid is None else pid, f"host{node}",
                                                   "SIGTERM to its undying run"))


def test_a_node_that_announces_its_leave_is_dropped_at_once_by_elastic_training(make_job):
    """A planned leave, no spare: the chain treats it as a lost node and the job shrinks without
    waiting wait_reschedule_timeout for a node that said it is going."""
    job = recovering_job(make_job, recover_strategy=["recover-in-place", "recover", "elastic-training"])
    assert leave(job, 1)
    [lost] = job.events(ev.AGENT_LOST)
    assert lost.node == 1 and lost.details["planned"] and "SIGTERM" in lost.details["why"]
    assert job.wait_for(lambda: bool(job.events(ev.DECISION)))
    [decision] = job.events(ev.DECISION)
    assert (decision.details["strategy"], decision.details["lost_ranks"]) == ("recover", [2, 3])
    plans = check_in_together(job, [survivor(job, 0, 7), survivor(job, 1, 7)])
    [shrink] = job.events(ev.ELASTIC_SHRINK)
    assert shrink.details["waited"] < 0.5 and shrink.details["dropped_nodes"] == [1]
    assert {(plan.action, plan.strategy, tuple(plan.members)) for plan in plans.values()} == {
        (PlanAction.RESUME, "elastic-training", (0, 1))}
    assert job.events(ev.RESTART_BEGIN) == []
    [fault] = job.events(ev.FAULT_DETECTED)
    assert fault.details["description"] == "node 1 left the job (left the job: SIGTERM to its undying run)"
    # The recover that waited for the node handed the recovery to elastic training, which shrank it.
    [handover] = job.events(ev.RECOVERY_HANDOVER)
    assert (handover.details["from"], handover.details["to"]) == ("recover", "elastic-training")
    assert "[1]" in handover.details["why"]
    kinds = [e.kind for e in job.events() if e.kind in (ev.RECOVERY_HANDOVER, ev.ELASTIC_SHRINK, ev.RECOVERY_PLAN)]
    assert kinds == [ev.RECOVERY_HANDOVER, ev.ELASTIC_SHRINK, ev.RECOVERY_PLAN]


def test_a_node_that_announces_its_leave_is_replaced_by_a_spare(make_job):
    job = make_job(**{**RECOVERY, "recover_strategy": ["recover-in-place", "recover", "elastic-training"]})
    assert job.controller.hello(AgentHello(2, 1002, "spare", 2, standby=True)).accepted
    job.start_running()
    for rank in range(4):
        job.beat(rank, 7)
    assert leave(job, 1)
    adopt = job.next_order(2)
    assert (adopt.kind, adopt.node) == (OrderKind.ADOPT, 1)
    job.advance(1.0)  # the spare is on its way (it says hello as node 1): no shrink meanwhile
    assert job.events(ev.ELASTIC_SHRINK) == []
    assert [d.details["strategy"] for d in job.events(ev.DECISION)] == ["recover"]


def test_a_leave_from_a_process_that_does_not_hold_the_node_changes_nothing(make_job):
    job = recovering_job(make_job)
    assert not leave(job, 1, pid=4242)
    assert job.events(ev.AGENT_LOST) == [] and job.controller.state is JobState.RUNNING


def test_a_survivor_a_step_behind_receives_the_state_too(make_job):
    job = recovering_job(make_job)
    report_exit(job, 3)
    assert job.next_order(1, 1).kind == OrderKind.REPLACE

    plans = check_in_together(job, [survivor(job, 0, 6), survivor(job, 1, 7), survivor(job, 2, 7),
                                    newcomer(job, 3)])
    assert {(plan.action, plan.target_step, plan.source_rank, tuple(plan.receivers)) for plan in plans.values()} \
        == {(PlanAction.RESUME, 7, 1, (0, 3))}
    assert job.controller.state is JobState.RUNNING
    assert job.controller.generation == 2


def test_a_failed_step_with_every_process_alive_is_retried_without_receivers(make_job):
    job = recovering_job(make_job)
    requests = [survivor(job, rank, 7, reason="allreduce timed out") for rank in range(4)]
    plans = check_in_together(job, requests)

    for plan in plans.values():
        assert (plan.action, plan.strategy, plan.generation, plan.world_size) == (PlanAction.RESUME, "retry", 2, 4)
        assert (plan.target_step, plan.source_rank, plan.receivers) == (7, 0, [])
        assert plan.reason.endswith("could not complete its step (allreduce timed out)")
    assert job.controller.state is JobState.RUNNING
    assert job.controller.generation == 2
    [fault] = job.events(ev.FAULT_DETECTED)
    assert fault.details["reason"] == "step_failed"
    [begin] = job.events(ev.RECOVERY_BEGIN)
    assert begin.details["strategy"] == "retry"
    assert (begin.details["survivors"], begin.details["newcomers"]) == ([0, 1, 2, 3], [])
    # Nobody is restarted.
    assert job.events(ev.REPLACE) == []
    assert [job.poll(node, 1, job.statuses(node, 1), wait=0.2).kind for node in (0, 1)] == [OrderKind.NONE] * 2


def test_a_retry_whose_survivor_dies_before_it_checks_in_is_handed_over_to_recover_in_place(make_job):
    """The retry's executor hands the recovery over (logged), and recover-in-place's drives it to its plan."""
    job = recovering_job(make_job)
    check_in_together(job, [survivor(job, rank, 7, wait=0.0, reason="allreduce timed out") for rank in range(3)])
    assert job.wait_for(lambda: bool(job.events(ev.RECOVERY_BEGIN)))
    [begin] = job.events(ev.RECOVERY_BEGIN)
    assert begin.details["strategy"] == "retry" and begin.details["survivors"] == [0, 1, 2, 3]
    report_exit(job, 3)  # rank 3's process dies before it checked in
    replace = job.next_order(1, 1)
    assert (replace.kind, replace.generation, replace.ranks) == (OrderKind.REPLACE, 2, [3])
    [handover] = job.events(ev.RECOVERY_HANDOVER)
    assert (handover.generation, handover.details["from"], handover.details["to"]) == (2, "retry", "recover-in-place")
    assert "rank 3" in handover.details["why"]
    assert job.controller.status()["recovery"]["strategy"] == "recover-in-place"
    plans = check_in_together(job, [survivor(job, 0, 7), survivor(job, 1, 7), survivor(job, 2, 7), newcomer(job, 3)])
    assert {(plan.action, plan.strategy, tuple(plan.receivers)) for plan in plans.values()} == {
        (PlanAction.RESUME, "recover-in-place", (3,))}
    assert job.controller.state is JobState.RUNNING
    assert [e.details["strategy"] for e in job.events(ev.DECISION)] == ["retry"]  # one decision, handed over


def test_a_lost_node_is_recovered_once_it_says_hello_again(make_job):
    job = recovering_job(make_job)
    job.controller.report_agent_exit(1, -9)
    job.wait_state(JobState.RECOVERING)
    assert job.lost_nodes == [1]
    [decision] = job.events(ev.DECISION)
    assert decision.details["strategy"] == "recover"
    [begin] = job.events(ev.RECOVERY_BEGIN)
    assert begin.details == {"strategy": "recover", "old_generation": 1, "survivors": [0, 1],
                             "newcomers": [2, 3], "awaited_nodes": [1]}

    # The survivors check in, but nothing is replaced and no plan is made until the node is back.
    for rank in (0, 1):
        assert job.controller.recover(survivor(job, rank, 7, wait=0.0)).action == PlanAction.WAIT
    assert job.poll(0, 1, job.statuses(0, 1), wait=0.3).kind == OrderKind.NONE
    assert job.events(ev.REPLACE) == []
    assert job.controller.status()["recovery"]["awaited_nodes"] == [1]
    assert job.poll(1).reason == "hello"

    assert job.hello(1).accepted
    replace = job.next_order(1)
    assert (replace.kind, replace.generation, replace.ranks, replace.restart_count) == (OrderKind.REPLACE, 2, [2, 3], 1)
    plans = check_in_together(job, [survivor(job, 0, 7), survivor(job, 1, 7), newcomer(job, 2), newcomer(job, 3)])
    expected = Plan(action=PlanAction.RESUME, strategy="recover", generation=2, world_size=4, target_step=7,
                    source_rank=0, receivers=[2, 3], reason="node 1 lost (agent gone)", members=[0, 1, 2, 3],
                    store=f"127.0.0.1:{STORE_PORT}", holders=[0, 1])
    assert plans == {rank: expected for rank in range(4)}
    assert job.controller.state is JobState.RUNNING
    assert job.controller.generation == 2
    # Node 0 was never stopped.
    assert [order for order in (job.poll(0, 1, job.statuses(0, 1)),) if order.kind != OrderKind.NONE] == []


def test_a_dump_writes_the_dying_checkpoint_then_the_job_restarts(make_job):
    # Three single-rank nodes without pod rescheduling (so without recover): a lost node leaves a majority to dump.
    job = recovering_job(make_job, step=9, nnodes=3, nproc_per_node=1, pod_rescheduling="off",
                         recover_strategy=["retry", "recover-in-place", "dump"])
    job.controller.report_agent_exit(2, -9)
    job.wait_state(JobState.RECOVERING)
    [decision] = job.events(ev.DECISION)
    assert decision.details["strategy"] == "dump"
    [begin] = job.events(ev.DUMP_BEGIN)
    assert begin.details["survivors"] == [0, 1] and begin.details["newcomers"] == []
    assert job.events(ev.RECOVERY_BEGIN) == []

    plans = check_in_together(job, [survivor(job, 0, 9), survivor(job, 1, 9)])
    expected = Plan(action=PlanAction.DUMP, strategy="dump", generation=2, world_size=3, target_step=9, source_rank=0,
                    receivers=[], reason="node 2 lost (agent gone)", members=[0, 1, 2],
                    store=f"127.0.0.1:{STORE_PORT}", holders=[0, 1])
    assert plans == {0: expected, 1: expected}
    # The dump is not the end of the recovery: the job waits for the checkpoint.
    assert job.poll(0, 1, job.statuses(0, 1), wait=0.3).kind == OrderKind.NONE
    assert job.controller.state is JobState.RECOVERING

    job.controller.worker_event(Event(ev.DUMP_COMMITTED, node=0, rank=0, step=9, generation=2).__dict__)
    stops = [job.next_order(node, 1, job.statuses(node, 1)) for node in (0, 1)]
    assert [order.kind for order in stops] == [OrderKind.STOP, OrderKind.STOP]
    assert job.controller.state is JobState.STOPPING
    [restart] = job.events(ev.RESTART_BEGIN)
    assert restart.details["fault"] == "dying checkpoint of step 9 committed"
    [handover] = job.events(ev.RECOVERY_HANDOVER)  # the dump's executor gave the recovery to the job restart's
    assert (handover.details["from"], handover.details["to"]) == ("dump", "job-restart")

    # The job-level restart starts every rank afresh once the lost node is back.
    for node in (0, 1):
        job.poll(node, 1, job.statuses(node, 1, WorkerState.EXITED, -15, "SIGTERM"))
    assert job.hello(2).accepted
    starts = [job.next_order(node, 1, job.statuses(node, 1, WorkerState.EXITED, -15, "SIGTERM")) for node in (0, 1, 2)]
    assert [(order.kind, order.generation) for order in starts] == [(OrderKind.START, 3)] * 3


def test_a_dump_committed_outside_a_dump_changes_nothing(make_job):
    job = recovering_job(make_job)
    job.controller.worker_event(Event(ev.DUMP_COMMITTED, node=0, rank=0, step=7, generation=1).__dict__)
    assert job.poll(0, 1, job.statuses(0, 1), wait=0.3).kind == OrderKind.NONE
    assert job.controller.state is JobState.RUNNING
    assert job.events(ev.RESTART_BEGIN) == []


def test_a_survivor_that_dies_before_checking_in_is_replaced_too(make_job):
    job = recovering_job(make_job)
    report_exit(job, 3)
    assert job.next_order(1, 1).ranks == [3]
    report_exit(job, 2)
    second = job.next_order(1, 1)
    assert (second.kind, second.generation, second.ranks) == (OrderKind.REPLACE, 2, [2])

    plans = check_in_together(job, [survivor(job, 0, 7), survivor(job, 1, 7), newcomer(job, 2), newcomer(job, 3)])
    assert {(plan.action, plan.strategy, plan.source_rank, tuple(plan.receivers)) for plan in plans.values()} == {
        (PlanAction.RESUME, "recover-in-place", 0, (2, 3))}
    assert job.events(ev.RECOVERY_FAILED) == []
    assert job.controller.restart_count == 1


def test_a_second_exit_of_a_checked_in_rank_fails_the_recovery_and_restarts_the_job(make_job):
    job = recovering_job(make_job)
    report_exit(job, 3)
    assert job.next_order(1, 1).kind == OrderKind.REPLACE
    assert job.controller.recover(survivor(job, 0, 7, wait=0.0)).action == PlanAction.WAIT

    report_exit(job, 0)
    stops = [job.next_order(node, 1) for node in (0, 1)]
    assert [(order.kind, order.generation) for order in stops] == [(OrderKind.STOP, 2), (OrderKind.STOP, 2)]
    assert job.controller.state is JobState.STOPPING
    [failed] = job.events(ev.RECOVERY_FAILED)
    assert failed.details == {"strategy": "recover-in-place",
                              "why": "second fault during recover-in-place: rank 0 exited (killed by SIGKILL)"}
    decisions = job.events(ev.DECISION)
    assert [decision.details["strategy"] for decision in decisions] == ["recover-in-place", "job-restart"]
    # The fallback skips every process-level strategy: they already failed for this fault.
    assert "recover-in-place: already failed" in decisions[1].details["reason"]
    assert job.controller.faults_total["recovery_failed"] == 1
    # A rank still asking for a plan is told it has no part in what comes next.
    assert job.controller.recover(survivor(job, 1, 7, wait=0.0)).action == PlanAction.EXIT


def test_a_failed_recover_in_place_falls_through_to_recover_then_elastic_training(make_job):
    """Rank 2 hangs and recover-in-place is ordered from its node's agent, which then turns out to
    be gone too (a frozen host): the chain goes on in order with what is known now, recover for the
    lost node, then elastic training once it has not come back, never marking untried strategies
    failed and never restarting the job."""
    job = recovering_job(make_job, recover_strategy=["recover-in-place", "recover", "elastic-training"],
                         wait_reschedule_timeout=30)
    while not job.events(ev.DECISION):  # ranks 0, 1 and 3 beat, both agents poll; rank 2 is silent
        for rank in (0, 1, 3):
            job.beat(rank, 7)
        for node in (0, 1):
            job.poll(node, 1, job.statuses(node, 1))
        job.advance(0.5)
    [first] = job.events(ev.DECISION)
    assert (first.details["strategy"], first.details["lost_ranks"]) == ("recover-in-place", [2])
    job.controller.report_agent_exit(1, -9)
    job.wait_for(lambda: len(job.events(ev.DECISION)) == 2)
    [failed] = job.events(ev.RECOVERY_FAILED)
    assert failed.details["strategy"] == "recover-in-place"
    second = job.events(ev.DECISION)[1]
    assert (second.details["strategy"], second.details["lost_ranks"]) == ("recover", [2, 3])
    assert "recover-in-place: already failed" in second.details["reason"]
    assert "elastic-training: already failed" not in second.details["reason"]
    # Node 1 never comes back: after wait_reschedule_timeout the survivors train on without it.
    for rank in (0, 1):
        assert job.controller.recover(survivor(job, rank, 7, wait=0.0)).action == PlanAction.WAIT
    deadline = job.now() + job.spec.wait_reschedule_timeout + 5
    while not job.events(ev.ELASTIC_SHRINK) and job.now() < deadline:  # the survivors wait, alive
        for rank in (0, 1):
            job.beat(rank, 7, phase=Phase.RECOVERING)
        job.poll(0, 1, job.statuses(0, 1))
        job.advance(1.0)
    assert job.events(ev.ELASTIC_SHRINK), [e.kind for e in job.events()][-8:]
    plans = check_in_together(job, [survivor(job, 0, 7), survivor(job, 1, 7)])
    assert {(plan.action, plan.strategy, tuple(plan.members)) for plan in plans.values()} == {
        (PlanAction.RESUME, "elastic-training", (0, 1))}
    assert job.events(ev.RESTART_BEGIN) == []


def test_a_failed_recover_in_place_falls_through_to_the_dump_when_it_applies(make_job):
    """A survivor dies after checking in: recover-in-place cannot finish; with 4 of 6 ranks healthy
    the dying checkpoint is next in the chain, before any job restart."""
    job = recovering_job(make_job, nproc_per_node=3, recover_strategy=["recover-in-place", "dump"])
    report_exit(job, 5)
    assert job.next_order(1, 1).kind == OrderKind.REPLACE
    assert job.controller.recover(survivor(job, 0, 7, wait=0.0)).action == PlanAction.WAIT
    report_exit(job, 0)
    job.wait_for(lambda: len(job.events(ev.DECISION)) == 2)
    second = job.events(ev.DECISION)[1]
    assert (second.details["strategy"], second.details["lost_ranks"]) == ("dump", [0, 5])
    [dump] = job.events(ev.DUMP_BEGIN)
    assert dump.details["survivors"] == [1, 2, 3, 4]
    assert job.events(ev.RESTART_BEGIN) == []


def test_a_recovery_past_its_deadline_fails_and_the_job_restarts(make_job):
    # The deadline is start_timeout + comm_timeout after the fault; the lost node never returns.
    job = recovering_job(make_job, start_timeout=0.8, comm_timeout=0.2)
    job.controller.report_agent_exit(1, -9)
    job.wait_state(JobState.RECOVERING)
    for rank in (0, 1):
        assert job.controller.recover(survivor(job, rank, 7, wait=0.0)).action == PlanAction.WAIT

    stop = job.next_order(0, 1, job.statuses(0, 1))
    assert (stop.kind, stop.generation) == (OrderKind.STOP, 2)
    [failed] = job.events(ev.RECOVERY_FAILED)
    assert failed.details == {"strategy": "recover", "why": "recover timed out waiting for [2, 3]"}
    assert [decision.details["strategy"] for decision in job.events(ev.DECISION)] == ["recover", "job-restart"]
    assert job.controller.state is JobState.STOPPING
    assert job.events(ev.RECOVERY_PLAN) == []


# ---------------------------------------------------------------- the state table


def test_check_transition_allows_the_table_and_refuses_the_rest():
    check_transition(JobState.WAITING_FOR_NODES, JobState.RUNNING)
    check_transition(JobState.STOPPING, JobState.RESTARTING)
    with pytest.raises(IllegalTransition, match="succeeded -> running"):
        check_transition(JobState.SUCCEEDED, JobState.RUNNING)
    with pytest.raises(IllegalTransition, match="waiting_for_nodes -> stopping"):
        check_transition(JobState.WAITING_FOR_NODES, JobState.STOPPING)


def test_terminal_states_have_no_way_out():
    for state in JobState:
        assert state.terminal == (ALLOWED_TRANSITIONS[state] == frozenset())


def test_a_spare_agent_holds_no_ranks_and_takes_a_lost_nodes_place(make_job):
    job = make_job(**RECOVERY)
    refused = job.controller.hello(AgentHello(1, 999, "spare", 2, standby=True))
    assert not refused.accepted and "needs a node id >= nnodes (2), got 1" in refused.reason
    assert job.controller.hello(AgentHello(2, 1002, "spare", 2, standby=True)).accepted
    job.start_running()  # nodes 0 and 1 start; the spare gets no start order
    assert job.poll(2, wait=0.2).kind == OrderKind.NONE
    assert job.controller.status()["nodes"]["2"]["standby"] is True
    for rank in range(4):
        job.beat(rank, 7)

    job.controller.report_agent_exit(1, -9)
    adopt = job.next_order(2)
    assert (adopt.kind, adopt.node) == (OrderKind.ADOPT, 1)
    [event] = job.events(ev.STANDBY_ADOPT)
    assert event.node == 1 and event.details["spare"] == 2
    assert job.controller.agent_id_of(1) == 2
    # The spare says hello as node 1 and is ordered to start node 1's ranks as replacements.
    assert job.hello(1).accepted
    replace = job.next_order(1)
    assert (replace.kind, replace.ranks) == (OrderKind.REPLACE, [2, 3])
    assert "2" not in job.controller.status()["nodes"]
    # Node 1's own agent comes back (a frozen node woke up, a partition healed): the spare keeps
    # serving node 1, and the returning agent joins as a new spare instead of evicting it.
    returned = job.controller.hello(AgentHello(1, 5555, "host1", 2))
    assert returned.accepted and returned.node == 3
    nodes = job.controller.status()["nodes"]
    assert nodes["1"]["pid"] == 1001 and nodes["1"]["alive"] and not nodes["1"]["standby"]
    assert nodes["3"]["standby"] and nodes["3"]["pid"] == 5555
    assert job.controller.reserve_spare_id() == 4


def test_a_lost_node_gets_one_spare_even_while_the_spare_is_on_its_way(make_job):
    """Between the spare taking its order and its hello as the node, ticks pass: no second spare is
    sent for the same node (the chaos soak saw two, the second becoming a spare again at once)."""
    job = make_job(**RECOVERY)
    for spare in (2, 3):
        assert job.controller.hello(AgentHello(spare, 1000 + spare, f"spare{spare}", 2, standby=True)).accepted
    job.start_running()
    for rank in range(4):
        job.beat(rank, 7)
    job.controller.report_agent_exit(1, -9)
    assert job.next_order(2).kind == OrderKind.ADOPT
    orders = set()
    for _ in range(10):  # a second passes; the spare has not said hello as node 1 yet
        job.poll(0, 1, job.statuses(0, 1), wait=0.05)
        orders.add(job.poll(3, wait=0.05).kind)
        job.advance(0.1)
    assert OrderKind.ADOPT not in orders
    assert [event.details["spare"] for event in job.events(ev.STANDBY_ADOPT)] == [2]
    assert job.controller.hello(AgentHello(1, 1002, "spare2", 2)).accepted
    assert "2" not in job.controller.status()["nodes"] and job.controller.status()["nodes"]["3"]["standby"]


def test_a_spare_whose_id_a_connected_agent_holds_joins_under_a_new_one(make_job):
    """Two live spares with one id (the id given to a returning node's agent, then a new spare pod
    started with it): the second gets a new id instead of the two evicting each other at every hello
    (seen in the chaos soak: ``agent said hello again`` without end). A spare whose agent restarted,
    its old connection closed, takes its id back."""
    job = make_job(**RECOVERY)
    assert job.controller.hello(AgentHello(2, 1002, "spare", 2, standby=True)).accepted
    job.start_running()
    second = job.controller.hello(AgentHello(2, 2002, "spare-b", 2, standby=True))
    assert second.accepted and second.node == 3
    nodes = job.controller.status()["nodes"]
    assert nodes["2"]["pid"] == 1002 and nodes["2"]["alive"] and nodes["3"]["pid"] == 2002
    assert not job.events(ev.AGENT_LOST)
    job.controller.agent_disconnected(3, 2002)  # its agent died; a new one comes with its id
    again = job.controller.hello(AgentHello(3, 3003, "spare-b", 2, standby=True))
    assert again.accepted and again.node == -1  # -1: keep the id it asked for
    assert job.controller.status()["nodes"]["3"]["pid"] == 3003


def test_losing_an_idle_spare_is_not_a_fault(make_job):
    job = make_job(**RECOVERY)
    assert job.controller.hello(AgentHello(2, 1002, "spare", 2, standby=True)).accepted
    job.start_running()
    job.controller.report_agent_exit(2, -9)
    assert job.wait_for(lambda: bool(job.events(ev.AGENT_LOST)))
    job.advance(0.3)
    assert job.events(ev.FAULT_DETECTED) == []
    assert job.controller.state is JobState.RUNNING


def test_a_frozen_host_is_lost_a_heartbeat_interval_after_its_last_beat_not_restarted_in_place(make_job):
    """Node 1 frozen (SIGSTOP of its agent and workers): its ranks miss their heartbeats while its
    agent, which beats every 0.25 s whatever its poll does, is silent too. A hung rank would be
    restarted in place by its agent, but this agent will not: the node is lost one agent beat and a
    slack after their last beats (not at the heartbeat timeout, 3 s, nor at the agent's poll limit)
    and recovered (recover), not first given a hopeless recover-in-place."""
    job = recovering_job(make_job, heartbeat_interval=0.5, heartbeat_timeout=3.0)
    assert job.spec.agent_beat_interval() == pytest.approx(0.25)
    assert job.spec.host_silence_limit() == pytest.approx(0.85)
    frozen_at = job.now()
    lost_after = freeze_node1_until_decided(job)
    [lost] = job.events(ev.AGENT_LOST)
    assert lost.node == 1 and "frozen or cut off" in lost.details["why"], lost.details
    assert "neither its agent nor its ranks" in lost.details["why"], lost.details
    [decision] = job.events(ev.DECISION)
    assert (decision.details["strategy"], decision.details["lost_ranks"]) == ("recover", [2, 3])
    assert 0.85 <= job.now() - frozen_at < 1.35
    assert lost_after is not None and 0.85 <= lost_after < 1.35


def test_host_silence_timeout_sets_how_long_a_silent_host_is_waited_for(make_job):
    """The spec's ``host_silence_timeout`` replaces the default limit (an agent beat + the slack):
    a host silent 1.2 s is not lost under a 1.5 s limit, and is lost once the 1.5 s have passed."""
    job = recovering_job(make_job, heartbeat_interval=0.5, heartbeat_timeout=3.0, host_silence_timeout=1.5)
    assert job.spec.host_silence_limit() == pytest.approx(1.5)
    lost_after = freeze_node1_until_decided(job)
    [lost] = job.events(ev.AGENT_LOST)
    assert lost.node == 1 and "limit 1.50 s" in lost.details["why"], lost.details
    assert lost_after is not None and 1.5 <= lost_after < 2.0


def test_a_host_whose_ranks_are_still_starting_is_not_taken_for_frozen(make_job):
    """A host's workers starting (imports, process group, restore) are its CPU's busiest time: its
    agent may wait a second for a core (seen: 1.26 s with two workers importing torch beside it on
    two cores). A node whose ranks have only said ``starting`` is left to the longer limits; once
    one of them beats from its first step, the same silence is a frozen host again."""
    job = make_job(**{**RECOVERY, "heartbeat_interval": 0.5, "heartbeat_timeout": 3.0})
    job.start_running()
    for rank in (2, 3):
        job.beat(rank, 0, phase=Phase.STARTING)
    assert freeze_node1_until_decided(job, limit=2.0) is None
    assert job.events(ev.AGENT_LOST) == [] and job.events(ev.DECISION) == []
    for rank in (2, 3):
        job.beat(rank, 1)
    lost_after = freeze_node1_until_decided(job)
    [lost] = job.events(ev.AGENT_LOST)
    assert lost.node == 1 and "neither its agent nor its ranks" in lost.details["why"], lost.details
    assert lost_after is not None and 0.85 <= lost_after < 1.35


def freeze_node1_until_decided(job: Job, limit: float = 6.0) -> float | None:
    """Node 1 silent (agent and ranks), node 0's ranks and agent heard, until the controller decides
    (or ``limit`` seconds): how long after the freeze node 1 was lost (None: not lost)."""
    frozen_at = job.now()
    lost_after = None
    while not job.events(ev.DECISION) and job.now() - frozen_at < limit:
        for rank in (0, 1):
            job.beat(rank, 7)
        job.poll(0, 1, job.statuses(0, 1), wait=0.05)
        if lost_after is None and job.events(ev.AGENT_LOST):
            lost_after = job.now() - frozen_at
    return lost_after


def test_a_host_is_not_taken_for_frozen_while_its_agent_beats_or_when_no_node_is_heard(make_job):
    """Its ranks silent but its agent beating: a hang of those ranks (the heartbeat timeout's, or
    its agent's report of stopped processes), not a frozen host. Every node silent at once: the
    controller's own link or pause, so nobody is lost before the longer limits."""
    job = recovering_job(make_job, heartbeat_interval=0.5, heartbeat_timeout=30.0)
    started = job.now()
    while job.now() - started < 2.5:
        job.beat(0, 7)
        job.controller.report(AgentPoll(1, 1, []))  # node 1's agent beats; ranks 2 and 3 are silent
        job.poll(0, 1, job.statuses(0, 1), wait=0.05)
    assert job.events(ev.AGENT_LOST) == [] and job.events(ev.DECISION) == []
    job.advance(2.0)  # nobody is heard from: no host is singled out
    assert job.events(ev.AGENT_LOST) == [] and job.events(ev.DECISION) == []
    # The controller itself did not run for 2 s (no tick): silences count again from its return,
    # so node 0's first request after it does not make node 1's old silence a frozen host.
    job.controller.clock += 2.0
    for _ in range(10):
        job.beat(0, 7)
        job.advance(0.1)
        job.controller.report(AgentPoll(1, 1, []))  # queued behind node 0's while the controller was away
    assert job.events(ev.AGENT_LOST) == [] and job.events(ev.DECISION) == []


def test_a_hung_rank_on_a_host_whose_agent_polls_is_restarted_in_place(make_job):
    """The same silence of one rank with its agent polling: a hang, recovered in place."""
    job = recovering_job(make_job, heartbeat_timeout=3.0)
    started = job.now()
    while not job.events(ev.DECISION) and job.now() - started < 6.0:
        for rank in (0, 1, 3):
            job.beat(rank, 7)
        job.poll(0, 1, job.statuses(0, 1), wait=0.02)
        job.poll(1, 1, job.statuses(1, 1), wait=0.02)
    assert job.events(ev.AGENT_LOST) == []
    [decision] = job.events(ev.DECISION)
    assert (decision.details["strategy"], decision.details["lost_ranks"]) == ("recover-in-place", [2])


def test_with_fault_scheduling_off_the_job_ends_after_its_dying_checkpoint(make_job):
    """fault_scheduling: off: the dump is written, then the job ends failed (not restarted); its next
    run resumes from the dump."""
    job = recovering_job(make_job, step=9, nnodes=3, nproc_per_node=1, pod_rescheduling="off",
                         fault_scheduling="off", recover_strategy=["retry", "recover-in-place", "dump"])
    job.controller.report_agent_exit(2, -9)
    job.wait_state(JobState.RECOVERING)
    [decision] = job.events(ev.DECISION)
    assert decision.details["strategy"] == "dump"
    check_in_together(job, [survivor(job, 0, 9), survivor(job, 1, 9)])
    job.controller.worker_event(Event(ev.DUMP_COMMITTED, node=0, rank=0, step=9, generation=2).__dict__)
    job.wait_state(JobState.FAILED)
    assert job.events(ev.RESTART_BEGIN) == []
    [end] = job.events(ev.JOB_END)
    assert "fault_scheduling is off" in json.dumps(end.details), end.details


# ---------------------------------------------------------------- stopped workers (a hang its agent sees)


def report_state(job: Job, rank: int, state: str, generation: int = 1) -> None:
    """The agent's immediate report that ``rank``'s process is stopped (SIGSTOP) or running again."""
    status = WorkerStatus(rank, rank % job.spec.nproc_per_node, 2000 + rank, generation, state)
    job.controller.report(AgentPoll(rank // job.spec.nproc_per_node, generation, [status.to_dict()]))


def test_a_worker_its_agent_sees_stopped_is_restarted_in_place_without_waiting_out_its_heartbeats(make_job):
    """A stopped process will not beat again: its agent's report is the hang, acted on at once."""
    job = recovering_job(make_job, heartbeat_timeout=30.0)
    reported_at = job.now()
    report_state(job, 2, WorkerState.STOPPED)
    assert job.wait_for(lambda: bool(job.events(ev.DECISION)), timeout=1.0)
    assert job.now() - reported_at < job.spec.heartbeat_timeout
    [fault] = job.events(ev.FAULT_DETECTED)
    assert (fault.details["reason"], fault.rank) == ("heartbeat_missed", 2)
    assert "stopped" in fault.details["detail"]
    [decision] = job.events(ev.DECISION)
    assert (decision.details["strategy"], decision.details["lost_ranks"]) == ("recover-in-place", [2])


def test_a_stopped_worker_is_only_reported_with_watchdog_detect_only(make_job):
    job = recovering_job(make_job, heartbeat_timeout=30.0, watchdog="detect-only")
    report_state(job, 2, WorkerState.STOPPED)
    job.advance(0.5)
    assert job.events(ev.FAULT_DETECTED) == []
    [suspected] = job.events(ev.HANG_SUSPECTED)
    assert suspected.rank == 2
    assert job.controller.state is JobState.RUNNING


def test_a_continued_worker_or_a_stopped_older_process_is_no_fault(make_job):
    job = recovering_job(make_job, heartbeat_timeout=30.0)
    report_state(job, 2, WorkerState.STOPPED)
    report_state(job, 2, WorkerState.RUNNING)  # SIGCONT before the controller's next tick
    report_state(job, 3, WorkerState.STOPPED, generation=0)  # not the process that serves rank 3 now
    job.advance(0.5)
    assert job.events(ev.FAULT_DETECTED) == []
    assert job.controller.state is JobState.RUNNING


def test_a_job_restart_waits_until_a_stopped_worker_is_gone(make_job):
    """A stopped process is alive: the restart must not start the next generation beside it."""
    job = make_job(nnodes=2, nproc_per_node=1, heartbeat_timeout=30.0)
    job.start_running()
    report_state(job, 1, WorkerState.STOPPED)
    assert job.next_order(0, 1, job.statuses(0, 1)).kind == OrderKind.STOP
    job.poll(0, 1, job.statuses(0, 1, WorkerState.EXITED, -9, "SIGKILL"))
    job.advance(0.5)
    assert job.controller.state is JobState.STOPPING
    job.poll(1, 1, job.statuses(1, 1, WorkerState.EXITED, -9, "SIGKILL"))
    job.wait_state(JobState.RESTARTING)


def test_a_beat_from_a_process_not_restored_yet_never_takes_the_committed_step_back(make_job):
    """A newcomer beats step 0 while it starts and recovers: the job's committed step (what /status
    and /metrics show, and a lost node's fault step) stays the survivors'."""
    job = make_job(nnodes=2, nproc_per_node=2)
    job.start_running()
    for rank in range(4):
        job.controller.heartbeat(Heartbeat(rank, rank // 2, 1, 7, Phase.COMPUTING, 2000 + rank))
    for phase in (Phase.STARTING, Phase.RECOVERING):
        job.controller.heartbeat(Heartbeat(1, 0, 1, 0, phase, 2001))
        assert job.controller.machine.membership.committed_step() == 7
    job.controller.heartbeat(Heartbeat(1, 0, 1, 8, Phase.RECOVERING, 2001))  # a survivor a step ahead
    assert job.controller.machine.membership.ranks[1].step == 8
