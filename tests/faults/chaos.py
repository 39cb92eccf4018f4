"""A chaos soak: one long job on separate hosts, faults of every kind drawn from a seed, and at the end
the fault-free run's state on every rank with nothing left behind.

Runs in the test (or benchmark) process; the job runs as real hosts (tests/faults/test_real_hosts.py
``Hosts``: one ``undying run --node-rank`` per node and per spare, each in a network namespace of
its own where the machine allows it, tests/faults/netns.py). The faults:

- injected ones, fired by the workers (``--inject``): ``kill``, ``hang``, ``raise``, ``stall`` at a
  step's start, the same kinds at the three points inside the step (``@allreduce``,
  ``@after_vote``, ``@optimizer``), ``node`` (the host serving node 1 killed), a kill with a second
  kill during its recovery (``kill+recovery``), and a kill in the background persister while it
  writes a checkpoint (``kill@persist``);
- the harness's own: ``leave`` (SIGTERM to node 1's ``undying run``, a drained pod: a planned
  leave) and ``partition`` (node 1's host cut off from the network, for less than any detection
  needs, or long enough to be replaced, then healed).

Node 0 hosts the controller and is never a node-level target (its loss ends a job without
``--etcd``). Faults come at distinct steps, ``spacing`` apart at least (node-level ones
``node_spacing`` apart: a spare must be warm again), so that a step commits between two of them:
the crash-loop guard (``crash_loop_limit``, 3 by default) is left as it is. Each lost host is
replaced by a new spare (a rescheduled pod), so that one is always waiting. What must hold at the
end: the job succeeded, every planned fault fired, every rank's parameters, optimizer state and RNG
equal the fault-free run's, no process of the job is left, nor its ``/dev/shm`` directory, nor a
partial checkpoint or temporary file, nor a namespace of the run. The table of faults, strategies
and MTTRs: tests/faults/chaos_table.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import JobRun, run_job, wait_no_processes
from tests.faults.netns import Network
from tests.faults.test_real_hosts import Hosts
from undying import events as ev
from undying.events import Event
from undying.shm import job_dir

# Bitwise recoveries only: elastic training, which changes the summation order, is left out.
CHAIN = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
         "--recover-strategy", "retry,recover-in-place,recover,dump"]
SOAK_SETTINGS = [
    # A stalled training thread is caught after this long without a committed step.
    "--set", "step_timeout=10",
    # The spec's default instead of the fault tests' 4 s: a replacement forked on a loaded machine
    # from a spare's standby that is still importing can go quiet for seconds.
    "--set", "heartbeat_timeout=10",
]
CHECKPOINT_INTERVAL = 25  # steps between T2 checkpoints (``kill@persist`` lands on one)
SCRIPT_ARGS = ["--dropout", "0.1", "--bucket-cap-mb", "0.05"]  # RNG drawn every step; five buckets
INJECTED = ("kill", "hang", "raise", "stall",
            "kill@allreduce", "hang@allreduce", "raise@allreduce",
            "kill@after_vote", "hang@after_vote", "raise@after_vote",
            "kill@optimizer", "hang@optimizer", "raise@optimizer",
            "kill+recovery", "kill@persist", "node")
HARNESS = ("leave", "partition")
NODE_LEVEL = ("node", "leave", "partition")
KINDS = INJECTED + HARNESS
WORLD, NODES = 4, 2
SHORT_CUT_S, LONG_CUT_S = 0.5, 5.0  # a partition healed before any detection, or after the host is lost
RUN_DIR_ENTRIES = {"events.jsonl", "result.json", "logs", "samples", "final_state.pt"}


@dataclass(frozen=True)
class Fault:
    """One fault of the plan: at ``step`` (an injected one when its rank reaches it; the harness's
    once a heartbeat says the job did), its ``--inject`` specs, or for the harness's the node it hits
    and, for a partition, how long the link stays down."""

    step: int
    kind: str
    specs: tuple[str, ...] = ()
    node: int | None = None
    seconds: float = 0.0

    def label(self) -> str:
        if self.kind == "partition":
            return f"partition {self.seconds:g} s"
        return self.kind


def draw_plan(seed: int, steps: int, kinds: tuple[str, ...] = KINDS, first: int = 12, spacing: int = 12,
              node_spacing: int = 60, checkpoint_interval: int = CHECKPOINT_INTERVAL) -> list[Fault]:
    """Faults from ``first`` to ``steps - spacing``, each ``spacing`` to ``2 * spacing`` steps after the
    last (node-level ones ``node_spacing`` after the last node-level one), their kinds dealt from
    a deck of ``kinds`` shuffled with ``seed`` (reshuffled when used up: every kind comes as often),
    ranks drawn with it too."""
    draw = random.Random(seed)
    deck: list[str] = []
    plan: list[Fault] = []
    step, last_node_level = first, -node_spacing
    while step < steps - spacing:
        if not deck:
            deck = list(kinds)
            draw.shuffle(deck)
        kind = deck.pop()
        if kind in NODE_LEVEL and step - last_node_level < node_spacing:
            deck.insert(0, kind)  # later, when a spare is warm again
            if all(k in NODE_LEVEL for k in deck):
                step += spacing
            continue
        if kind in NODE_LEVEL:
            last_node_level = step
        fault = _fault(kind, step, draw, checkpoint_interval)
        if fault.step >= steps - spacing:
            break  # a kill@persist whose checkpoint comes too late (the last one is the job's end)
        plan.append(fault)
        step = fault.step + spacing + draw.randrange(spacing)  # kill@persist waits for its checkpoint step
    return plan


def _fault(kind: str, step: int, draw: random.Random, checkpoint_interval: int) -> Fault:
    rank = draw.randrange(WORLD)
    if kind == "node":
        return Fault(step, kind, (f"node:node=1:step={step}",), node=1)
    if kind == "leave":
        return Fault(step, kind, node=1)
    if kind == "partition":
        return Fault(step, kind, node=1, seconds=draw.choice((SHORT_CUT_S, LONG_CUT_S)))
    if kind == "kill+recovery":
        # A kill at the step's start is recovered to that step; a second rank dies as it starts its part.
        other = draw.choice([r for r in range(WORLD) if r != rank])
        return Fault(step, kind, (f"kill:rank={rank}:step={step}", f"kill:rank={other}:step={step}:at=recovery"))
    if kind == "kill@persist":
        checkpoint = -(-step // checkpoint_interval) * checkpoint_interval  # the next checkpoint step
        return Fault(checkpoint, kind, (f"kill:rank={rank}:step={checkpoint}:at=persist",))
    fault_kind, _, point = kind.partition("@")
    return Fault(step, kind, (f"{fault_kind}:rank={rank}:step={step}" + (f":at={point}" if point else ""),))


@dataclass
class Host:
    """One `undying run` of the soak: its index (and namespace), and what it does now."""

    index: int
    spare: bool


@dataclass
class Soak:
    """The outcome: the job's run, the plan, when each harness fault acted, the hosts started."""

    run: JobRun
    plan: list[Fault]
    controller_port: int
    acted: dict[int, float] = field(default_factory=dict)  # plan index -> when the harness acted
    hosts_started: int = 0
    stragglers: list[int] = field(default_factory=list)  # hosts still running after the job ended
    seconds: float = 0.0


