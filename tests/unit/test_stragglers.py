"""Stragglers: the step times on heartbeats, a rank found persistently slower than its peers, and the
switch of its node to a spare at a step boundary (the job machine on a fake clock)."""

from __future__ import annotations

import statistics

import pytest

from tests.unit.job_harness import Job, check_in_together
from undying import events as ev
from undying.controller.state import JobState
from undying.controller.stragglers import JUDGE_EVERY_S, StragglerWatch, _median_without
from undying.protocol import AgentHello, Heartbeat, OrderKind, Phase, PlanAction, RecoverRequest
from undying.runtime import pg
from undying.runtime.step_timing import StepTimer

SWITCH = {"nnodes": 2, "nproc_per_node": 2, "process_recover": True, "straggler_strategy": "switch",
          "straggler_window": 4, "straggler_threshold": 1.3}


def beat(rank: int, compute: float, comm: float, steps: int = 4, step: int = 9, pid: int | None = None,
         generation: int = 1) -> Heartbeat:
    return Heartbeat(rank, rank // 2, generation, step, Phase.COMPUTING, 2000 + rank if pid is None else pid,
                     timed_steps=steps, compute_seconds=compute, comm_seconds=comm, data_seconds=0.001)


def test_the_peers_median_leaves_the_rank_itself_out():
    for values in ([1.0, 2.0], [1.0, 2.0, 3.0], [1.0, 1.0, 5.0, 9.0, 10.0]):
        for index in range(len(values)):
            assert _median_without(values, index) == statistics.median(values[:index] + values[index + 1:])


def test_a_rank_its_peers_wait_for_is_a_straggler_once_per_process():
    watch = StragglerWatch(threshold=1.3, window=4)
    for rank in range(3):
        watch.observe(beat(rank, compute=0.100, comm=0.060))
    watch.observe(beat(3, compute=0.160, comm=0.005))  # 1.6 x busy; the others wait ~55 ms more for it
    [straggler] = watch.find(now=10.0)
    assert (straggler.rank, straggler.node) == (3, 1)
    assert straggler.ratio == pytest.approx(0.161 / 0.101)
    assert straggler.peers_comm == pytest.approx(0.060)
    watch.observe(beat(0, compute=0.100, comm=0.060))
    assert watch.find(now=11.0) == []  # this process is reported already
    watch.observe(beat(3, compute=0.160, comm=0.005, pid=9999))  # a new process of rank 3, as slow
    assert [s.rank for s in watch.find(now=12.0)] == [3]


def test_slow_with_its_peers_or_too_little_history_is_not_a_straggler():
    watch = StragglerWatch(threshold=1.3, window=4)
    for rank in range(3):
        watch.observe(beat(rank, compute=0.100, comm=0.060))
    # Its compute is long, but the others do not wait for it longer than it waits (a shared machine).
    watch.observe(beat(3, compute=0.160, comm=0.060))
    assert watch.find(now=10.0) == []
    watch.observe(beat(3, compute=0.300, comm=0.0, steps=3))  # a window not full yet: not compared
    assert watch.find(now=11.0) == []
    watch.observe(beat(3, compute=0.108, comm=0.0))  # 8 ms more: jitter, below MIN_EXCESS_S
    assert watch.find(now=12.0) == []


def test_the_ranks_are_judged_at_most_every_judge_interval():
    watch = StragglerWatch(threshold=1.3, window=4)
    watch.observe(beat(0, compute=0.100, comm=0.060))
    assert watch.find(now=10.0) == []  # one rank: no peers
    watch.observe(beat(1, compute=0.200, comm=0.0))
    assert watch.find(now=10.0 + JUDGE_EVERY_S / 2) == []
    assert [s.rank for s in watch.find(now=10.0 + 2 * JUDGE_EVERY_S)] == [1]


def test_the_step_timer_keeps_the_median_step_and_leaves_the_warm_up_out(monkeypatch):
    data = [0.0]
    timer = StepTimer(window=3, data_seconds=lambda: data[0])
    clock = [0.0]
    monkeypatch.setattr("undying.runtime.step_timing.time.perf_counter", lambda: clock[0])

    def step(compute: float, comm: float, read: float, injected: float = 0.0) -> None:
        timer.begin()
        clock[0] += compute + comm + read
        pg._waited += comm
        data[0] += read
        if injected:
            timer.injected(injected)
        timer.committed()

    step(5.0, 0.0, 0.0)  # the warm-up: not timed
    for compute in (0.10, 0.30, 0.12):
        step(compute, 0.02, 0.01)
    times = timer.typical()
    assert times.steps == 3
    assert (times.compute, times.comm, times.data) == pytest.approx((0.12, 0.02, 0.01))
    step(0.15, 0.0, 0.0, injected=0.05)
    assert timer.own_compute == pytest.approx(0.10)  # what an injected slowdown is measured against
    timer.restart()
    assert timer.typical().steps == 0


