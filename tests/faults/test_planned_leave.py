"""A planned leave on real hosts: SIGTERM to one node's `undying run` (a preempted or drained pod).
The node tells the controller it is leaving before its workers stop; with elastic training in the
chain and no spare the job shrinks at once (no wait for a node that said it is going) and finishes,
every sample used exactly once, in the survivors' own processes, without a job restart."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import FINAL_STATE, JobRun
from tests.faults.test_real_hosts import Hosts, HostsRun, assert_same_samples_and_close
from undying import events as ev

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
        assert code1 == 0, output1
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