class ChaosCluster(Hosts):
    """``Hosts`` with spares kept in stock and the harness's faults carried out as the job goes."""

    def __init__(self, root: Path, plan: list[Fault], steps: int, spares: int, network: Network | None,
                 checkpoint_interval: int) -> None:
        specs = [spec for fault in plan for spec in fault.specs]
        super().__init__(root, [*CHAIN, *SOAK_SETTINGS, "--checkpoint-interval", str(checkpoint_interval),
                                *(arg for spec in specs for arg in ("--inject", spec))],
                         script_args=[*SCRIPT_ARGS, "--steps", str(steps),
                                      "--final-state", str(root / "node0" / "final_state.pt")],
                         network=network)
        self.plan, self.steps, self.spares = plan, steps, spares
        self.hosts: dict[int, Host] = {}
        self._events_read = 0
        self._events: list[Event] = []
        self.cut: dict[int, float] = {}  # host index -> when its link comes back (time.monotonic)
        self.output: dict[int, list[str]] = {}  # host index -> its console lines so far
        self.readers: dict[int, threading.Thread] = {}

    def start(self, node: int, spare: bool = False) -> None:
        super().start(node, spare)
        self.hosts[node] = Host(node, spare)
        # Read as it comes: over thousands of steps a host's console would fill its pipe and block.
        process = self.processes[node]
        self.output[node] = []
        self.readers[node] = threading.Thread(target=_drain, args=(process, self.output[node]), daemon=True)
        self.readers[node].start()

    def finished(self, node: int, timeout: float) -> tuple[int | None, str]:
        """Wait up to ``timeout`` for a host's `undying run` to end: its exit code (None if it did
        not) and everything it printed."""
        try:
            self.processes[node].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, "".join(self.output[node])
        self.readers[node].join(timeout=10)
        return self.processes[node].returncode, "".join(self.output[node])

    def new_events(self) -> list[Event]:
        """The controller's events since the last call (the log is read on from where it was)."""
        path = self.run_dir(0) / ev.EVENTS_FILE
        if not path.exists():
            return []
        with open(path) as log:
            log.seek(self._events_read)
            text = log.read()
        complete = text[:text.rfind("\n") + 1]
        self._events_read += len(complete.encode())
        fresh = [Event.from_dict(json.loads(line)) for line in complete.splitlines() if line.strip()]
        self._events.extend(fresh)
        return fresh

    def events_seen(self) -> list[Event]:
        return self._events

    def host_of(self, node: int) -> int | None:
        """The host whose agent serves ``node`` now (its latest hello as that node, not as a spare)."""
        serving = None
        pids = {process.pid: index for index, process in self.processes.items()}
        for event in self._events:
            if event.kind == ev.AGENT_REGISTERED and event.node == node and not event.details.get("standby"):
                serving = pids.get(int(event.details.get("pid") or 0))
        return serving

    def live_spares(self) -> int:
        """Hosts alive whose latest hello was as a spare."""
        latest: dict[int, bool] = {}
        for event in self._events:
            if event.kind == ev.AGENT_REGISTERED:
                latest[int(event.details.get("pid") or 0)] = bool(event.details.get("standby"))
        return sum(1 for index, process in self.processes.items()
                   if process.poll() is None and index not in self.cut
                   and latest.get(process.pid, self.hosts[index].spare))


