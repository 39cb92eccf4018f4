"""The controller's shell around the job machine: threads that wait there must not wake each other,
and the loop ticks on news, not after every routine poll or heartbeat.

A real ``Controller`` with its loop in a thread (``ShellJob``); the test plays the agents and the
workers. Three survivors long-poll for a plan that cannot come yet (the replacement has not
started): they must sleep, not spin. Each check-in used to wake every waiting thread, which checked
in again and woke the others: the controller process ran at 100 % of a core for as long as a
recovery waited, and the replacements it waited for started seconds later on a 2-core machine.
"""

from __future__ import annotations

import resource
import threading
import time
from pathlib import Path

import pytest

from tests.unit.job_harness import ShellJob
from undying import events as ev
from undying.controller import core
from undying.controller.deadlines import HEARTBEAT_LOG_EVERY
from undying.controller.state import JobState
from undying.events import read_events
from undying.protocol import (
    AgentPoll,
    Heartbeat,
    Order,
    OrderKind,
    Phase,
    PlanAction,
    RecoverRequest,
    WorkerState,
    WorkerStatus,
)

RECOVERY = {"process_recover": True, "recover_strategy": ["recover-in-place"], "nnodes": 2, "nproc_per_node": 2,
            "heartbeat_timeout": 10.0}
# CPU seconds the whole process may use while three check-ins wait for 1.5 s (spinning used all of it).
CPU_BOUND_S = 0.5
# Time for a loop that was woken to run its tick, before the test looks whether it did.
SETTLE_S = 0.3


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_check_ins_waiting_for_a_plan_do_not_spin(tmp_path: Path) -> None:
    job = ShellJob(tmp_path, **RECOVERY)
    controller = job.controller
    try:
        job.start_two_nodes_and_kill_rank3()

        plans: dict[int, PlanAction] = {}

        def survivor(rank: int) -> None:
            request = RecoverRequest(rank, rank // 2, 1, 7, 2000 + rank, "peer gone", wait=1.5)
            plans[rank] = PlanAction(controller.recover(request).action)

        started = cpu_seconds()
        threads = [threading.Thread(target=survivor, args=(rank,)) for rank in (0, 1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        used = cpu_seconds() - started
        assert plans == {0: PlanAction.WAIT, 1: PlanAction.WAIT, 2: PlanAction.WAIT}  # rank 3 never started
        assert used < CPU_BOUND_S, f"the controller used {used:.2f} CPU s while three check-ins waited 1.5 s"
    finally:
        job.close()


def test_routine_polls_and_heartbeats_do_not_tick_and_a_reported_exit_is_decided_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop ticks (scans every rank) on news, not after every routine call. With the periodic
    tick pushed out of the test's reach, routine polls and heartbeats that used to wake the loop
    (a poll always did; a heartbeat whenever it logged an event) must leave the tick count alone,
    and an agent's report of a killed worker must still be decided on at once."""
    monkeypatch.setattr(core, "TICK", 600.0)
    job = ShellJob(tmp_path, **RECOVERY)
    controller = job.controller
    ticks: list[float] = []
    tick = controller.machine.tick

    def counted_tick(now: float) -> None:
        ticks.append(now)
        tick(now)
    monkeypatch.setattr(controller.machine, "tick", counted_tick)
    try:
        job.start()
        for node in (0, 1):
            assert job.hello(node).accepted  # news: the loop ticks, the generation starts
        assert job.wait_for(lambda: controller.state is JobState.RUNNING)

        def poll(node: int, workers: list[dict[str, object]]) -> Order:
            return controller.poll(AgentPoll(node, 1, workers, 0.0, pid=1000 + node, hostname=f"host{node}"))

        def statuses(node: int) -> list[dict[str, object]]:
            return [WorkerStatus(rank, rank % 2, 2000 + rank, 1, WorkerState.RUNNING).to_dict()
                    for rank in (2 * node, 2 * node + 1)]
        assert {poll(node, statuses(node)).kind for node in (0, 1)} == {OrderKind.START}
        for rank in range(4):
            controller.heartbeat(Heartbeat(rank, rank // 2, 1, 1, Phase.COMPUTING, 2000 + rank))
        time.sleep(SETTLE_S)
        before = len(ticks)

        for step in range(2, 5):
            time.sleep(HEARTBEAT_LOG_EVERY)  # each beat below is logged: an event, which used to wake the loop
            for rank in range(4):
                controller.heartbeat(Heartbeat(rank, rank // 2, 1, step, Phase.COMPUTING, 2000 + rank))
            for node in (0, 1):
                assert poll(node, statuses(node)).kind == OrderKind.NONE
        time.sleep(SETTLE_S)  # what the loop would do if a call above had woken it
        assert len(ticks) == before and sum(event.kind == ev.HEARTBEAT for event in read_events(tmp_path)) >= 16

        killed = WorkerStatus(3, 1, 2003, 1, WorkerState.EXITED, -9, "SIGKILL").to_dict()
        controller.report(AgentPoll(1, 1, [killed], 0.0, pid=1001, hostname="host1"))
        assert job.wait_for(lambda: controller.generation == 2)  # decided without waiting for a TICK
        assert len(ticks) > before
    finally:
        job.close()


def test_a_retry_is_decided_and_planned_on_check_ins_without_waiting_for_a_tick(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step failure reported by check-in is news, and so is the check-in that completes a recovery's
    set: with the periodic tick out of reach, an exception on one rank (every rank checks in, as a
    failed vote makes them) still ends with every rank holding a retry plan."""
    monkeypatch.setattr(core, "TICK", 600.0)
    job = ShellJob(tmp_path, **{**RECOVERY, "recover_strategy": ["retry", "recover-in-place"]})
    controller = job.controller
    try:
        job.start()
        for node in (0, 1):
            assert job.hello(node).accepted
        assert job.wait_for(lambda: controller.state is JobState.RUNNING)
        for node in (0, 1):
            workers = [WorkerStatus(rank, rank % 2, 2000 + rank, 1, WorkerState.RUNNING).to_dict()
                       for rank in (2 * node, 2 * node + 1)]
            controller.poll(AgentPoll(node, 1, workers, 0.0, pid=1000 + node, hostname=f"host{node}"))
        plans: dict[int, object] = {}

        def failed_rank(rank: int) -> None:
            reason = "exception in step: RuntimeError('boom')" if rank == 1 else "a rank voted against this step"
            plan = controller.recover(RecoverRequest(rank, rank // 2, 1, 7, 2000 + rank, reason, wait=5.0))
            plans[rank] = (plan.action, plan.strategy)

        threads = [threading.Thread(target=failed_rank, args=(rank,)) for rank in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert set(plans.values()) == {(PlanAction.RESUME, "retry")}, plans
    finally:
        job.close()
