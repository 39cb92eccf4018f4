"""Nodes as real hosts: each node is its own `undying run --node-rank` process group, as on a
cluster, so a lost node is seen the way a real one is (its agent's connection closes; no parent
sees it die). The final parameters must equal the fault-free run's (simulated nodes, same spec)."""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.conftest import (
    BASE_ARGS,
    EXAMPLE,
    MARK_ENV,
    REPO,
    STEPS,
    JobRun,
    undying_command,
    wait_no_processes,
)
from undying import events as ev

pytestmark = pytest.mark.faults

RECOVER = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
           "--recover-strategy", "recover-in-place,recover"]


class Hosts:
    """One `undying run` per node (and per spare), each the leader of its own process group."""

    def __init__(self, root: Path, extra: list[str]) -> None:
        self.root = root
        self.extra = extra
        self.mark = uuid.uuid4().hex
        (root / "token").write_text("h" * 40)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.processes: dict[int, subprocess.Popen] = {}

    def run_dir(self, node: int) -> Path:
        return self.root / f"node{node}"

    def start(self, node: int, spare: bool = False) -> None:
        args = ["run", *BASE_ARGS, "--node-rank", str(node), "--controller", f"127.0.0.1:{self.port}",
                "--token-file", str(self.root / "token"), "--run-dir", str(self.run_dir(node)), *self.extra]
        if node == 0:
            args += ["--controller-bind", "127.0.0.1"]
        if spare:
            args += ["--standby", "1"]
        env = dict(os.environ, **{MARK_ENV: self.mark, "PYTHONUNBUFFERED": "1"})
        self.processes[node] = subprocess.Popen(
            undying_command([*args, str(EXAMPLE), "--steps", str(STEPS)]), env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True)

    def wait(self, node: int, timeout: float = 240) -> tuple[int, str]:
        output, _ = self.processes[node].communicate(timeout=timeout)
        return self.processes[node].returncode, output

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.communicate()


@pytest.fixture
def hosts(tmp_path: Path):
    made: list[Hosts] = []

    def make(extra: list[str]) -> Hosts:
        made.append(Hosts(tmp_path, extra))
        return made[-1]

    yield make
    for host in made:
        host.close()
        assert wait_no_processes(host.mark) == []


def test_a_killed_hosts_process_group_is_recovered_onto_a_spare(reference_run: JobRun, hosts) -> None:
    """SIGKILL of node 1's whole process group (its `undying run`, agent and workers): the controller
    sees the agent's connection close, blames the node (not the survivors whose all-reduce failed
    first), a spare host takes its place, the survivors keep their processes, no job restart."""
    cluster = hosts([*RECOVER, "--inject", "node:node=1:step=12"])
    cluster.start(0)
    cluster.start(1)
    cluster.start(2, spare=True)
    code, output = cluster.wait(0)
    assert code == 0, output
    assert cluster.processes[1].wait(timeout=30) == -9  # killed with its process group
    assert cluster.wait(2, timeout=60)[0] == 0

    run = JobRun(code, output, cluster.run_dir(0), cluster.mark)
    assert run.result["final_step"] == STEPS
    assert run.result["param_sha256"] == reference_run.result["param_sha256"]
    [lost] = [e for e in run.kinds(ev.AGENT_LOST) if e.node == 1]
    assert "connection closed" in lost.details["why"], lost.details
    [decision] = run.kinds(ev.DECISION)
    assert (decision.details["strategy"], decision.details["lost_ranks"]) == ("recover", [2, 3]), decision.details
    assert not run.kinds(ev.RESTART_BEGIN)
    assert [e.details["spare"] for e in run.kinds(ev.STANDBY_ADOPT)] == [2]
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    recovered = {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED)}
    assert recovered[0] == first[0] and recovered[1] == first[1], "survivors must keep their processes"
    assert recovered[2] != first[2] and recovered[3] != first[3]
