"""Nodes as real hosts: each node is its own `undying run --node-rank` process group, as on a
cluster, so a lost node is seen the way a real one is (its agent's connection closes; no parent
sees it die), and a frozen one (SIGSTOP) only by its silence. The final parameters must equal the
fault-free run's (simulated nodes, same spec), or after an elastic shrink be within its tolerance."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    BASE_ARGS,
    EXAMPLE,
    FINAL_STATE,
    MARK_ENV,
    REPO,
    STEPS,
    JobRun,
    assert_ends_bitwise,
    undying_command,
    wait_no_processes,
)
from tests.faults.netns import WORKER_ENV, Network
from tests.faults.test_elastic import (
    LOSS_RTOL,
    PARAM_ATOL,
    assert_samples_kept,
    steps_a_survivor_took_from_a_peer,
)
from undying import events as ev
from undying.events import Event, read_events

pytestmark = pytest.mark.faults

RECOVER = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
           "--recover-strategy", "recover-in-place,recover"]


class Hosts:
    """One `undying run` per node (and per spare), each the leader of its own process group.
    ``reschedule_wait`` shortens the controller's wait for a lost node (node 0 hosts it);
    ``script_args`` go to the training script. With ``network`` (tests/faults/netns.py) node i runs
    on that network's host i, at its own address; without it every node is on 127.0.0.1."""

    def __init__(self, root: Path, extra: list[str], reschedule_wait: float | None = None,
                 script_args: list[str] | None = None, network: Network | None = None) -> None:
        self.root = root
        self.extra = extra
        self.reschedule_wait = reschedule_wait
        self.script_args = script_args or []
        self.network = network
        self.controller_host = "127.0.0.1" if network is None else network.address(0)
        self.mark = uuid.uuid4().hex
        (root / "token").write_text("h" * 40)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.processes: dict[int, subprocess.Popen] = {}
        # What the next ``start`` runs its node under: a command prefix (a mount namespace) and
        # environment variables of that host's own.
        self.wrap: list[str] = []
        self.extra_env: dict[str, str] = {}

    def run_dir(self, node: int) -> Path:
        return self.root / f"node{node}"

    def start(self, node: int, spare: bool = False) -> None:
        args = ["run", *BASE_ARGS, "--node-rank", str(node), "--controller", f"{self.controller_host}:{self.port}",
                "--token-file", str(self.root / "token"), "--run-dir", str(self.run_dir(node)),
                # Shared storage, as on a cluster: every rank writes its shard of a T2 checkpoint there.
                "--checkpoint-dir", str(self.root / "checkpoints"), *self.extra]
        if node == 0:
            args += ["--controller-bind", self.controller_host]
        if spare:
            args += ["--standby", "1"]
        env = dict(os.environ, **{MARK_ENV: self.mark, "PYTHONUNBUFFERED": "1"}, **self.extra_env)
        command = [*self.wrap, *undying_command([*args, str(EXAMPLE), "--steps", str(STEPS), *self.script_args],
                                                self.reschedule_wait if node == 0 else None)]
        self.wrap, self.extra_env = [], {}
        if self.network is not None:
            command = self.network.command(node, command)
            env.update(WORKER_ENV)
        self.processes[node] = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                                start_new_session=True)

    def wait(self, node: int, timeout: float = 240) -> tuple[int, str]:
        output, _ = self.processes[node].communicate(timeout=timeout)
        return self.processes[node].returncode, output

    def signal_host(self, node: int, signum: signal.Signals) -> None:
        """Signal node's whole process group (its `undying run`, agent and workers), as a machine
        freezing (SIGSTOP) or waking up (SIGCONT) would affect all of them at once."""
        os.killpg(self.processes[node].pid, signum)

    def events(self) -> list[Event]:
        """The controller's events so far (node 0's run dir)."""
        path = self.run_dir(0) / ev.EVENTS_FILE
        return read_events(path) if path.exists() else []

    def wait_for_event(self, what: str, found: Callable[[Event], bool], timeout: float = 120) -> Event:
        deadline = time.time() + timeout
        while time.time() < deadline:
            match = next((event for event in self.events() if found(event)), None)
            if match is not None:
                return match
            if self.processes[0].poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {what} within {timeout} s; events: {[e.kind for e in self.events()]}")

    def close(self) -> None:
        for process in self.processes.values():
            running = process.poll() is None
            try:  # the whole group: a frozen host's workers too (SIGKILL works on stopped processes)
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if running:
                process.communicate()


@pytest.fixture
def hosts(tmp_path: Path):
    made: list[Hosts] = []

    def make(extra: list[str], **options) -> Hosts:
        made.append(Hosts(tmp_path, extra, **options))
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
    assert_ends_bitwise(run, reference_run)
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


