"""Run summaries and timelines built from synthetic event logs (no processes)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from undying.events import Event, EventLog
from undying.faults import FaultReason, describe_fault
from undying.report import render_summary, render_timeline_svg, summarize, write_report

SVG_NS = "{http://www.w3.org/2000/svg}"
T0 = 1_700_000_000.0
STEP_SECONDS = 0.5
CHECKPOINT_EVERY = 10
# A fault's timing after its injection: detected, decided, restart begun, new
# generation started, checkpoint loaded, first step done.
DETECT, DECIDE, RESTART, GENERATION, LOAD, FIRST = 0.3, 0.4, 0.5, 2.0, 3.0, 3.5


def synthetic_run(
    faults: dict[int, int] | None = None,
    total_steps: int = 40,
    world_size: int = 2,
    max_restarts: int = 3,
    finish: bool = True,
) -> list[Event]:
    """Events of a one-node job; ``faults`` maps a step to the rank SIGKILLed when it is reached.

    Each rank heartbeats once per step and saves a checkpoint every ``CHECKPOINT_EVERY``
    steps; after a fault the job restarts from the latest checkpoint.
    """
    pending = dict(faults or {})
    events = [
        Event(
            "job_start",
            T0,
            details={
                "nnodes": 1,
                "nproc_per_node": world_size,
                "world_size": world_size,
                "strategies": ["job-restart"],
                "effective_strategy": "job-restart",
                "max_restarts": max_restarts,
            },
        )
    ]
    now, generation, restarts, step, last_checkpoint = T0, 0, 0, 0, 0

    def start_generation() -> None:
        events.append(
            Event(
                "generation_start",
                now,
                generation=generation,
                details={"world_size": world_size, "restart_count": restarts},
            )
        )
        events.extend(
            Event("worker_started", now, node=0, rank=r, generation=generation) for r in range(world_size)
        )

    start_generation()
    while step < total_steps:
        if step in pending:
            rank = pending.pop(step)
            events.append(
                Event(
                    "injection",
                    now,
                    node=0,
                    rank=rank,
                    step=step,
                    details={"spec": f"kill:rank={rank},step={step}"},
                )
            )
            events.append(
                Event(
                    "worker_exit",
                    now + 0.2,
                    node=0,
                    rank=rank,
                    generation=generation,
                    details={"exitcode": -9, "signal": "SIGKILL"},
                )
            )
            events.append(
                Event(
                    "fault_detected",
                    now + DETECT,
                    node=0,
                    rank=rank,
                    step=step,
                    generation=generation,
                    details={"reason": "worker_exit", "exitcode": -9, "signal": "SIGKILL"},
                )
            )
            if restarts >= max_restarts:
                events.append(
                    Event(
                        "decision",
                        now + DECIDE,
                        generation=generation,
                        details={
                            "strategy": "exit",
                            "restart_count": restarts,
                            "max_restarts": max_restarts,
                            "reason": "restarts exhausted",
                        },
                    )
                )
                events.append(
                    Event(
                        "job_end",
                        now + RESTART,
                        details={"outcome": "failed", "exit_code": 1, "message": "restarts exhausted"},
                    )
                )
                return events
            events.append(
                Event(
                    "decision",
                    now + DECIDE,
                    generation=generation,
                    details={
                        "strategy": "job-restart",
                        "restart_count": restarts + 1,
                        "max_restarts": max_restarts,
                        "reason": "worker_exit",
                    },
                )
            )
            events.append(Event("restart_begin", now + RESTART, generation=generation))
            fault_time = now
            restarts += 1
            generation += 1
            now = fault_time + GENERATION
            start_generation()
            for r in range(world_size):
                events.append(
                    Event(
                        "checkpoint_load",
                        fault_time + LOAD,
                        node=0,
                        rank=r,
                        step=last_checkpoint,
                        generation=generation,
                        details={"path": f"ckpt/{last_checkpoint}", "source": "storage", "seconds": 0.1},
                    )
                )
            events.append(Event("restart_end", fault_time + LOAD, generation=generation))
            step = last_checkpoint + 1
            now = fault_time + FIRST
            for r in range(world_size):
                events.append(
                    Event(
                        "first_step",
                        now,
                        node=0,
                        rank=r,
                        step=step,
                        generation=generation,
                        details={"resumed_from": last_checkpoint},
                    )
                )
            continue
        step += 1
        now += STEP_SECONDS
        for r in range(world_size):
            events.append(
                Event(
                    "heartbeat",
                    now,
                    node=0,
                    rank=r,
                    step=step,
                    generation=generation,
                    details={"phase": "train", "loss": 1.0 / step},
                )
            )
        if step % CHECKPOINT_EVERY == 0:
            last_checkpoint = step
            for r in range(world_size):
                events.append(
                    Event(
                        "checkpoint_save",
                        now + 0.05,
                        node=0,
                        rank=r,
                        step=step,
                        generation=generation,
                        details={"path": f"ckpt/{step}", "seconds": 0.05, "bytes": 1024},
                    )
                )
    if finish:
        events.extend(
            Event("worker_done", now + 0.1, node=0, rank=r, step=step, generation=generation)
            for r in range(world_size)
        )
        events.append(
            Event("job_end", now + 0.2, details={"outcome": "succeeded", "exit_code": 0, "message": "done"})
        )
    return events


def parse_svg(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG_NS}svg"
    return root


def texts(root: ET.Element) -> list[str]:
    return [element.text or "" for element in root.iter(f"{SVG_NS}text")]


def of_class(root: ET.Element, css_class: str, tag: str = "*") -> list[ET.Element]:
    return [e for e in root.iter(f"{SVG_NS}{tag}" if tag != "*" else None) if e.get("class") == css_class]


def test_fault_free_run_summary() -> None:
    summary = summarize(synthetic_run())

    assert summary.outcome == "succeeded"
    assert summary.exit_code == 0
    assert summary.world_size == 2
    assert (summary.generations, summary.restarts, summary.recoveries) == (1, 0, [])
    assert summary.final_step == 40
    assert summary.checkpoints_saved == 4  # steps 10..40; both ranks' saves count once
    assert summary.checkpoints_corrupt == 0
    assert summary.duration_seconds == pytest.approx(40 * STEP_SECONDS + 0.2)

    text = render_summary(summary)
    assert "outcome: succeeded (exit code 0)" in text
    assert "world size: 2 ranks" in text
    assert "40 committed" in text
    assert "faults: 0" in text


def test_one_kill_restart_and_resume() -> None:
    summary = summarize(synthetic_run(faults={25: 1}))

    assert summary.outcome == "succeeded"
    assert (summary.generations, summary.restarts) == (2, 1)
    assert summary.final_step == 40
    (recovery,) = summary.recoveries
    assert recovery.fault_kind == "worker_exit"
    assert (recovery.rank, recovery.node, recovery.signal) == (1, 0, "SIGKILL")
    assert recovery.fault_step == 25
    assert recovery.strategy == "job-restart"
    assert recovery.resumed_from_step == 20
    assert recovery.steps_lost == 5
    assert recovery.recovery_seconds == pytest.approx(FIRST - DETECT)
    assert recovery.detect_seconds == pytest.approx(DETECT)

    assert (
        "fault: rank 1 exited (killed by SIGKILL) at step 25 -> decision: job-restart -> resumed from step "
        "20 (5 steps lost), training again 3.2 s after the fault (detected 0.3 s after the injection)"
    ) in render_summary(summary)


def test_two_faults_are_two_recoveries() -> None:
    summary = summarize(synthetic_run(faults={15: 0, 33: 1}))

    assert (summary.generations, summary.restarts) == (3, 2)
    assert [r.fault_step for r in summary.recoveries] == [15, 33]
    assert [r.rank for r in summary.recoveries] == [0, 1]
    assert [r.resumed_from_step for r in summary.recoveries] == [10, 30]
    assert [r.steps_lost for r in summary.recoveries] == [5, 3]
    for recovery in summary.recoveries:
        assert recovery.recovery_seconds == pytest.approx(FIRST - DETECT)
    text = render_summary(summary)
    assert "faults: 2" in text
    assert "(5 steps lost)" in text and "(3 steps lost)" in text
    assert "2 recoveries (2 job restarts)" in text


def test_repeated_detection_of_one_fault_is_one_recovery() -> None:
    events = synthetic_run(faults={25: 1})
    first_fault = next(i for i, e in enumerate(events) if e.kind == "fault_detected")
    events.insert(
        first_fault + 1,
        Event(
            "fault_detected",
            events[first_fault].time + 0.05,
            node=0,
            rank=0,
            step=25,
            generation=0,
            details={"reason": "heartbeat_missed"},
        ),
    )

    (recovery,) = summarize(events).recoveries
    assert recovery.rank == 1 and recovery.fault_kind == "worker_exit"


def test_truncated_run_without_job_end() -> None:
    events = synthetic_run(faults={25: 1})
    cut = next(i for i, e in enumerate(events) if e.kind == "restart_begin")
    summary = summarize(events[: cut + 1])

    assert summary.outcome is None and summary.exit_code is None
    assert summary.restarts == 1
    assert summary.final_step == 25
    (recovery,) = summary.recoveries
    assert recovery.strategy == "job-restart"
    assert recovery.resumed_from_step is None and recovery.steps_lost is None
    assert recovery.recovery_seconds is None
    text = render_summary(summary)
    assert "outcome: unknown" in text
    assert "not resumed before the log ends" in text

    # Cut while the new generation is loading: the resume point is known, training is not.
    load = next(i for i, e in enumerate(events) if e.kind == "checkpoint_load")
    (recovery,) = summarize(events[: load + 1]).recoveries
    assert recovery.resumed_from_step == 20 and recovery.steps_lost == 5
    assert recovery.recovery_seconds is None


def test_run_ended_by_exit_decision() -> None:
    summary = summarize(synthetic_run(faults={5: 1}, max_restarts=0))

    assert summary.outcome == "failed" and summary.exit_code == 1
    assert summary.restarts == 0
    (recovery,) = summary.recoveries
    assert recovery.strategy == "exit" and recovery.resumed_from_step is None
    text = render_summary(summary)
    assert "decision: exit" in text
    assert "message: restarts exhausted" in text


def test_restart_without_checkpoint_resumes_from_zero() -> None:
    events = synthetic_run(faults={5: 1})  # before the first checkpoint
    events = [e for e in events if e.kind not in ("first_step", "checkpoint_load")]

    (recovery,) = summarize(events).recoveries
    assert recovery.resumed_from_step == 0 and recovery.steps_lost == 5
    assert recovery.recovery_seconds is not None and recovery.recovery_seconds > 0


def test_agent_lost_fault_is_described_by_node() -> None:
    events = [
        Event("job_start", T0, details={"world_size": 2}),
        Event("generation_start", T0, generation=0, details={"world_size": 2, "restart_count": 0}),
        Event("fault_detected", T0 + 5, node=1, step=7, generation=0, details={"reason": "agent_lost"}),
    ]
    (recovery,) = summarize(events).recoveries
    assert recovery.rank is None and recovery.node == 1
    assert "fault: node 1 lost (agent gone) at step 7" in render_summary(summarize(events))


def test_a_fault_is_worded_as_the_controller_logged_it() -> None:
    events = synthetic_run(faults={25: 1})
    fault = next(e for e in events if e.kind == "fault_detected")
    logged = describe_fault(FaultReason.WORKER_EXIT, rank=1, node=0, exitcode=-9, signal="SIGKILL")
    # No description in these events: the report words the fault from its fields.
    assert f"fault: {logged} at step 25" in render_summary(summarize(events))

    fault.details["description"] = "rank 1 exited (as the controller put it)"
    (recovery,) = summarize(events).recoveries
    assert recovery.description == "rank 1 exited (as the controller put it)"
    assert "fault: rank 1 exited (as the controller put it) at step 25" in render_summary(summarize(events))

def test_empty_log() -> None:
    summary = summarize([])
    assert summary.outcome is None and summary.recoveries == [] and summary.final_step is None
    assert "outcome: unknown" in render_summary(summary)
    parse_svg(render_timeline_svg([]))


@pytest.mark.parametrize("world_size", [2, 4])
def test_timeline_svg_has_a_lane_per_rank_and_fault_markers(world_size: int) -> None:
    root = parse_svg(render_timeline_svg(synthetic_run(faults={15: 0, 33: 1}, world_size=world_size)))

    labels = texts(root)
    for rank in range(world_size):
        assert f"rank {rank} / node 0" in labels
    assert sum("SIGKILL" in label for label in labels) == 2
    assert len(of_class(root, "lane")) == world_size
    assert len(of_class(root, "fault", "line")) == 2
    assert len(of_class(root, "injection", "line")) == 2
    assert len(of_class(root, "steps", "polyline")) == 3 * world_size  # one per rank and generation
    assert (
        len(of_class(root, "checkpoint")) == 4 * world_size
    )  # step 10 (gen 0), 20 and 30 (gen 1), 40 (gen 2)
    assert len(of_class(root, "first-step")) == 2 * world_size
    assert any("succeeded" in label for label in labels)
    assert int(root.get("width", "0")) == 1200
    assert int(root.get("height", "0")) <= 120 + 100 * world_size


def test_timeline_svg_of_truncated_run() -> None:
    events = synthetic_run(faults={25: 1}, finish=False)
    root = parse_svg(render_timeline_svg(events))
    assert any("no job_end" in label for label in texts(root))


def test_write_report(tmp_path) -> None:
    log = EventLog(tmp_path)
    for event in synthetic_run(faults={25: 1}):
        log.emit(event)
    log.close()

    path = write_report(tmp_path)
    assert path == tmp_path / "timeline.svg"
    root = parse_svg(path.read_text(encoding="utf-8"))
    assert "rank 1 / node 0" in texts(root)

    elsewhere = write_report(tmp_path, tmp_path / "out" / "run.svg")
    assert elsewhere == tmp_path / "out" / "run.svg" and elsewhere.exists()


def test_a_controller_failover_is_in_the_summary_and_on_the_timeline() -> None:
    events = synthetic_run(faults={15: 1})
    takeover_time = T0 + 12 * STEP_SECONDS
    events += [
        Event("controller_leader", T0, node=0, details={"resumed": False}),
        Event("controller_leader", takeover_time, node=1, details={"resumed": True}),
    ]
    events.sort(key=lambda event: event.time)
    summary = summarize(events)
    assert summary.takeovers == ["controller failover: node 1 took over"]
    assert "controller: failover: node 1 took over" in render_summary(summary)
    root = ET.fromstring(render_timeline_svg(events))
    lines = [line for line in root.iter(f"{SVG_NS}line") if line.get("class") == "failover"]
    assert len(lines) == 1  # the first election is not a failover
    texts = [text.text for text in root.iter(f"{SVG_NS}text")]
    assert "controller failover: node 1 took over" in texts