def running_with_a_spare(job: Job) -> None:
    assert job.controller.hello(AgentHello(2, 1002, "spare", 2, standby=True)).accepted
    job.start_running()


def beat_for(job: Job, seconds: float, slow_rank: int = 3) -> None:
    """Every rank beats its step times (``slow_rank`` 1.6 x busy, waited for) while ``seconds`` pass."""
    end = job.now() + seconds
    while job.now() < end:
        for rank in range(4):
            fast = rank != slow_rank
            job.controller.heartbeat(beat(rank, compute=0.100 if fast else 0.160, comm=0.060 if fast else 0.005))
        job.advance(0.05)


def test_a_straggler_is_reported_and_its_node_switched_to_the_spare_at_a_step_boundary(make_job):
    job = make_job(**SWITCH)
    running_with_a_spare(job)
    beat_for(job, 0.2)
    [straggler] = job.events(ev.STRAGGLER)
    assert (straggler.rank, straggler.node, straggler.details["strategy"]) == (3, 1, "switch")
    [begin] = job.events(ev.SWITCH_BEGIN)
    assert (begin.node, begin.details["spare"], begin.details["ranks"]) == (1, 2, [2, 3])
    machine = job.controller.machine
    assert job.controller.state is JobState.RECOVERING and machine.end_generation == 1
    assert machine.restart_count == 0  # a switch is not a recovery from a fault
    assert machine.membership.node_alive(1)  # the node keeps its ranks until the others are at the boundary
    # Ranks 0 and 1 finish their step in flight and check in; then node 1 is retired, the spare adopts it.
    survivors = [RecoverRequest(rank, 0, 1, 10, 2000 + rank, "generation ended") for rank in (0, 1)]
    for request in survivors:
        job.controller.check_in(request)
    # Node 1's old ranks at the boundary: no part in the plan (their node leaves the job).
    assert job.controller.check_in(RecoverRequest(3, 1, 1, 10, 2003, "generation ended")).action == PlanAction.WAIT
    job.advance(0.1)
    assert not machine.membership.node_alive(1)
    assert job.poll(1, 1, job.statuses(1, 1)).reason == "hello"  # its agent stops its workers, says hello
    adopt = job.next_order(2)
    assert (adopt.kind, adopt.node) == (OrderKind.ADOPT, 1)
    assert job.controller.hello(AgentHello(1, 1002, "spare", 2)).accepted
    replace = job.next_order(1)
    assert (replace.kind, replace.ranks, replace.generation) == (OrderKind.REPLACE, [2, 3], 2)
    newcomers = [RecoverRequest(rank, 1, 2, 0, 3000 + rank, "joining", newcomer=True) for rank in (2, 3)]
    plans = check_in_together(job.controller, [*survivors, *newcomers])
    assert {(plan.action, plan.strategy, plan.target_step, tuple(plan.receivers)) for plan in plans.values()} \
        == {(PlanAction.RESUME, "switch", 10, (2, 3))}
    job.controller.heartbeat(Heartbeat(3, 1, 2, 10, Phase.COMPUTING, 3003))
    assert job.controller.check_in(RecoverRequest(3, 1, 1, 10, 2003, "generation ended")).action == PlanAction.EXIT
    assert job.controller.state is JobState.RUNNING
    # The switched-out agent says hello again: it is a spare that is never given ranks.
    reply = job.controller.hello(AgentHello(1, 1001, "host1", 2))
    assert reply.accepted and reply.node == 3 and "switched out" in reply.reason
    assert job.controller.status()["nodes"]["3"]["standby"]
    assert job.controller.machine.membership.idle_spare() is None


def test_without_an_idle_spare_a_straggler_is_reported_and_switched_once_one_comes(make_job):
    job = make_job(**SWITCH)
    job.start_running()
    beat_for(job, 0.3)
    [straggler] = job.events(ev.STRAGGLER)
    assert straggler.details["spare_idle"] is False
    assert job.events(ev.SWITCH_BEGIN) == [] and job.controller.state is JobState.RUNNING
    assert job.controller.hello(AgentHello(2, 1002, "spare", 2, standby=True)).accepted
    job.advance(0.1)
    [begin] = job.events(ev.SWITCH_BEGIN)
    assert begin.node == 1


def test_report_only_and_off(make_job):
    for strategy, found in (("report", 1), ("off", 0)):
        job = make_job(**{**SWITCH, "straggler_strategy": strategy, "process_recover": False})
        running_with_a_spare(job)
        beat_for(job, 0.3)
        assert len(job.events(ev.STRAGGLER)) == found
        assert job.events(ev.SWITCH_BEGIN) == [] and job.controller.state is JobState.RUNNING