# A frozen host: SIGSTOP of a node's whole process group. Nothing closes (its agent's poll
# connection and its workers' sockets stay open), so the controller sees only silence: its ranks'
# heartbeats stop (heartbeat_timeout) and its agent stops polling (2 x monitor_interval + 5 s).
# Each step sleeps 0.4 s (numbers unchanged, so the 30-step fault-free reference holds) so that
# the job still trains when the host wakes up (SIGCONT) after the recovery.
FROZEN_CHAIN = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
                "--recover-strategy", "recover-in-place,recover,elastic-training"]
FREEZE_AT_STEP = 5
STEP_SLEEP = ["--step-sleep", "0.4"]


class HostsRun(JobRun):
    """A job run on `Hosts`: each node's ranks log their samples into that node's run dir."""

    sample_dirs: tuple[Path, ...] = ()

    def samples(self) -> dict[int, list[dict]]:
        by_step: dict[int, list[dict]] = {}
        for run_dir in self.sample_dirs:
            for log in sorted((run_dir / "samples").glob("*.jsonl")):
                for line in log.read_text().splitlines():
                    record = json.loads(line)
                    by_step.setdefault(record["step"], []).append(record)
        return by_step


def hosts_run(cluster: Hosts, code: int, output: str, nodes: tuple[int, ...]) -> HostsRun:
    run = HostsRun(code, output, cluster.run_dir(0), cluster.mark)
    run.sample_dirs = tuple(cluster.run_dir(node) for node in nodes)
    return run


def timeline(events: list[Event], since: float) -> str:
    """The recovery's events (heartbeats left out), seconds from ``since``: for failure messages."""
    lines = []
    for event in events:
        if event.kind in (ev.HEARTBEAT, ev.CHECKPOINT_SAVE):
            continue
        keep = {k: event.details[k] for k in ("why", "strategy", "reason", "lost_ranks", "description",
                                              "dropped_nodes", "spare", "returned_node", "standby")
                if k in event.details}
        lines.append(f"{event.time - since:+8.2f} {event.kind} node={event.node} rank={event.rank} "
                     f"step={event.step} gen={event.generation} {keep}")
    return "\n".join(lines)


def freeze_node1_after_a_few_steps(cluster: Hosts) -> float:
    cluster.wait_for_event(f"heartbeat at step {FREEZE_AT_STEP}", lambda e: e.kind == ev.HEARTBEAT
                           and e.rank in (2, 3) and (e.step or 0) >= FREEZE_AT_STEP)
    frozen_at = time.time()
    cluster.signal_host(1, signal.SIGSTOP)
    return frozen_at


def stopped_by(frozen_at: float) -> float:
    """A time by which node 1's processes have surely stopped (``signal_host`` sent SIGSTOP at
    ``frozen_at``): what a commit decided before it is not the fence's doing."""
    return frozen_at + 0.05


def wake_node1_and_finish(cluster: Hosts, frozen_at: float) -> tuple[JobRun, str, float]:
    """SIGCONT node 1's host and wait for the job, which must succeed: its run, its timeline from
    the freeze (printed), and the wall time of the wake-up."""
    woke_at = time.time()
    cluster.signal_host(1, signal.SIGCONT)
    code, output = cluster.wait(0)
    run = JobRun(code, output, cluster.run_dir(0), cluster.mark)
    story = timeline(run.events, frozen_at)
    print(f"frozen at +0.00, woke at {woke_at - frozen_at:+.2f}\n{story}")
    assert code == 0, output + story
    return run, story, woke_at


def assert_lost_as_a_frozen_host(run: JobRun, story: str) -> None:
    """Node 1's agent and ranks all went silent while node 0 was heard: the node is lost a
    heartbeat interval and a slack after their last beats (not at the 4 s heartbeat timeout), and
    recovered as one (recover), without first trying a recover-in-place that only its (frozen)
    agent could carry out."""
    assert [d.details["strategy"] for d in run.kinds(ev.DECISION)] == ["recover"], story
    assert not run.kinds(ev.RECOVERY_FAILED), story
    [lost] = [e for e in run.kinds(ev.AGENT_LOST) if e.node == 1]
    assert "frozen or cut off" in lost.details["why"], story
    assert "neither its agent nor its ranks were heard" in lost.details["why"], story


