"""The controller's recovery state machine, driven in-process: the test plays every agent and worker.

``Controller.run`` runs in a thread; agents are calls to ``hello``/``poll`` and workers are
calls to ``heartbeat``/``worker_event``. No processes, no sockets.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from undying import events as ev
from undying.config import JobSpec
from undying.controller import core
from undying.controller.core import Controller
from undying.controller.state import ALLOWED_TRANSITIONS, IllegalTransition, JobState, check_transition
from undying.events import Event, EventLog, read_events
from undying.protocol import (
    ORDER_EXIT,
    ORDER_NONE,
    ORDER_START,
    ORDER_STOP,
    PHASE_COMPUTING,
    PHASE_DONE,
    WORKER_EXITED,
    WORKER_RUNNING,
    AgentHello,
    AgentPoll,
    Heartbeat,
    HelloReply,
    InjectionClaim,
    Order,
    WorkerStatus,
)

JOB_ID = "job-test"
STORE_PORT = 29555
# How long a test waits for the controller's loop to act (it ticks every 0.1 s).
WAIT = 3.0
# Timeouts small enough for unit tests; wait_reschedule_timeout keeps its default (30..270).
FAST = {
    "heartbeat_interval": 0.05,
    "heartbeat_timeout": 0.4,
    "monitor_interval": 0.05,
    "node_return_timeout": 5.0,
}


class Job:
    """One Controller with ``run()`` in a background thread; the methods play agents and workers."""

    def __init__(self, run_dir: Path, **spec_fields: Any) -> None:
        self.spec = JobSpec(**{**FAST, **spec_fields})
        self.run_dir = run_dir
        self.events_log = EventLog(run_dir)
        self.lost_nodes: list[int] = []
        self.controller = Controller(self.spec, self.events_log, JOB_ID, STORE_PORT,
                                     on_node_lost=self.lost_nodes.append)
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name="controller-run", daemon=True)

    def _run(self) -> None:
        self.exit_code = self.controller.run()

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------ the agents

    def ranks_of(self, node: int) -> list[int]:
        per_node = self.spec.nproc_per_node
        return list(range(node * per_node, (node + 1) * per_node))

    def hello(self, node: int, nproc: int | None = None) -> HelloReply:
        nproc = self.spec.nproc_per_node if nproc is None else nproc
        return self.controller.hello(AgentHello(node, 1000 + node, f"host{node}", nproc))

    def statuses(self, node: int, generation: int, state: str = WORKER_RUNNING,
                 exitcode: int | None = None, signal: str | None = None) -> list[dict[str, Any]]:
        """What node's agent reports of its workers, all in one state."""
        return [
            WorkerStatus(rank, local, 2000 + rank, generation, state, exitcode, signal).to_dict()
            for local, rank in enumerate(self.ranks_of(node))
        ]

    def poll(self, node: int, generation: int = 0, workers: list[dict[str, Any]] | None = None,
             wait: float = 0.0) -> Order:
        return self.controller.poll(AgentPoll(node, generation, workers or [], wait))

    def next_order(self, node: int, generation: int = 0, workers: list[dict[str, Any]] | None = None,
                   timeout: float = WAIT) -> Order:
        """Poll like an agent until an order other than 'none' comes, or ``timeout`` passes."""
        deadline = time.time() + timeout
        while True:
            order = self.poll(node, generation, workers, wait=0.1)
            if order.kind != ORDER_NONE or time.time() > deadline:
                return order

    def start_running(self) -> list[Order]:
        """Every node says hello, the loop starts, and each agent takes its generation-1 start order."""
        for node in range(self.spec.nnodes):
            assert self.hello(node).accepted
        self.start()
        orders = [self.next_order(node) for node in range(self.spec.nnodes)]
        assert [order.kind for order in orders] == [ORDER_START] * self.spec.nnodes
        for node in range(self.spec.nnodes):
            self.poll(node, 1, self.statuses(node, 1))
        assert self.controller.state is JobState.RUNNING
        return orders

    # ------------------------------------------------------------ the workers

    def beat(self, rank: int, step: int, phase: str = PHASE_COMPUTING, generation: int = 1) -> None:
        node = rank // self.spec.nproc_per_node
        self.controller.heartbeat(Heartbeat(rank, node, generation, step, phase, 2000 + rank))

    # ------------------------------------------------------------ observing

    def wait_for(self, predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
        deadline = time.time() + timeout
        while not predicate():
            if time.time() > deadline:
                return False
            time.sleep(0.01)
        return True

    def wait_state(self, state: JobState, timeout: float = WAIT) -> None:
        reached = self.wait_for(lambda: self.controller.state is state, timeout)
        assert reached, f"state {self.controller.state.value}, expected {state.value}"

    def events(self, kind: str | None = None) -> list[Event]:
        return [event for event in read_events(self.run_dir) if kind is None or event.kind == kind]

    def join(self, timeout: float = WAIT) -> int | None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "Controller.run() did not return"
        return self.exit_code

    def close(self) -> None:
        if self._thread.is_alive():
            self.controller.cancel("test teardown")
            for node in list(self.controller.nodes):
                self.poll(node)
            self._thread.join(WAIT)
        self.events_log.close()


@pytest.fixture
def make_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # A test that forgets an agent still ends quickly.
    monkeypatch.setattr(core, "EXIT_GRACE", 1.0)
    jobs: list[Job] = []

    def make(**spec_fields: Any) -> Job:
        job = Job(tmp_path / f"run{len(jobs)}", **spec_fields)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()


# ---------------------------------------------------------------- start


def test_waits_for_every_node_then_orders_generation_one(make_job):
    job = make_job(nnodes=2, nproc_per_node=2)
    job.start()
    assert job.hello(0).accepted
    assert job.poll(0, wait=0.3).kind == ORDER_NONE
    assert job.controller.state is JobState.WAITING_FOR_NODES
    assert job.controller.generation == 0

    reply = job.hello(1)
    assert (reply.accepted, reply.job_id, reply.store_port) == (True, JOB_ID, STORE_PORT)
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        order = job.next_order(node)
        assert order.kind == ORDER_START
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


def test_a_node_that_never_says_hello_fails_the_start(make_job):
    job = make_job(nnodes=2, node_return_timeout=0.3)
    job.hello(0)
    job.start()
    order = job.next_order(0)
    assert order.kind == ORDER_EXIT
    assert job.join() == 1
    assert job.controller.state is JobState.FAILED
    assert "[1]" in job.controller.message
    assert "node_return_timeout" in job.controller.message and "at start" in job.controller.message


def test_a_poll_from_an_unknown_node_asks_for_hello(make_job):
    job = make_job()
    order = job.poll(0)
    assert (order.kind, order.reason) == (ORDER_NONE, "hello")


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
    node1[1] = WorkerStatus(3, 1, 2003, 1, WORKER_EXITED, exitcode, signal).to_dict()

    stop = job.next_order(1, 1, node1)
    assert (stop.kind, stop.generation, stop.reason) == (ORDER_STOP, 1, described)
    stop = job.next_order(0, 1, job.statuses(0, 1))
    assert (stop.kind, stop.generation) == (ORDER_STOP, 1)
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
    assert job.poll(0, 1, job.statuses(0, 1), wait=0.3).kind == ORDER_NONE
    assert job.controller.state is JobState.STOPPING
    job.poll(1, 1, job.statuses(1, 1, WORKER_EXITED, -15, "SIGTERM"))
    starts = [job.next_order(node, 1, job.statuses(node, 1, WORKER_EXITED, -15, "SIGTERM"))
              for node in (0, 1)]
    assert [(o.kind, o.generation, o.ranks, o.restart_count) for o in starts] == [
        (ORDER_START, 2, [0, 1], 1), (ORDER_START, 2, [2, 3], 1)]
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
    job.poll(0, 1, job.statuses(0, 1, WORKER_EXITED, 1))

    exits = [job.next_order(node, 1) for node in (0, 1)]
    assert [order.kind for order in exits] == [ORDER_EXIT, ORDER_EXIT]
    assert job.join() == 1
    assert job.controller.state is JobState.FAILED
    assert job.controller.exit_code == 1
    assert "max_restarts" in job.controller.message
    assert exits[0].reason == job.controller.message
    [decision] = job.events(ev.DECISION)
    assert decision.details["strategy"] == "exit"
    assert "max_restarts (0)" in decision.details["reason"]
    [end] = job.events(ev.JOB_END)
    assert (end.details["outcome"], end.details["exit_code"], end.details["restarts"]) == ("failed", 1, 0)
    assert job.events(ev.RESTART_BEGIN) == []


def test_restarts_stop_once_max_restarts_are_used(make_job):
    job = make_job(nproc_per_node=1, max_restarts=1)
    job.start_running()
    job.poll(0, 1, job.statuses(0, 1, WORKER_EXITED, 1))
    assert job.next_order(0, 1).kind == ORDER_STOP
    start = job.next_order(0, 1, job.statuses(0, 1, WORKER_EXITED, 1))
    assert (start.kind, start.generation) == (ORDER_START, 2)
    job.poll(0, 2, job.statuses(0, 2, WORKER_EXITED, 1))
    assert job.next_order(0, 2).kind == ORDER_EXIT
    assert job.join() == 1
    assert "max_restarts (1)" in job.controller.message


def test_every_rank_exiting_zero_succeeds(make_job):
    job = make_job(nnodes=2, nproc_per_node=2)
    job.start_running()
    for rank in range(4):
        job.beat(rank, step=5, phase=PHASE_DONE)
    # One node finishing is not the job finishing.
    assert job.poll(0, 1, job.statuses(0, 1, WORKER_EXITED, 0), wait=0.3).kind == ORDER_NONE
    assert job.controller.state is JobState.RUNNING

    job.poll(1, 1, job.statuses(1, 1, WORKER_EXITED, 0))
    exits = [job.next_order(node, 1) for node in (0, 1)]
    assert [order.kind for order in exits] == [ORDER_EXIT, ORDER_EXIT]
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
    until = time.time() + 0.75
    step = 0
    while time.time() < until:
        step += 1
        job.beat(0, step)
        job.poll(0, 1, job.statuses(0, 1), wait=0.05)
    assert job.controller.state is JobState.RUNNING
    assert job.events(ev.FAULT_DETECTED) == []

    stop = job.next_order(0, 1, job.statuses(0, 1))
    assert stop.kind == ORDER_STOP
    [fault] = job.events(ev.FAULT_DETECTED)
    assert fault.details["reason"] == "heartbeat_missed"
    assert (fault.node, fault.rank) == (0, 0)
    assert "missed its heartbeats" in fault.details["description"]
    assert job.controller.faults_total == {"heartbeat_missed": 1}


def test_a_rank_that_never_heartbeats_is_a_start_timeout_fault(make_job):
    job = make_job(nproc_per_node=1, start_timeout=0.3)
    job.start_running()
    assert job.next_order(0, 1, job.statuses(0, 1)).kind == ORDER_STOP
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
    assert (job.poll(1).kind, job.poll(1).reason) == (ORDER_NONE, "hello")

    assert job.next_order(0, 1, job.statuses(0, 1)).kind == ORDER_STOP
    [fault] = job.events(ev.FAULT_DETECTED)
    assert (fault.details["reason"], fault.node) == ("agent_lost", 1)
    assert fault.details["description"] == "node 1 lost (agent gone)"

    stopped = job.statuses(0, 1, WORKER_EXITED, -15, "SIGTERM")
    job.poll(0, 1, stopped)
    job.wait_state(JobState.RESTARTING)
    assert job.poll(0, 1, stopped, wait=0.3).kind == ORDER_NONE
    assert job.controller.generation == 1

    assert job.hello(1).accepted
    start0 = job.next_order(0, 1, stopped)
    start1 = job.next_order(1)
    assert (start0.kind, start0.generation, start0.ranks) == (ORDER_START, 2, [0, 1])
    assert (start1.kind, start1.generation, start1.ranks) == (ORDER_START, 2, [2, 3])
    assert [event.node for event in job.events(ev.AGENT_REGISTERED)] == [0, 1, 1]


def test_agent_exit_after_its_exit_order_is_not_a_loss(make_job):
    job = make_job(nnodes=2, nproc_per_node=1)
    job.start_running()
    job.controller.cancel("done with it")
    assert job.next_order(1, 1).kind == ORDER_EXIT
    job.controller.report_agent_exit(1, 0)
    assert job.events(ev.AGENT_LOST) == []
    assert job.lost_nodes == []


def test_a_node_that_never_returns_fails_the_job(make_job):
    job = make_job(nnodes=2, nproc_per_node=1, node_return_timeout=0.5)
    job.start_running()
    job.controller.report_agent_exit(1, None)
    assert job.next_order(0, 1, job.statuses(0, 1)).kind == ORDER_STOP
    order = job.next_order(0, 1, job.statuses(0, 1, WORKER_EXITED, -15, "SIGTERM"))
    assert order.kind == ORDER_EXIT
    assert job.join() == 1
    assert job.controller.state is JobState.FAILED
    message = job.controller.message
    assert "[1]" in message and "node_return_timeout (0.5 s)" in message and "at restart" in message


def test_hello_again_from_a_live_node_is_a_loss_and_a_restart(make_job):
    job = make_job(nnodes=2, nproc_per_node=1)
    job.start_running()
    assert job.hello(1).accepted
    assert job.next_order(0, 1, job.statuses(0, 1)).kind == ORDER_STOP
    [lost] = job.events(ev.AGENT_LOST)
    assert lost.node == 1
    assert job.lost_nodes == []  # the agent is already back: nothing to respawn


# ---------------------------------------------------------------- cancel, injections, status


def test_cancel_ends_the_job_with_130_and_orders_agents_to_exit(make_job):
    job = make_job(nnodes=2, nproc_per_node=1)
    job.start_running()
    job.controller.cancel("interrupted by the user")
    orders = [job.next_order(node, 1) for node in (0, 1)]
    assert [(o.kind, o.reason) for o in orders] == [(ORDER_EXIT, "interrupted by the user")] * 2
    assert job.join() == 130
    assert job.controller.state is JobState.CANCELLED
    job.controller.cancel("again")
    assert (job.controller.exit_code, job.controller.message) == (130, "interrupted by the user")
    [end] = job.events(ev.JOB_END)
    assert (end.details["outcome"], end.details["exit_code"]) == ("cancelled", 130)


def test_an_injection_is_granted_once_and_only_in_the_current_generation(make_job):
    job = make_job(nproc_per_node=2)
    job.start_running()
    claim = job.controller.claim_injection
    assert claim(InjectionClaim(index=0, rank=0, node=0, generation=1, step=3))
    assert not claim(InjectionClaim(index=0, rank=1, node=0, generation=1, step=3))
    assert not claim(InjectionClaim(index=0, rank=0, node=0, generation=1, step=4))
    assert not claim(InjectionClaim(index=1, rank=0, node=0, generation=0, step=3))
    assert claim(InjectionClaim(index=1, rank=0, node=0, generation=1, step=3))
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
    assert (rank["node"], rank["step"], rank["phase"], rank["pid"]) == (0, 12, PHASE_COMPUTING, 2001)
    assert (rank["done"], rank["exitcode"]) == (False, None)
    assert rank["seconds_since_heartbeat"] >= 0
    assert status["ranks"]["3"]["seconds_since_heartbeat"] is None

    job.beat(3, 11)
    assert job.controller.status()["committed_step"] == 9


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
