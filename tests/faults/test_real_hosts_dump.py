"""The dying checkpoint (``dump``) on real hosts: each node its own `undying run --node-rank` process
group (test_real_hosts.py's ``Hosts``). A lost node with no process-level strategy that can take
its place: the survivors write the state of the step they hold to shared storage, the lost node's
`undying run` is started again (a rescheduled pod) and the restarted job loads the dump, not the
older periodic checkpoint, ending with the fault-free run's parameters."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.conftest import STEPS, JobRun, assert_ends_bitwise, wait_no_processes
from tests.faults.test_real_hosts import Hosts, timeline
from undying import events as ev

pytestmark = pytest.mark.faults

# Four nodes of one rank each, the reference run's world size (4): losing a node leaves more than
# half of the ranks healthy, which the dump needs; on two nodes of two ranks it would not apply.
FOUR_HOSTS = ["--nnodes", "4", "--nproc-per-node", "1"]
PERIODIC_STEP = 10  # BASE_ARGS' checkpoint interval: the older checkpoint the restart must not load
FAULT_STEP = 15
# The chain's earlier strategies refuse a lost node (no agent to retry or restart in place; recover
# is not in the chain, pod rescheduling being off); T1 snapshots only at checkpoint steps, so the
# restart reads the dump from storage.
DUMP_AFTER_REFUSALS = ["--set", "process_recover=true",
                       "--recover-strategy", "retry,recover-in-place,dump",
                       "--set", "checkpoint.snapshot_interval=0"]


@pytest.fixture
def cluster(tmp_path: Path):
    """Four hosts, node 1 killed at FAULT_STEP; closed (every process group killed) at the end."""
    made = Hosts(tmp_path, [*FOUR_HOSTS, *DUMP_AFTER_REFUSALS, "--inject", f"node:node=1:step={FAULT_STEP}"])
    yield made
    made.close()
    assert wait_no_processes(made.mark) == []


def test_survivors_dump_a_lost_hosts_step_and_the_restart_loads_it(reference_run: JobRun, cluster: Hosts) -> None:
    """SIGKILL of node 1's whole process group at step 15 (checkpoints at 10, 20): the survivors
    write a dump of the step they hold, node 1's `undying run` starts again, every rank of the
    restarted job loads that dump and the final parameters equal the fault-free run's."""
    for node in range(4):
        cluster.start(node)
    assert cluster.processes[1].wait(timeout=180) == -signal.SIGKILL, cluster.wait(1)[1]
    # The pod is rescheduled after the survivors wrote the dump: the restart waits for it.
    cluster.wait_for_event("dump_committed", lambda e: e.kind == ev.DUMP_COMMITTED)
    cluster.start(1)  # same node rank, fresh processes, no memory of the old ones
    code, output = cluster.wait(0)
    run = JobRun(code, output, cluster.run_dir(0), cluster.mark)
    [fault] = run.kinds(ev.FAULT_DETECTED)
    story = timeline(run.events, fault.time)
    print(story)
    assert code == 0, output + story
    for node in (1, 2, 3):
        node_code, node_output = cluster.wait(node, timeout=60)
        assert node_code == 0, f"node {node}:\n{node_output}\n{story}"
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run, story)

    [decision] = run.kinds(ev.DECISION)
    assert decision.details["strategy"] == "dump" and decision.details["lost_ranks"] == [1], story
    assert "recover-in-place: " in decision.details["reason"], story
    # The dump holds the step the survivors held at the fault, newer than the periodic checkpoint.
    [plan] = run.kinds(ev.RECOVERY_PLAN)
    assert plan.details["action"] == "dump" and plan.step in (FAULT_STEP - 1, FAULT_STEP), story
    [dump] = run.kinds(ev.DUMP_COMMITTED)
    assert dump.step == plan.step > PERIODIC_STEP, story
    assert dump.rank == plan.details["source_rank"] != 1 and dump.node != 1, story
    # The dump was written without node 1, whose agent was lost when its connection closed.
    [lost] = [e for e in run.kinds(ev.AGENT_LOST) if e.node == 1]
    assert "connection closed" in lost.details["why"] and lost.time < dump.time, story
    # One job restart, after the dump; it started once node 1 was back, and every rank loaded the dump.
    [restart] = run.kinds(ev.RESTART_BEGIN)
    assert restart.time > dump.time and "dying checkpoint" in restart.details["fault"], story
    [back] = [e for e in run.kinds(ev.AGENT_REGISTERED) if e.node == 1 and e.time > lost.time]
    [generation] = [e for e in run.kinds(ev.GENERATION_START) if e.generation == restart.generation + 1]
    assert generation.time >= back.time, story
    loads = {e.rank: e for e in run.kinds(ev.CHECKPOINT_LOAD) if e.generation == generation.generation}
    assert sorted(loads) == [0, 1, 2, 3], story
    for load in loads.values():
        assert load.step == dump.step and load.details["dump"], story
        assert load.details["path"] == dump.details["path"], story
    # Node 1's new processes, not its old ones, trained on from the dump.
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    restarted = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == generation.generation}
    assert restarted[1] != first[1], story