def soak(root: Path, plan: list[Fault], steps: int, spares: int = 2, network: Network | None = None,
         timeout: float = 3600, checkpoint_interval: int = CHECKPOINT_INTERVAL) -> Soak:
    """Run the job with ``plan``'s faults and ``spares`` spares kept in stock; returns when node 0's
    `undying run` (the controller) has ended and every other host has, or was stopped."""
    root.mkdir(parents=True, exist_ok=True)
    cluster = ChaosCluster(root, plan, steps, spares, network, checkpoint_interval)
    outcome = Soak(JobRun(-1, "", cluster.run_dir(0), cluster.mark), plan, cluster.port)
    started = time.monotonic()
    try:
        for index in range(NODES):
            cluster.start(index)
        for index in range(NODES, NODES + spares):
            cluster.start(index, spare=True)
        next_host = NODES + spares
        harness = [(i, fault) for i, fault in enumerate(plan) if fault.kind in HARNESS]
        step, ended = 0, False
        while cluster.processes[0].poll() is None:
            if time.monotonic() - started > timeout:
                raise AssertionError(f"the soak did not end in {timeout} s")
            for event in cluster.new_events():
                if event.kind == ev.HEARTBEAT and event.step is not None:
                    step = max(step, event.step)
                ended = ended or event.kind == ev.JOB_END
            now = time.monotonic()
            for index, back_at in list(cluster.cut.items()):
                if now >= back_at and network is not None:
                    network.restore(index)
                    del cluster.cut[index]
            while harness and step >= harness[0][1].step:
                position, fault = harness.pop(0)
                host = cluster.host_of(fault.node or 1)
                if host is None or cluster.processes[host].poll() is not None:
                    harness.insert(0, (position, fault))  # node 1 is being recovered: act once it is back
                    break
                outcome.acted[position] = time.time()
                if fault.kind == "leave":
                    os.kill(cluster.processes[host].pid, signal.SIGTERM)
                elif network is not None:
                    network.cut(host)
                    cluster.cut[host] = time.monotonic() + fault.seconds
            if not ended and cluster.live_spares() < spares and (network is None or next_host < len(network.hosts)):
                cluster.start(next_host, spare=True)  # a rescheduled pod takes the lost host's place
                next_host += 1
            time.sleep(0.1)
        if network is not None:
            for index in list(cluster.cut):
                network.restore(index)
        code, output = cluster.finished(0, timeout=60)
        cluster.new_events()
        registered = {event.details.get("pid") for event in cluster.events_seen() if event.kind == ev.AGENT_REGISTERED}
        for index, process in cluster.processes.items():
            if index == 0 or process.poll() is not None:
                continue
            if process.pid not in registered:
                # A spare pod started as the job ended, before its hello: torn down with the job, as an
                # operator does (it would give up on its own after node_return_timeout).
                process.send_signal(signal.SIGTERM)
            cluster.finished(index, timeout=60)  # a host that joined ends once the job has; else reported
        outcome.run = JobRun(-1 if code is None else code, output, cluster.run_dir(0), cluster.mark)
        outcome.hosts_started = next_host
        outcome.stragglers = [index for index, process in cluster.processes.items() if process.poll() is None]
    finally:
        cluster.close()
        outcome.seconds = time.monotonic() - started
    return outcome


