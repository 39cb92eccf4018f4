"""Controller failover pieces: the etcd election (real etcd on loopback) and a controller that
resumes a job from another controller's saved state (in-process, the test plays agents/workers)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.conftest import EtcdServer
from tests.unit.job_harness import WAIT, Job, ShellJob
from undying import events as ev
from undying.controller.core import Controller, NotInCharge
from undying.controller.ha import Candidate
from undying.controller.state import JobState
from undying.etcd import EtcdClient
from undying.events import read_events
from undying.inject import encode, parse_injections
from undying.locate import locate_controller
from undying.protocol import AgentPoll, InjectionClaim, OrderKind, PlanAction, RecoverRequest

RECOVERABLE = {"nnodes": 2, "nproc_per_node": 2, "process_recover": True, "recover_strategy": ["recover-in-place", "recover"],
               "pod_rescheduling": "on"}


def successor(run_dir: Path, saved: dict, **spec_fields: object) -> Job:
    """A second controller (as on another node) that takes over from ``saved``."""
    job = Job(run_dir, **{**RECOVERABLE, **spec_fields})
    job.controller.resume(saved, why="test")
    return job


def kinds(run_dir: Path, kind: str) -> list[ev.Event]:
    return [event for event in read_events(run_dir) if event.kind == kind]


def test_a_resumed_controller_keeps_the_generation_running_and_loses_the_silent_node(tmp_path: Path) -> None:
    first = Job(tmp_path / "a", **RECOVERABLE)
    first.start_running()
    for rank in range(4):
        first.beat(rank, 7)
    saved = first.controller.export_state()
    assert (saved["state"], saved["generation"], saved["members"]) == ("running", 1, [0, 1, 2, 3])

    job = successor(tmp_path / "b", saved)
    job.start()
    assert job.controller.generation == 1 and job.controller.state is JobState.RUNNING
    # Rank 2 saw its all-reduce fail (rank 0 went with the old controller's node) and checks in at
    # once; node 1's agent polls. Node 0 stays silent: it died with the old leader.
    deadline = time.time() + WAIT + 3
    while not kinds(tmp_path / "b", ev.DECISION) and time.time() < deadline:
        job.controller.recover(RecoverRequest(2, 1, 1, 7, 2002, "allreduce failed", wait=0.0))
        order = job.poll(1, 1, job.statuses(1, 1), wait=0.05)
        assert order.kind == OrderKind.NONE, order  # node 1's workers keep running
        job.beat(3, 7)
    lost = kinds(tmp_path / "b", ev.AGENT_LOST)
    assert [event.node for event in lost] == [0]
    assert "since the controller failed over" in lost[0].details["why"]
    decision = kinds(tmp_path / "b", ev.DECISION)[0]
    # Decided on the real fault (the node), not on rank 2's failed step seen first.
    assert decision.details["strategy"] == "recover" and decision.details["lost_ranks"] == [0, 1]
    # The fault is placed at the step the live ranks reported, not at the dead ranks' unknown one.
    assert kinds(tmp_path / "b", ev.FAULT_DETECTED)[0].step == 7
    assert kinds(tmp_path / "b", ev.CONTROLLER_TAKEOVER)[0].details["previous_state"] == "running"


def test_a_node_whose_process_holds_no_lease_at_the_takeover_is_lost_without_waiting(tmp_path: Path) -> None:
    """The successor reads which ``undying run`` processes hold an etcd lease (controller/ha.py): node
    0's (host0, pid 1000) went with the old leader, so it is lost at once, not after the wait for an
    unconfirmed agent's poll; node 1 (alive) is waited for, and the decision comes once it polls."""
    first = Job(tmp_path / "a", **RECOVERABLE)
    first.start_running()
    for rank in range(4):
        first.beat(rank, 7)
    job = Job(tmp_path / "b", **RECOVERABLE)
    job.controller.resume(first.controller.export_state(), why="test", live={("host1", 1001), ("host9", 7)})
    job.start()
    assert kinds(tmp_path / "b", ev.CONTROLLER_TAKEOVER)[0].details["gone"] == [0]
    deadline = time.time() + WAIT
    while not kinds(tmp_path / "b", ev.AGENT_LOST) and time.time() < deadline:
        time.sleep(0.02)
    lost = kinds(tmp_path / "b", ev.AGENT_LOST)
    assert [event.node for event in lost] == [0] and "no etcd lease" in lost[0].details["why"]
    assert not kinds(tmp_path / "b", ev.DECISION)  # node 1 has not polled yet: its state is unknown
    job.beat(2, 7)
    job.beat(3, 7)
    deadline = time.time() + WAIT
    while not kinds(tmp_path / "b", ev.DECISION) and time.time() < deadline:
        order = job.poll(1, 1, job.statuses(1, 1), wait=0.05)
        assert order.kind == OrderKind.NONE, order
    decision = kinds(tmp_path / "b", ev.DECISION)[0]
    assert decision.details["strategy"] == "recover" and decision.details["lost_ranks"] == [0, 1]