def assert_old_ranks_of_node1_were_silent(run: JobRun, cluster: Hosts, plan: Event, isolated_by: float) -> None:
    """Node 1's workers of generation 1 (stopped or cut off by ``isolated_by``, wall time) neither
    beat nor applied a step after ``plan``, the recovery that went on without them, unless their
    vote and commit fence let them apply it before ``isolated_by`` (the sample log's ``decided``):
    a vote's all-reduce can end on one rank and not yet on its peers when a host stops mid-way, and
    such a worker, woken, finishes that step (and logs its samples late) in a generation the job
    has given up; the job re-runs the step and never takes that worker's state."""
    late = [e for e in run.events if e.node == 1 and e.generation == 1 and e.time > plan.time
            and e.kind in (ev.HEARTBEAT, ev.FIRST_STEP, ev.WORKER_DONE, ev.CHECKPOINT_SAVE)]
    assert late == [], late
    for log in (cluster.run_dir(1) / "samples").glob("*.jsonl"):
        records = [json.loads(line) for line in log.read_text().splitlines()]
        beyond = [r for r in records if r["generation"] == 1 and r["step"] >= plan.step
                  and (r["decided"] is None or r["decided"] >= isolated_by)]
        assert beyond == [], f"{log.name}: the old generation committed a step the job had not: {beyond}"


def assert_same_samples_and_close(run: HostsRun, reference: JobRun) -> None:
    """test_elastic's check (sample order step by step, loss and final parameters within the
    elastic tolerance), except that a step a survivor received from a peer lacks its record."""
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["final_step"] == STEPS
    samples, expected = run.samples(), reference.samples()
    assert sorted(samples) == list(range(STEPS)) == sorted(expected)
    assert_samples_kept(samples, expected, steps_a_survivor_took_from_a_peer(run), STEPS, LOSS_RTOL)
    final = torch.load(run.run_dir / FINAL_STATE)
    fault_free = torch.load(reference.run_dir / FINAL_STATE)
    worst = max((final[name] - fault_free[name]).abs().max().item() for name in fault_free)
    assert worst <= PARAM_ATOL, f"parameters differ by up to {worst}"


def test_a_frozen_host_is_dropped_by_elastic_training_and_told_to_rejoin(reference_run: JobRun, hosts,
                                                                        tmp_path: Path) -> None:
    """SIGSTOP of node 1's process group, no spare: after the reschedule wait the job trains on
    without it (no job restart); when the host wakes up (SIGCONT) its old workers apply no step
    they had not decided on before the freeze, and its agent is sent back to say hello."""
    cluster = hosts(FROZEN_CHAIN, reschedule_wait=2.0,
                    script_args=[*STEP_SLEEP, "--final-state", str(tmp_path / "node0" / FINAL_STATE)])
    cluster.start(0)
    cluster.start(1)
    frozen_at = freeze_node1_after_a_few_steps(cluster)
    shrink = cluster.wait_for_event("elastic_shrink", lambda e: e.kind == ev.ELASTIC_SHRINK)
    woke_at = time.time()
    cluster.signal_host(1, signal.SIGCONT)
    code, output = cluster.wait(0)
    run = hosts_run(cluster, code, output, (0, 1))
    story = timeline(run.events, frozen_at)
    print(f"frozen at +0.00, woke at {woke_at - frozen_at:+.2f}\n{story}")
    assert code == 0, output + story
    node1_code, node1_output = cluster.wait(1, timeout=60)
    assert node1_code == 0, node1_output + story

    assert shrink.details["dropped_nodes"] == [1] and shrink.details["waited"] >= 2.0, story
    assert (shrink.details["old_world_size"], shrink.details["new_world_size"]) == (4, 2), story
    assert not run.kinds(ev.RESTART_BEGIN), story
    assert_lost_as_a_frozen_host(run, story)
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    recovered = {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED) if e.rank in (0, 1)}
    assert recovered == {0: first[0], 1: first[1]}, "survivors must keep their processes\n" + story
    [plan] = [e for e in run.kinds(ev.RECOVERY_PLAN) if e.generation == shrink.generation]
    assert_old_ranks_of_node1_were_silent(run, cluster, plan, stopped_by(frozen_at))
    # Woken up, node 1's agent was told to say hello again (its old workers stopped); the job may
    # then grow back at a step boundary (it did in every run seen, about 3 s after the wake-up).
    # Frozen from frozen_at to woke_at, the agent can only have said hello after the wake-up; the
    # event's time is the controller's clock (monotonic + an offset taken at its start), which a
    # step of the wall clock since then may put a few ms before this process's woke_at: compare
    # with the freeze, seconds away.
    assert [e for e in run.kinds(ev.AGENT_REGISTERED) if e.node == 1 and e.time > frozen_at], story
    for grow in run.kinds(ev.ELASTIC_GROW):
        assert (grow.details["old_world_size"], grow.details["new_world_size"]) == (2, 4), story
    assert not run.kinds(ev.PERSIST_FAILED), story
    assert_same_samples_and_close(run, reference_run)