def _drain(process: subprocess.Popen, lines: list[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)


def hosts_needed(plan: list[Fault], spares: int) -> int:
    """How many hosts (namespaces) ``plan`` may use: the nodes, the spares, and one more per
    node-level fault (each host it takes is replaced by a fresh spare)."""
    return NODES + spares + sum(1 for fault in plan if fault.kind in NODE_LEVEL)


def assert_nothing_left(soak_run: Soak, roots: list[Path], store_port: int | None, network: Network | None) -> None:
    """No process of the job, no /dev/shm directory of it, no partial checkpoint or temporary file,
    no host that outlived the job; on loopback, its ports (the controller's, the store's) free
    again (in namespaces they went with the namespaces: the caller checks those are gone)."""
    run = soak_run.run
    assert soak_run.stragglers == [], f"hosts still running after the job ended: {soak_run.stragglers}"
    assert wait_no_processes(run.mark, timeout=30) == [], "processes of the job left behind"
    [start] = run.kinds(ev.JOB_START)
    shm = job_dir(start.details["job_id"])
    assert not shm.exists(), f"{shm} left behind: {sorted(p.name for p in shm.rglob('*'))}"
    stray = []
    for root in roots:
        for path in root.rglob("*"):
            if path.name.endswith((".partial", ".tmp")) or ".partial" in path.parts[-2:] or ".tmp." in path.name:
                stray.append(str(path))
    assert not stray, f"stray files: {stray[:10]}"
    for run_dir in [root for root in roots if (root / ev.EVENTS_FILE).exists() or root.name.startswith("node")]:
        unexpected = sorted(entry.name for entry in run_dir.iterdir() if entry.name not in RUN_DIR_ENTRIES)
        assert not unexpected, f"{run_dir}: unexpected entries {unexpected}"
    if network is None:
        for port in (soak_run.controller_port, store_port):
            if port is not None:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))  # raises if a listener of the job still holds it


def not_fired(soak_run: Soak) -> list[str]:
    """The plan's faults that never happened: injections never claimed (the ``injection`` events are
    the claims) and harness faults never carried out (the job ended first)."""
    claimed = {event.details["spec"] for event in soak_run.run.kinds(ev.INJECTION)}
    missing = [spec for fault in soak_run.plan for spec in fault.specs if spec not in claimed]
    return missing + [f"{fault.label()} at step {fault.step}" for position, fault in enumerate(soak_run.plan)
                      if fault.kind in HARNESS and position not in soak_run.acted]


def reference(root: Path, steps: int, checkpoint_interval: int = CHECKPOINT_INTERVAL) -> JobRun:
    """The fault-free run of the soak's job (simulated nodes on loopback: the same bits)."""
    run = run_job(root, [*SOAK_SETTINGS, "--checkpoint-interval", str(checkpoint_interval)], steps=steps,
                  timeout=max(240.0, steps * 2.0),
                  script_args=[*SCRIPT_ARGS, "--final-state", str(root / "final_state.pt")])
    assert run.returncode == 0, run.output + run.logs()
    return run


__all__ = ["CHECKPOINT_INTERVAL", "HARNESS", "KINDS", "NODE_LEVEL", "Fault", "Soak", "assert_nothing_left",
           "draw_plan", "hosts_needed", "not_fired", "reference", "soak"]
