"""A planned leave on real hosts: SIGTERM to one node's `undying run` (a preempted or drained pod).
The node tells the controller it is leaving before its workers stop, and its `undying run` exits
with EXIT_NODE_LEFT (143), which an engine answers by recreating the pod. With a spare, the spare takes
its place at once and the job ends with the fault-free run's parameters; with elastic training in
the chain and no spare the job shrinks at once (no wait for a node that said it is going) and
finishes, every sample used exactly once. Both in the survivors' own processes, no job restart."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import FINAL_STATE, STEPS, JobRun, assert_ends_bitwise
from tests.faults.test_real_hosts import STEP_SLEEP, Hosts, HostsRun, assert_same_samples_and_close, timeline
from undying import events as ev
from undying.agent.node_agent import EXIT_NODE_LEFT

pytestmark = pytest.mark.faults

CHAIN = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
         "--recover-strategy", "recover-in-place,recover,elastic-training"]


class SharedDirHosts(Hosts):
    """Every node writes into one run directory, as nodes on a shared filesystem do (checkpoints,
    sample logs and logs side by side)."""

    def run_dir(self, node: int) -> Path:
        return self.root / "run"


def test_sigterm_to_a_node_shrinks_the_job_at_once(reference_run: JobRun, tmp_path: Path) -> None:
    cluster = SharedDirHosts(tmp_path, CHAIN, script_args=["--final-state", str(tmp_path / "run" / FINAL_STATE)])
    try:
        cluster.start(0)
        cluster.start(1)
        cluster.wait_for_event("a heartbeat at step 8", lambda e: e.kind == ev.HEARTBEAT and (e.step or 0) >= 8)
        left_at = time.monotonic()
        os.kill(cluster.processes[1].pid, signal.SIGTERM)
        code1, output1 = cluster.wait(1, timeout=30)
        assert code1 == EXIT_NODE_LEFT, output1  # not the job's outcome: an engine recreates such a pod
        assert time.monotonic() - left_at < 10
        code, output = cluster.wait(0)
    finally:
        cluster.close()
    run = HostsRun(code, output, cluster.run_dir(0), cluster.mark)
    run.sample_dirs = (cluster.run_dir(0),)
    # As on any fault, a survivor may give up the step in flight that a peer committed; it then
    # receives that step, and only its record of it is missing (test_real_hosts.py says more).
    assert_same_samples_and_close(run, reference_run)
    [lost] = run.kinds(ev.AGENT_LOST)
    assert lost.node == 1 and lost.details["planned"], lost.details
    [shrink] = run.kinds(ev.ELASTIC_SHRINK)
    assert shrink.details["dropped_nodes"] == [1] and shrink.details["waited"] < 1.0, shrink.details
    assert not run.kinds(ev.RESTART_BEGIN)
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY)}
    assert {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED)} == {0: first[0], 1: first[1]}


def test_sigterm_to_a_node_with_a_spare_hands_its_place_to_the_spare(reference_run: JobRun, tmp_path: Path) -> None:
    """SIGTERM to node 1's `undying run` while a spare host waits: the spare adopts node 1 at once
    (recover comes before elastic training in the chain), the survivors keep their processes, the
    world size never changes and the final parameters equal the fault-free run's bit for bit (a
    survivor that gave up the step in flight receives it from a peer that committed it, so no
    rank's state differs from the fault-free run's at the plan's step)."""
    # Slowed steps (same numbers) so that the leave lands mid-run, after the spare said hello.
    cluster = Hosts(tmp_path, CHAIN, script_args=STEP_SLEEP)
    try:
        cluster.start(0)
        cluster.start(1)
        cluster.start(2, spare=True)
        cluster.wait_for_event("the spare's hello", lambda e: e.kind == ev.AGENT_REGISTERED and e.details["standby"])
        cluster.wait_for_event("a heartbeat at step 8", lambda e: e.kind == ev.HEARTBEAT and (e.step or 0) >= 8)
        left_at = time.time()
        os.kill(cluster.processes[1].pid, signal.SIGTERM)
        code1, output1 = cluster.wait(1, timeout=60)
        code, output = cluster.wait(0)
        spare_code, spare_output = cluster.wait(2, timeout=60)
    finally:
        cluster.close()
    run = JobRun(code, output, cluster.run_dir(0), cluster.mark)
    story = timeline(run.events, left_at)
    print(story)
    assert code == 0, output + story
    assert code1 == EXIT_NODE_LEFT, output1 + story
    assert spare_code == 0, spare_output + story
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run, story)

    [lost] = run.kinds(ev.AGENT_LOST)
    assert lost.node == 1 and lost.details["planned"], story
    [decision] = run.kinds(ev.DECISION)
    assert (decision.details["strategy"], decision.details["lost_ranks"]) == ("recover", [2, 3]), story
    assert [e.details["spare"] for e in run.kinds(ev.STANDBY_ADOPT)] == [2], story
    [plan] = run.kinds(ev.RECOVERY_PLAN)
    assert plan.details["world_size"] == 4 and set(plan.details["receivers"]) >= {2, 3}, story
    assert not run.kinds(ev.ELASTIC_SHRINK), story
    assert not run.kinds(ev.RESTART_BEGIN), story
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    recovered = {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED)}
    assert recovered[0] == first[0] and recovered[1] == first[1], "survivors must keep their processes\n" + story
    assert recovered[2] != first[2] and recovered[3] != first[3], story
