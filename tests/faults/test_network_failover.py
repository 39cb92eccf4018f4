"""Controller failover across separate hosts: each node's `undying run --etcd` in its own network
namespace (tests/faults/netns.py), etcd on a host of its own, so the leader's controller, its store,
the backup store and every worker's group must be reached at the hosts' addresses, never through
127.0.0.1. SIGKILL of the controller node's whole process group: another host's candidate takes
over, a spare host takes the lost node's place, the final parameters equal the fault-free run's.
test_controller_failover.py is the same job on loopback. Skipped where namespaces cannot be made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import (
    BASE_ARGS,
    EXAMPLE,
    MARK_ENV,
    REPO,
    STEPS,
    JobRun,
    assert_ends_bitwise,
    etcd_binary,
    undying_command,
    wait_no_processes,
)
from tests.faults.netns import NetnsUnavailable, Network, unavailable_reason
from tests.faults.test_controller_failover import PROCESS_LEVEL, SCRIPT_ARGS, TOKEN, missed_rng_reads
from tests.faults.test_real_hosts import STEP_SLEEP, timeline
from undying import events as ev
from undying.events import Event, read_events

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(unavailable_reason() is not None, reason=f"no separate hosts: {unavailable_reason()}")]

NODES = 3  # node 0 (the first leader, ranks 0-1), node 1 (ranks 2-3), node 2 (a spare); node i on host i
ETCD_HOST = NODES  # etcd's own host, after the nodes'
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380  # the namespaces are fresh: nothing else listens there
KILL_AT_STEP = 5
# Asks etcd from inside a host until it answers (argv: endpoint, seconds): the test process is in
# the machine's own namespace and cannot reach the hosts' subnet.
ETCD_READY = """
import sys, time
from undying.etcd import EtcdClient, EtcdUnavailable
deadline = time.monotonic() + float(sys.argv[2])
client = EtcdClient(sys.argv[1])
while True:
    try:
        client.get("/health-probe")
        sys.exit(0)
    except EtcdUnavailable:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.2)
"""


@pytest.fixture
def network(tmp_path: Path):
    """The nodes' hosts and etcd's, etcd serving on its host's address; closing the network kills
    everything that ran in it, etcd included."""
    binary = etcd_binary()
    try:
        made = Network(hosts=NODES + 1)
    except NetnsUnavailable as error:
        pytest.skip(f"no separate hosts: {error}")
    etcd: subprocess.Popen | None = None
    try:
        etcd = start_etcd(made, binary, tmp_path / "etcd")
        yield made
    finally:
        made.close()
        if etcd is not None:
            etcd.wait(timeout=10)


def etcd_endpoint(network: Network) -> str:
    return f"{network.address(ETCD_HOST)}:{ETCD_CLIENT_PORT}"


def start_etcd(network: Network, binary: str, data: Path) -> subprocess.Popen:
    """etcd on its own host, serving at ``etcd_endpoint``, once a node's host gets its answer."""
    data.mkdir()
    client, peer = etcd_endpoint(network), f"{network.address(ETCD_HOST)}:{ETCD_PEER_PORT}"
    with open(data / "etcd.log", "wb") as log:
        etcd = subprocess.Popen(network.command(ETCD_HOST, [
            binary, "--name", "undying-test", "--data-dir", str(data / "data"),
            "--listen-client-urls", f"http://{client}", "--advertise-client-urls", f"http://{client}",
            "--listen-peer-urls", f"http://{peer}", "--initial-advertise-peer-urls", f"http://{peer}",
            "--initial-cluster", f"undying-test=http://{peer}"]), stdout=log, stderr=subprocess.STDOUT)
    # Asked from a node's host: the way every candidate, agent and worker will reach it.
    probe = network.command(0, [sys.executable, "-c", ETCD_READY, client, "30"])
    if subprocess.run(probe, cwd=REPO, timeout=60).returncode != 0:
        raise AssertionError(f"etcd did not answer on {client}: {(data / 'etcd.log').read_text()[-2000:]}")
    return etcd


def start_node(network: Network, run_dir: Path, job: str, node: int, mark: str) -> subprocess.Popen:
    """Node ``node``'s `undying run --etcd` on host ``node``, its controller candidate and store
    bound to that host's address; its own session, so its process group is the whole node."""
    token_file = run_dir / "token"
    token_file.write_text(TOKEN)
    spare = ["--standby", "1"] if node >= 2 else []
    command = undying_command(["run", *BASE_ARGS, "--run-dir", str(run_dir), "--node-rank", str(node),
                               "--etcd", etcd_endpoint(network), "--job-name", job, "--lease-ttl", "2",
                               "--controller-bind", network.address(node), "--token-file", str(token_file),
                               *spare, *PROCESS_LEVEL, str(EXAMPLE), "--steps", str(STEPS),
                               *SCRIPT_ARGS, *STEP_SLEEP])
    env = dict(os.environ, **{MARK_ENV: mark, "PYTHONUNBUFFERED": "1"})
    with open(run_dir / f"node{node}.out", "w") as log:
        return subprocess.Popen(network.command(node, command), env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=REPO, start_new_session=True)


