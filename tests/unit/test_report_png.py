"""The PNG report: the data it is drawn from (monotone steps per rank, start-up and recovery phases,
MTTR, lanes grouped by node beyond 16 ranks), and that it renders, from a recorded run and from a
synthetic 256-rank log (no processes).

tests/data/recorded_failover_shrink/events.jsonl is a real run: 3 nodes x 2 ranks, each node its own
``undying run --etcd``; rank 3 SIGKILLed at step 8 (recovered in place), node 0 (the controller's
node, ranks 0-1) SIGKILLed at step 18: the controller failed over to node 1, and node 0's ranks were
dropped by an elastic shrink (6 -> 4 ranks) after a 3 s reschedule wait.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from PIL import Image

from tests.unit.test_report import synthetic_run
from undying import events as ev
from undying.events import Event, read_events
from undying.report.figure_data import MAX_LANES, figure_data
from undying.report.png import DPI, WIDTH_IN, write_png

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded_failover_shrink" / "events.jsonl"
T0 = 1_700_000_000.0


def assert_monotone(segments: list[list[tuple[float, int]]]) -> None:
    for segment in segments:
        times, steps = [t for t, _ in segment], [s for _, s in segment]
        assert times == sorted(times) and steps == sorted(steps), segment


def test_recorded_run_steps_rise_monotonically_per_rank():
    data = figure_data(read_events(RECORDED))
    assert sorted(data.steps) == list(range(6))
    for segments in data.steps.values():
        assert_monotone(segments)
        assert segments[0][0][1] >= 1, "a process not restored yet (phase starting) holds no step"
    # The ranks the shrink dropped stop at the fault; the others go on to the last step.
    assert max(step for segment in data.steps[0] for _, step in segment) <= 19
    assert all(data.steps[rank][-1][-1][1] == 45 for rank in (2, 3, 4, 5))
    assert data.max_step == 45


def test_a_restart_from_a_checkpoint_starts_a_new_segment():
    data = figure_data(synthetic_run(faults={15: 1}))  # job restart from the checkpoint of step 10
    for segments in data.steps.values():
        assert_monotone(segments)
        assert len(segments) == 2 and segments[1][0][1] == 10 < segments[0][-1][1]


def test_recorded_run_has_its_start_up_phases_labelled():
    data = figure_data(read_events(RECORDED))
    assert [span.label for span in data.startup] == ["agents join", "workers start", "first step"]
    assert data.startup[0].start == 0
    for previous, span in zip(data.startup, data.startup[1:], strict=False):
        assert span.start == previous.stop and span.seconds > 0


def test_recorded_run_has_each_recovery_with_its_phases_and_mttr():
    events = read_events(RECORDED)
    data = figure_data(events)
    first, second = data.recoveries
    assert "rank 3 exited (killed by SIGKILL) at step 8 -> recover-in-place" in first.description
    assert "node 0 lost (agent gone) at step 18 -> elastic-training" in second.description
    origin = next(e.time for e in events if e.kind == ev.JOB_START)
    # The killed rank's replacement started; the shrink started no process.
    assert [phase.label for phase in first.phases] == ["decide", "start processes", "wait for plan", "group rebuild",
                                                       "state transfer", "first step"]
    assert [phase.label for phase in second.phases] == ["decide", "wait for plan", "group rebuild", "state transfer",
                                                        "first step"]
    for recovery in (first, second):
        for previous, phase in zip(recovery.phases, recovery.phases[1:], strict=False):
            assert phase.start == previous.stop
        assert recovery.phases[0].start == recovery.start and recovery.phases[-1].stop == recovery.stop
        assert recovery.mttr == pytest.approx(sum(phase.seconds for phase in recovery.phases))
        # MTTR ends at the first step committed after the fault (the first logged, in a later generation).
        fault = min((e for e in events if e.kind == ev.FAULT_DETECTED),
                    key=lambda e: abs(e.time - origin - recovery.start))
        later = events[events.index(fault):]
        first_step = next(e.time for e in later if e.kind == ev.FIRST_STEP and e.generation > fault.generation)
        assert recovery.stop == pytest.approx(first_step - origin)
        assert recovery.detect is not None and recovery.detect.stop == recovery.start
    # The shrink waited for node 0 to come back (3 s) before its plan.
    assert second.phases[1].label == "wait for plan" and second.phases[1].seconds > 2.5
    assert [marker.kind for marker in data.markers] == ["failover", "elastic"]
    assert data.markers[1].label == "shrink 6 -> 4 at step 18"


def test_recorded_run_has_loss_and_step_rate():
    data = figure_data(read_events(RECORDED))
    losses = [loss for _, loss in data.loss if math.isfinite(loss)]
    assert len(losses) > 10 and losses[-1] < losses[0]
    assert any(math.isnan(loss) for _, loss in data.loss), "the outage breaks the loss line"
    rates = [rate for _, rate in data.step_rate if math.isfinite(rate)]
    assert rates and min(rates) >= 0 and max(rates) > 1
    assert [t for t, _ in data.step_rate] == sorted(t for t, _ in data.step_rate)


def test_recorded_run_renders(tmp_path: Path):
    out = write_png(RECORDED, read_events(RECORDED), tmp_path / "report.png")
    with Image.open(out) as image:
        assert image.format == "PNG"
        assert image.width == WIDTH_IN * DPI and 600 < image.height < 1400
        assert len(image.convert("L").getcolors(maxcolors=1 << 16) or []) > 20, "a picture, not a blank page"


def many_ranks_run(nodes: int = 32, per_node: int = 8, steps: int = 60) -> list[Event]:
    """A synthetic log of ``nodes x per_node`` ranks with one rank killed and recovered in place."""
    ranks = nodes * per_node
    killed = min(37, ranks - 1)
    events = [Event(ev.JOB_START, T0, details={"world_size": ranks}),
              Event(ev.GENERATION_START, T0 + 1, generation=1, details={"world_size": ranks})]
    events += [Event(ev.WORKER_READY, T0 + 3, rank=r, node=r // per_node, step=0, generation=1) for r in range(ranks)]
    now, generation = T0 + 4, 1
    for step in range(1, steps + 1):
        now += 0.25
        if step == 30:
            events.append(Event(ev.FAULT_DETECTED, now, rank=killed, node=killed // per_node, step=step,
                                generation=generation, details={"reason": "worker_exit"}))
            events.append(Event(ev.DECISION, now, step=step, generation=generation,
                                details={"strategy": "recover-in-place"}))
            generation += 1
            events.append(Event(ev.RECOVERY_PLAN, now + 0.3, step=step, generation=generation))
            events += [Event(ev.RECOVERED, now + 0.4, rank=r, node=r // per_node, step=step, generation=generation,
                             details={"strategy": "recover-in-place"}) for r in range(ranks)]
            now += 0.5
            events += [Event(ev.FIRST_STEP, now, rank=r, node=r // per_node, step=step + 1, generation=generation,
                             details={"resumed_from": step}) for r in range(ranks)]
            continue
        if step % 2 == 0:
            events += [Event(ev.HEARTBEAT, now, rank=r, node=r // per_node, step=step, generation=generation,
                             details={"phase": "computing", "loss": 5.0 / step + r * 1e-3}) for r in range(ranks)]
    events.append(Event(ev.JOB_END, now + 0.5, generation=generation, step=steps,
                        details={"outcome": "succeeded", "exit_code": 0, "message": "done"}))
    return events


def test_lanes_group_ranks_by_node_beyond_16_ranks():
    data = figure_data(many_ranks_run())
    assert len(data.lanes) == MAX_LANES
    assert [lane.label for lane in data.lanes[:2]] == ["nodes 0-1\nranks 0-15", "nodes 2-3\nranks 16-31"]
    assert sorted(rank for lane in data.lanes for rank in lane.ranks) == list(range(256))
    small = figure_data(many_ranks_run(nodes=2, per_node=8))
    assert [lane.label for lane in small.lanes][:2] == ["rank 0\nnode 0", "rank 1\nnode 0"]
    middle = figure_data(many_ranks_run(nodes=4, per_node=8))
    assert [lane.label for lane in middle.lanes] == [f"node {n}\nranks {8 * n}-{8 * n + 7}" for n in range(4)]


def test_a_256_rank_log_renders_at_a_readable_size(tmp_path: Path):
    events = many_ranks_run()
    data = figure_data(events)
    for segments in data.steps.values():
        assert_monotone(segments)
    [recovery] = data.recoveries
    assert recovery.mttr == pytest.approx(0.5)
    out = write_png(tmp_path, events, tmp_path / "report.png")
    with Image.open(out) as image:
        # As tall as 16 lanes make it, whatever the rank count: each lane about 50 px.
        assert image.width == WIDTH_IN * DPI and image.height < 1800
