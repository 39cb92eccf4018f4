"""Nodes on hosts of their own: each node's `undying run` in its own network namespace, at its own
address, the hosts joined by a bridge (tests/faults/netns.py). Nothing can reach another node
through 127.0.0.1 here, so the controller, its store and the workers' process groups must all use
the addresses a cluster would; and a node's link can be cut, which loopback cannot show: its
processes live on but nothing of theirs arrives. The final parameters must equal the fault-free
run's (simulated nodes on loopback, same spec). Skipped where namespaces cannot be made."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import STEPS, JobRun, assert_ends_bitwise, wait_no_processes
from tests.faults.netns import PREFIX, NetnsUnavailable, Network, remove_leftovers, unavailable_reason
from tests.faults.test_real_hosts import (
    RECOVER,
    STEP_SLEEP,
    Hosts,
    assert_old_ranks_of_node1_were_silent,
    timeline,
)
from undying import events as ev
from undying.events import Event

pytestmark = [pytest.mark.faults,
              # The quick checks; a machine that refuses namespaces skips in the `network` fixture.
              pytest.mark.skipif(unavailable_reason() is not None, reason=f"no separate hosts: {unavailable_reason()}")]

CUT_AT_STEP = 5
# A cut long enough that TCP must retransmit: with its backoff (200 ms, then 400 ms) a segment sent
# as the link went down arrives 0.6 s later, and a node's silence then passes the default
# host_silence_timeout (0.85 s: the chaos soak's 0.5 s cuts were all taken for lost hosts). The
# test raises host_silence_timeout to 2 s, as a user expecting such outages would, and
# heartbeat_timeout from 4 s to 8 s so that no single rank's late beat acts either.
SHORT_CUT_S = 0.5
RIDE_OUT_SHORT_CUTS = ["--set", "heartbeat_timeout=8", "--set", "host_silence_timeout=2"]
# Listens on every address of its host, answering each connection with "up".
LISTENER = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
while True:
    connection, _ = server.accept()
    connection.sendall(b"up")
    connection.close()
"""
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0) as connection:
        sys.exit(0 if connection.recv(2) == b"up" else 1)
except OSError:
    sys.exit(1)
"""
PROBE_PORT = 47000  # the namespaces are fresh: nothing else listens there


@pytest.fixture
def network():
    try:
        made = Network(hosts=3)  # node 0 (controller), node 1, a spare
    except NetnsUnavailable as error:
        pytest.skip(f"no separate hosts: {error}")
    yield made
    made.close()


@pytest.fixture
def cluster_on(tmp_path: Path, network: Network):
    made: list[Hosts] = []

    def make(extra: list[str], **options) -> Hosts:
        made.append(Hosts(tmp_path, extra, network=network, **options))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()
    network.close()  # also whatever a cut-off host still runs
    for cluster in made:
        assert wait_no_processes(cluster.mark) == []


def reaches(network: Network, source: int, host: str) -> bool:
    """Whether a connection from host ``source`` to ``host``:PROBE_PORT is answered (1 s allowed)."""
    probe = [sys.executable, "-c", CONNECT, host, str(PROBE_PORT)]
    return subprocess.run(network.command(source, probe), timeout=30).returncode == 0


def test_hosts_meet_only_through_their_links_and_a_cut_one_carries_nothing(network: Network) -> None:
    """The harness itself: host 0 reaches host 1 at its address and not through loopback; a cut
    link answers nothing until it is restored; closing the network kills what ran on it and
    leaves no namespace behind."""
    listener = subprocess.Popen(network.command(1, [sys.executable, "-c", LISTENER, str(PROBE_PORT)]),
                                stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
        assert reaches(network, 0, network.address(1))
        assert not reaches(network, 0, "127.0.0.1")  # host 0's loopback is its own
        network.cut(1)
        assert not reaches(network, 0, network.address(1))
        network.restore(1)
        assert reaches(network, 0, network.address(1))
        assert network.pids(1) == [listener.pid]
    finally:
        network.close()
        listener.wait(timeout=10)
    assert listener.returncode == -signal.SIGKILL
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert network.tag not in left, left


def test_namespaces_of_a_crashed_run_are_removed_at_the_next_start(network: Network) -> None:
    """A namespace named for a process that no longer exists is deleted when a network is made."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"{PREFIX}-{gone.pid}-crashed-host0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in remove_leftovers()
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)
    assert network.switch in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def run_of(cluster: Hosts, node: int = 0, timeout: float = 180) -> JobRun:
    code, output = cluster.wait(node, timeout)
    return JobRun(code, output, cluster.run_dir(node), cluster.mark)