def test_a_resumed_controller_knows_which_process_holds_each_node(tmp_path: Path) -> None:
    """The saved state names each node's agent (pid and host): right after a takeover, a poll from
    another process (an agent that was away while a spare took its place) is told to say hello."""
    first = Job(tmp_path / "a", **RECOVERABLE)
    first.start_running()
    saved = first.controller.export_state()
    assert (saved["nodes"]["1"]["pid"], saved["nodes"]["1"]["host"]) == (1001, "host1")
    job = successor(tmp_path / "b", saved)
    job.start()
    stranger = job.controller.poll(AgentPoll(1, 1, job.statuses(1, 1), 0.0, pid=4242, hostname="host1"))
    assert (stranger.kind, stranger.reason) == (OrderKind.NONE, "hello")
    owner = job.controller.poll(AgentPoll(1, 1, job.statuses(1, 1), 0.0, pid=1001, hostname="host1"))
    assert owner.kind == OrderKind.NONE and owner.reason != "hello"


def test_a_controller_that_takes_over_a_recovery_restarts_the_job(tmp_path: Path) -> None:
    first = Job(tmp_path / "a", **RECOVERABLE)
    first.start_running()
    saved = {**first.controller.export_state(), "state": JobState.RECOVERING.value}
    job = successor(tmp_path / "b", saved)
    assert job.controller.state is JobState.STOPPING
    assert job.controller.restart_count == 1
    job.start()
    assert job.next_order(0, 1, job.statuses(0, 1)).kind == OrderKind.STOP


def test_an_injection_claimed_before_the_failover_is_not_granted_again(tmp_path: Path) -> None:
    injections = encode(parse_injections(["raise:rank=0:step=10"]))
    first = Job(tmp_path / "a", **RECOVERABLE)
    first.controller.machine.injections_text = injections
    first.start_running()
    assert first.controller.claim_injection(InjectionClaim(0, 0, 0, 1, 10))
    job = successor(tmp_path / "b", first.controller.export_state())
    job.controller.machine.injections_text = injections
    assert not job.controller.claim_injection(InjectionClaim(0, 0, 0, 1, 10))


def test_a_controller_that_cannot_save_its_state_stops_deciding(tmp_path: Path) -> None:
    """A fenced write refused (another candidate leads now): run() returns None, nothing more is decided."""
    job = ShellJob(tmp_path, **RECOVERABLE)
    job.controller.save_state = lambda state: False
    for node in range(2):
        job.hello(node)
    job.start()
    deadline = time.time() + WAIT
    while job.exit_code is None and job._thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert not job._thread.is_alive() and job.exit_code is None
    assert job.controller.deposed


