"""A straggler, with real processes: a rank slowed by half per step (``slow`` injection) is reported
within 5 steps, and with ``straggler_strategy: switch`` its node moves to a spare at a step boundary:
no step lost or replayed, the other ranks keep their processes, no fault, no job restart, and the
final parameters equal the fault-free run's. (That the step rate returns to the fault-free one is a
timing claim: bench/incidents.py, its ``straggler-switch`` scenario.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import STEPS, JobRun, run_job
from undying import events as ev

pytestmark = pytest.mark.faults

SLOW_AT = 6  # the first step rank 3 runs half as slow again
SWITCH = ["--set", "process_recover=true", "--standby", "1", "--set", "straggler_strategy=switch",
          "--set", "straggler_window=5", "--set", "straggler_threshold=1.4",
          "--inject", f"slow:rank=3:step={SLOW_AT}:factor=1.5"]
# Steps of 0.1 s more (sleep: the numbers do not change) so that a step is mostly time no other
# process on a busy test machine can take from it: the injected half stands out from the jitter.
STEP_SLEEP = ["--step-sleep", "0.1"]


def test_a_slow_rank_is_reported_and_its_node_switched_to_a_spare(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, SWITCH, script_args=STEP_SLEEP)
    assert run.returncode == 0, run.output + run.logs()
    [straggler, *_] = [event for event in run.kinds(ev.STRAGGLER) if event.rank == 3]
    assert straggler.node == 1 and straggler.step is not None and straggler.step - SLOW_AT <= 5, straggler
    assert straggler.details["ratio"] >= 1.4 and straggler.details["strategy"] == "switch"
    assert "STRAGGLER rank 3 (node 1)" in run.output
    [begin] = run.kinds(ev.SWITCH_BEGIN)
    assert (begin.node, begin.details["spare"], begin.details["ranks"]) == (1, 2, [2, 3])
    [plan] = run.kinds(ev.RECOVERY_PLAN)
    assert (plan.details["strategy"], plan.details["receivers"]) == ("switch", [2, 3])
    assert not run.kinds(ev.FAULT_DETECTED) and not run.kinds(ev.RESTART_BEGIN)
    # Node 0's ranks keep their processes; node 1's start on the spare and receive the state.
    first = {event.rank: event.details["pid"] for event in run.kinds(ev.WORKER_READY) if event.generation == 1}
    recovered = {event.rank: event.details["pid"] for event in run.kinds(ev.RECOVERED)}
    assert (recovered[0], recovered[1]) == (first[0], first[1])
    assert recovered[2] != first[2] and recovered[3] != first[3]
    # No step lost or run twice: every rank committed every step once, the switch at a boundary.
    samples = run.samples()
    assert sorted(samples) == list(range(STEPS))
    # A rank appends a step's samples after it committed the step; the switched-out ranks may be
    # stopped between the two at the boundary step (the plan resumes after it, from rank 0's state).
    boundary = plan.step - 1
    for step in samples:
        ranks = sorted(record["rank"] for record in samples[step])
        assert ranks == [0, 1, 2, 3] or (step == boundary and ranks in ([0, 1], [0, 1, 2], [0, 1, 3])), (step, ranks)
    assert run.result["param_sha256"] == reference_run.result["param_sha256"]