def test_a_frozen_host_is_replaced_by_a_spare(reference_run: JobRun, hosts) -> None:
    """SIGSTOP of node 1's process group with a spare host: the spare takes its place (recover),
    the survivors keep their processes, the world size is unchanged and the final parameters
    equal the fault-free run's; woken up, node 1 joins as a spare and its old workers commit
    nothing."""
    cluster = hosts(FROZEN_CHAIN, reschedule_wait=2.0, script_args=STEP_SLEEP)
    cluster.start(0)
    cluster.start(1)
    cluster.start(2, spare=True)
    frozen_at = freeze_node1_after_a_few_steps(cluster)
    plan = cluster.wait_for_event("recovery_plan", lambda e: e.kind == ev.RECOVERY_PLAN)
    run, story, _ = wake_node1_and_finish(cluster, frozen_at)
    assert cluster.wait(2, timeout=60)[0] == 0, story
    node1_code, node1_output = cluster.wait(1, timeout=60)
    assert node1_code == 0, node1_output + story

    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run, story)
    assert plan.details["world_size"] == 4 and plan.details["receivers"] == [2, 3], story
    assert not run.kinds(ev.RESTART_BEGIN), story
    assert not run.kinds(ev.ELASTIC_SHRINK), story
    assert_lost_as_a_frozen_host(run, story)
    assert [e.details["spare"] for e in run.kinds(ev.STANDBY_ADOPT)] == [2], story
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    recovered = {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED)}
    assert recovered[0] == first[0] and recovered[1] == first[1], "survivors must keep their processes\n" + story
    assert recovered[2] != first[2] and recovered[3] != first[3], story
    assert_old_ranks_of_node1_were_silent(run, cluster, plan, stopped_by(frozen_at))
    assert not run.kinds(ev.PERSIST_FAILED), story
    [returned] = [e for e in run.kinds(ev.AGENT_REGISTERED) if e.details.get("returned_node") == 1]
    assert returned.details["standby"] and returned.time > frozen_at, story  # see the test above


def test_a_host_silent_while_its_ranks_start_is_not_lost(reference_run: JobRun, hosts) -> None:
    """A host's start (imports, process group, restore) is its CPU's busiest time, when its agent
    may wait a second for a core. SIGSTOP of node 1's process group for 1.5 s (past the 0.85 s a
    training host may be silent) after its ranks said ``starting`` and before their first step:
    the host is not taken for frozen, no fault, and the run ends bitwise equal to the fault-free one."""
    cluster = hosts([], script_args=["--start-sleep", "5"])
    cluster.start(0)
    cluster.start(1)
    cluster.wait_for_event("a starting heartbeat of node 1", lambda e: e.kind == ev.HEARTBEAT
                           and e.rank in (2, 3) and e.details.get("phase") == "starting")
    frozen_at = time.time()
    cluster.signal_host(1, signal.SIGSTOP)
    time.sleep(1.5)
    run, story, woke_at = wake_node1_and_finish(cluster, frozen_at)
    assert cluster.wait(1, timeout=60)[0] == 0, story
    # Node 1's ranks were still starting when it woke: their first beat from a step came after.
    stepping = [e.time for e in run.kinds(ev.HEARTBEAT) if e.rank in (2, 3) and e.details.get("phase") != "starting"]
    assert min(stepping) > woke_at - 0.05, story
    assert not run.kinds(ev.AGENT_LOST) and not run.kinds(ev.FAULT_DETECTED), story
    assert not run.kinds(ev.DECISION) and not run.kinds(ev.RESTART_BEGIN), story
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run, story)


def test_a_stopped_worker_on_a_real_host_is_seen_by_its_agent_and_recovered_in_place(
        reference_run: JobRun, hosts) -> None:
    """SIGSTOP of one worker (its host and agent running): the agent reads the process's state and
    reports it stopped, so the controller acts before ``heartbeat_timeout`` (here 4 s) would; that
    rank is replaced in place, the others keep their processes, and the final parameters equal the
    fault-free run's."""
    cluster = hosts(["--set", "process_recover=true", "--recover-strategy", "retry,recover-in-place"],
                    script_args=STEP_SLEEP)
    cluster.start(0)
    cluster.start(1)
    cluster.wait_for_event("rank 3 at step 5", lambda e: e.kind == ev.HEARTBEAT and e.rank == 3 and (e.step or 0) >= 5)
    pid = next(e.details["pid"] for e in cluster.events() if e.kind == ev.WORKER_READY and e.rank == 3)
    stopped_at = time.time()
    os.kill(pid, signal.SIGSTOP)
    code, output = cluster.wait(0)
    run = JobRun(code, output, cluster.run_dir(0), cluster.mark)
    story = timeline(run.events, stopped_at)
    assert code == 0, output + story
    assert cluster.wait(1, timeout=60)[0] == 0, story
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run, story)
    [fault] = run.kinds(ev.FAULT_DETECTED)
    assert fault.rank == 3 and "stopped" in fault.details["detail"], story
    assert run.kinds(ev.DECISION)[-1].details["strategy"] == "recover-in-place", story
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    recovered = {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED)}
    assert all(recovered[rank] == first[rank] for rank in (0, 1, 2)), story
    assert recovered[3] != first[3], story