def test_one_leader_at_a_time_and_a_takeover_when_its_lease_expires(etcd_server: EtcdServer) -> None:
    job = f"unit-{time.time_ns()}"
    lost: list[str] = []
    first = Candidate(etcd_server.endpoint, job, ttl=2, on_lost=lambda: lost.append("first"))
    stop = threading.Event()
    assert first.campaign(stop)
    first.publish("127.0.0.1:1111", "127.0.0.1:2222", epoch=1)
    assert first.save_state({"state": "running"})
    assert locate_controller(etcd_server.endpoint, job) == "127.0.0.1:1111"

    second = Candidate(etcd_server.endpoint, job, ttl=2)
    won = threading.Event()
    runner = threading.Thread(target=lambda: second.campaign(stop) and won.set(), daemon=True)
    runner.start()
    time.sleep(1.5)
    assert not won.is_set(), "two leaders at once"
    # The first leader's process freezes: its lease is no longer renewed and expires.
    first._stop.set()
    assert won.wait(10), "no takeover after the lease expired"
    second.publish("127.0.0.1:3333", "127.0.0.1:4444", epoch=2)
    assert locate_controller(etcd_server.endpoint, job) == "127.0.0.1:3333"
    # The deposed leader wakes up: its fenced write is refused and it learns it lost.
    assert not first.save_state({"state": "failed"})
    assert lost == ["first"]
    client = EtcdClient(etcd_server.endpoint)
    assert '"running"' in client.get(f"/undying/{job}/state").value
    second.resign()
    assert locate_controller(etcd_server.endpoint, job) is None
    stop.set()


def test_a_controller_is_constructed_without_failover_by_default(tmp_path: Path) -> None:
    job = ShellJob(tmp_path)
    assert isinstance(job.controller, Controller) and job.controller.save_state is None
    with pytest.raises(KeyError):
        job.controller.resume({}, why="nothing saved")


def test_a_controller_not_sure_of_its_lease_answers_nobody_and_decides_nothing(tmp_path: Path) -> None:
    """A leader frozen past its lease wakes up not in charge: requests get NotInCharge (HTTP 503,
    clients then ask etcd), and its loop starts no generation although every node said hello."""
    job = ShellJob(tmp_path, **RECOVERABLE)
    for node in range(2):
        job.hello(node)
    job.controller.in_charge = lambda: False
    job.start()
    with pytest.raises(NotInCharge):
        job.hello(0)
    with pytest.raises(NotInCharge):
        job.controller.recover(RecoverRequest(0, 0, 1, 0, 2000, "x", wait=0.0))
    time.sleep(0.5)
    assert job.controller.generation == 0 and job.controller.state is JobState.WAITING_FOR_NODES
    job.controller.in_charge = lambda: True  # the lease renewed after all
    assert job.wait_for(lambda: job.controller.state is JobState.RUNNING)


def test_an_agent_that_no_longer_holds_its_nodes_place_is_told_to_say_hello(tmp_path: Path) -> None:
    job = Job(tmp_path, **RECOVERABLE)
    job.start_running()
    owner = job.controller.poll(AgentPoll(1, 1, job.statuses(1, 1), 0.0, pid=1001, hostname="host1"))
    assert owner.kind == OrderKind.NONE and owner.reason != "hello"
    stranger = job.controller.poll(AgentPoll(1, 1, job.statuses(1, 1), 0.0, pid=4242, hostname="host1"))
    assert (stranger.kind, stranger.reason) == (OrderKind.NONE, "hello")
    # The same pid on another host is another process.
    elsewhere = job.controller.poll(AgentPoll(1, 1, job.statuses(1, 1), 0.0, pid=1001, hostname="host7"))
    assert (elsewhere.kind, elsewhere.reason) == (OrderKind.NONE, "hello")


def test_a_superseded_process_of_a_rank_is_told_to_exit(tmp_path: Path) -> None:
    """Rank 3 was replaced (generation 2, new process) while its old process was frozen; the old
    one wakes up and checks in: it is told to exit, not handed the new generation's plan."""
    job = Job(tmp_path, **RECOVERABLE)
    job.start_running()
    record = job.controller.ranks[3]
    record.spawn_generation, record.pid = 2, 9003
    plan = job.controller.recover(RecoverRequest(3, 1, 1, 7, 2003, "woke up", wait=0.0))
    assert plan.action == PlanAction.EXIT and "9003" in plan.reason