def cut_node1_after_a_few_steps(cluster: Hosts, network: Network) -> float:
    cluster.wait_for_event(f"heartbeat at step {CUT_AT_STEP}", lambda e: e.kind == ev.HEARTBEAT
                           and e.rank in (2, 3) and (e.step or 0) >= CUT_AT_STEP)
    cut_at = time.time()
    network.cut(1)
    return cut_at


def recovery_events(events: list[Event]) -> list[Event]:
    kinds = (ev.DECISION, ev.RECOVERY_BEGIN, ev.RECOVERY_PLAN, ev.RECOVERED, ev.RESTART_BEGIN, ev.AGENT_LOST,
             ev.STEP_FAILED, ev.ELASTIC_SHRINK)
    return [event for event in events if event.kind in kinds]


def test_a_job_across_separate_hosts_matches_the_loopback_run(reference_run: JobRun, cluster_on,
                                                              network: Network) -> None:
    """Node 0 (controller and store bound to its own address) and node 1 on separate hosts: the
    job trains as on one machine and ends with the same parameters."""
    cluster = cluster_on([])
    cluster.start(0)
    cluster.start(1)
    run = run_of(cluster)
    assert run.returncode == 0, run.output + run.logs()
    assert cluster.wait(1, timeout=60)[0] == 0
    [start] = run.kinds(ev.JOB_START)
    assert start.details["controller"] == f"{network.address(0)}:{cluster.port}", start.details
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run)
    assert not recovery_events(run.events), [e.kind for e in recovery_events(run.events)]


def test_a_host_cut_off_for_good_is_replaced_by_a_spare(reference_run: JobRun, cluster_on,
                                                        network: Network) -> None:
    """Node 1's link goes down and stays down, its processes alive: the controller hears nothing
    more from it (no connection closes), a spare host takes its place, the survivors keep their
    processes and the final parameters equal the fault-free run's."""
    cluster = cluster_on(RECOVER, reschedule_wait=2.0, script_args=STEP_SLEEP)
    cluster.start(0)
    cluster.start(1)
    cluster.start(2, spare=True)
    cut_at = cut_node1_after_a_few_steps(cluster, network)
    cut_by = time.time()  # node 1's link is down by now (its processes run on, cut off)
    run = run_of(cluster)
    story = timeline(run.events, cut_at)
    print(story)
    assert run.returncode == 0, run.output + run.logs() + story
    assert cluster.wait(2, timeout=60)[0] == 0, story
    assert network.pids(1), "node 1 was cut off, not killed: its processes must still run"

    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run, story)
    assert not run.kinds(ev.RESTART_BEGIN), story
    assert run.kinds(ev.DECISION)[-1].details["strategy"] == "recover", story
    [lost] = [e for e in run.kinds(ev.AGENT_LOST) if e.node == 1]
    assert "connection closed" not in lost.details["why"], story
    assert [e.details["spare"] for e in run.kinds(ev.STANDBY_ADOPT)] == [2], story
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    recovered = {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED)}
    assert recovered[0] == first[0] and recovered[1] == first[1], "survivors must keep their processes\n" + story
    assert recovered[2] != first[2] and recovered[3] != first[3], story
    [plan] = run.kinds(ev.RECOVERY_PLAN)
    assert plan.details["receivers"] == [2, 3], story
    assert_old_ranks_of_node1_were_silent(run, cluster, plan, cut_by)


def test_a_partition_that_heals_before_any_timeout(reference_run: JobRun, cluster_on, network: Network) -> None:
    """Node 1's link goes down for less than the job's ``host_silence_timeout`` (raised to 2 s),
    then comes back: TCP retransmits what was dropped and the job goes on, with no recovery, every
    worker in its first process, and the final parameters equal to the fault-free run's."""
    cluster = cluster_on([*RECOVER, *RIDE_OUT_SHORT_CUTS], script_args=STEP_SLEEP)
    cluster.start(0)
    cluster.start(1)
    cut_at = cut_node1_after_a_few_steps(cluster, network)
    time.sleep(SHORT_CUT_S)
    network.restore(1)
    run = run_of(cluster)
    story = timeline(run.events, cut_at)
    print(story)
    assert run.returncode == 0, run.output + run.logs() + story
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run, story)
    assert run.kinds(ev.DECISION) == [] and run.kinds(ev.AGENT_LOST) == [], story
    assert recovery_events(run.events) == [], story
    first = [e.rank for e in run.kinds(ev.WORKER_READY)]
    assert sorted(first) == [0, 1, 2, 3], story  # one generation, no worker started twice
    node1_code, node1_output = cluster.wait(1, timeout=60)
    assert node1_code == 0, node1_output + story