def wait_for(run_dir: Path, what: str, found: Callable[[Event], bool],
             processes: dict[int, subprocess.Popen], timeout: float = 120) -> Event:
    """The first event ``found`` accepts, once the job's event log holds it; fails if a node exits."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        events = read_events(run_dir) if (run_dir / ev.EVENTS_FILE).exists() else []
        match = next((event for event in events if found(event)), None)
        if match is not None:
            return match
        exited = {node: process.returncode for node, process in processes.items() if process.poll() is not None}
        assert not exited, f"node(s) exited while waiting for {what}: {exited}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout} s")


def test_killed_controller_host_fails_over_to_another_host(dropout_reference: JobRun, network: Network,
                                                           tmp_path: Path) -> None:
    """SIGKILL of node 0's process group (controller, its store, agent, ranks 0-1: everything on
    its host) mid-training: a candidate on another host leads from the state saved in etcd, at its
    own address; the spare host takes node 0's ranks, ranks 2-3 keep their processes and meet the
    new generation in the new leader's store; the final parameters equal the fault-free run's."""
    job, mark = f"test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    processes = {0: start_node(network, tmp_path, job, 0, mark)}
    try:
        wait_for(tmp_path, "node 0 leading", lambda e: e.kind == ev.CONTROLLER_LEADER and e.node == 0, processes)
        for node in range(1, NODES):
            processes[node] = start_node(network, tmp_path, job, node, mark)
        wait_for(tmp_path, f"heartbeat at step {KILL_AT_STEP}", lambda e: e.kind == ev.HEARTBEAT
                 and e.rank in (2, 3) and e.generation == 1 and (e.step or 0) >= KILL_AT_STEP, processes)
        os.killpg(processes[0].pid, signal.SIGKILL)
        codes = {node: process.wait(timeout=240) for node, process in processes.items()}
        node0_left = network.pids(0)
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    output = "\n".join(f"===== node{n}.out\n{(tmp_path / f'node{n}.out').read_text()[-3000:]}" for n in processes)
    assert not wait_no_processes(mark), "processes left behind"
    run = JobRun(codes[1], output, tmp_path, mark)
    [takeover] = run.kinds(ev.CONTROLLER_TAKEOVER)
    story = timeline(run.events, takeover.time)
    print(story)
    assert codes[0] == -signal.SIGKILL and node0_left == [], output
    assert codes[1] == 0 and codes[2] == 0, output + run.logs() + story
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, dropout_reference, story)

    # One takeover, by a candidate on another host, reached at that host's address.
    leaders = run.kinds(ev.CONTROLLER_LEADER)
    assert [(e.node, e.details["resumed"]) for e in leaders][:1] == [(0, False)], story
    assert [e.details["resumed"] for e in leaders] == [False, True], story
    new = leaders[1]
    assert new.node in (1, 2), story
    assert new.details["controller"].startswith(f"{network.address(new.node)}:"), new.details
    assert new.details["store"].startswith(f"{network.address(new.node)}:"), new.details
    assert takeover.details["previous_state"] == "running", story
    # The running generation went on: node 0 recovered onto the spare, no job restart.
    assert not run.kinds(ev.RESTART_BEGIN), story
    assert [(e.node, e.details["spare"]) for e in run.kinds(ev.STANDBY_ADOPT)] == [(0, 2)], story
    plan = run.kinds(ev.RECOVERY_PLAN)[-1]
    assert plan.details["strategy"] == "recover" and sorted(plan.details["receivers"]) == [0, 1], story
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    recovered = {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED) if e.generation == plan.generation}
    assert recovered[2] == first[2] and recovered[3] == first[3], "survivors must keep their processes\n" + story
    assert recovered[0] != first[0] and recovered[1] != first[1], story
    moved = {e.rank: e.details["store"] for e in run.kinds(ev.STORE_MOVED)}
    assert set(moved) == {2, 3} and set(moved.values()) == {new.details["store"]}, story
    # Ranks 0 and 1 resumed with their exact RNG state, from the backup store on another host.
    assert not missed_rng_reads(run.events), story
