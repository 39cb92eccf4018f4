"""Control-plane scale benchmark: the controller's job machine at 1k-16k ranks, by simulation.

Drives the real ``JobMachine`` (controller/machine.py) directly, on a fake clock, with
simulated agents (8 ranks per node, one spare node) and workers that speak its protocol:
hellos, long polls, immediate exit reports, heartbeats, check-ins and the loop's ticks. No
HTTP, no threads, no event log: what it measures is the machine's CPU alone (see
docs/benchmarks.md, "The control plane at scale", for what that leaves out). Each rank count
runs in its own process, so its RSS growth is the job's alone.

- steady: every rank beats every ``heartbeat_interval``, every agent polls every
  ``monitor_interval`` (spec defaults: 1 s, 5 s), the loop ticks every TICK and at once after a
  call the shell counts as news (``core.wakes_loop``); training commits a step per job-second.
  Controller CPU per job-second, per kind of call; and the calls that woke the loop (each one a
  tick) under the shell's earlier rule (every poll; every call that logged an event, heartbeats
  included), with that many ticks' CPU at the measured cost of one.
- in-place: one rank SIGKILLed (its agent reports the exit at once); recover-in-place. CPU from
  the report to the decision, and to every survivor and the newcomer holding its plan.
- lost node: a node's agent connection closes (its host died); after the disconnect grace the
  node is lost, a spare adopts its place, its 8 ranks restart (recover).
- memory: RSS growth and tracemalloc's count for a running job.

    python bench/scale.py --ranks 1024 4096 16384 --out bench/results/scale.json
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from scale_table import table  # noqa: E402 (bench/, beside this script)

from undying.config import JobSpec  # noqa: E402
from undying.controller.core import TICK, News, wakes_loop  # noqa: E402
from undying.controller.deadlines import DISCONNECT_GRACE  # noqa: E402
from undying.controller.machine import JobMachine  # noqa: E402
from undying.controller.membership import NodeRecord  # noqa: E402
from undying.controller.server import PlanReplies  # noqa: E402
from undying.controller.state import JobState  # noqa: E402
from undying.protocol import (  # noqa: E402
    AgentHello,
    AgentPoll,
    Heartbeat,
    Order,
    OrderKind,
    Phase,
    Plan,
    PlanAction,
    RecoverRequest,
    WorkerState,
    WorkerStatus,
)

NPROC = 8
STORE = "127.0.0.1:29500"
AGENT_PID, WORKER_PID, NEWCOMER_PID = 100_000, 200_000, 400_000
STEP_SECONDS = 1.0  # training commits a step per job-second
T = TypeVar("T")


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class SimulatedJob:
    """A job machine and the agents and workers around it; every call is timed in CPU seconds."""

    def __init__(self, ranks: int) -> None:
        self.spec = JobSpec(nnodes=ranks // NPROC, nproc_per_node=NPROC, process_recover=True,
                            recover_strategy=["recover-in-place", "recover"], pod_rescheduling="on")
        self.ranks = ranks
        self.nnodes = ranks // NPROC
        self.spare = -1  # the idle spare agent's node id
        self.now = 0.0
        self.machine = JobMachine(self.spec, "bench-scale", STORE, now=self.now)
        self.events = 0  # events the shell would write to the job's log
        self.spawned = [1] * ranks  # the generation each rank's process was started in (agents report it)
        self.generation = [1] * ranks  # the generation each rank trains in (heartbeats carry it)
        self.agents = {node: (AGENT_PID + node, f"host{node}") for node in range(self.nnodes)}  # pid, host

    def call(self, observation: Callable[[float], T]) -> T:
        """One observation, its effects taken as the shell takes them."""
        result = observation(self.now)
        self.events += len(self.machine.take_effects().events)
        return result

    def timed(self, observations: list[Callable[[float], Any]]) -> float:
        start = time.thread_time()
        for observation in observations:
            self.call(observation)
        return time.thread_time() - start

    def tick(self) -> float:
        return self.timed([self.machine.tick])

    # ------------------------------------------------------------ agents and workers

    def statuses(self, node: int) -> list[dict[str, Any]]:
        return [WorkerStatus(rank, rank - node * NPROC, WORKER_PID + rank, self.spawned[rank],
                             WorkerState.RUNNING).to_dict() for rank in range(node * NPROC, (node + 1) * NPROC)]

    def poll(self, node: int) -> Callable[[float], Any]:
        """A long poll that ends (its order taken) and the next that starts at once: one poll cycle."""
        report, take_order = self.poll_calls(node)

        def cycle(now: float) -> Any:
            record = report(now)
            return None if record is None else take_order(now)
        return cycle

    def poll_calls(self, node: int) -> tuple[Callable[[float], Any], Callable[[float], Any]]:
        """One poll cycle as the shell makes it: two calls (the report, and the order taken)."""
        pid, host = self.agents[node]
        poll = AgentPoll(node, max(self.spawned[node * NPROC:(node + 1) * NPROC]), self.statuses(node),
                         wait=self.spec.monitor_interval, pid=pid, hostname=host)
        return (lambda now: self.machine.agent_report(now, poll),
                lambda now: self.machine.take_order(now, self.machine.membership.nodes[node]))

    def agent_beat(self, node: int) -> Callable[[float], Any]:
        """An agent's beat (agent/workers.py): a report with no statuses, on a connection of its own."""
        pid, host = self.agents[node]
        beat = AgentPoll(node, max(self.spawned[node * NPROC:(node + 1) * NPROC]), [], wait=0.0, pid=pid,
                         hostname=host)
        return lambda now: self.machine.agent_report(now, beat)

    def take_order(self, node: int) -> Any:
        """A held poll woken by an order: the agent leaves with it."""
        record = self.machine.membership.nodes[node]
        return self.call(lambda now: self.machine.take_order(now, record))

    def beat(self, rank: int, step: int) -> Callable[[float], Any]:
        beat = Heartbeat(rank, rank // NPROC, self.generation[rank], step, Phase.COMPUTING, WORKER_PID + rank)
        return lambda now: self.machine.heartbeat(now, beat)

    def add_spare(self) -> None:
        """A spare agent (``undying run --standby``) joins: it holds no ranks until it adopts a node."""
        self.spare = self.machine.membership.reserve_spare_id()
        assert self.call(lambda now: self.machine.hello(
            now, AgentHello(self.spare, AGENT_PID + self.spare, f"spare{self.spare}", NPROC, standby=True))).accepted

    def start(self) -> None:
        """Every agent (and the spare) says hello, the loop starts generation 1, every rank beats."""
        for node in range(self.nnodes):
            assert self.call(lambda now, n=node: self.machine.hello(
                now, AgentHello(n, AGENT_PID + n, f"host{n}", NPROC))).accepted
        self.add_spare()
        self.call(self.machine.tick)
        assert self.machine.state is JobState.RUNNING
        for node in range(self.nnodes):
            assert self.take_order(node).kind == OrderKind.START
            self.call(self.poll(node))
        for rank in range(self.ranks):
            self.call(self.beat(rank, 0))

    # ------------------------------------------------------------ steady state

    def run_steady(self, seconds: float, silent: int = -1) -> dict[str, float]:
        """``seconds`` of training: each rank beats once per heartbeat_interval, each agent polls
        once per monitor_interval and beats once per agent beat interval (each spread evenly), the
        loop ticks every TICK. Node ``silent`` (its host just died) neither polls nor beats."""
        beat_every, poll_every = self.spec.heartbeat_interval, self.spec.monitor_interval
        agent_every = self.spec.agent_beat_interval()
        slots = round(seconds / TICK)
        beat_phase = [rank * beat_every / self.ranks for rank in range(self.ranks)]
        poll_phase = [node * poll_every / self.nnodes for node in range(self.nnodes)]
        agent_phase = [node * agent_every / self.nnodes for node in range(self.nnodes)]
        cpu = {"heartbeats": 0.0, "agent_beats": 0.0, "polls": 0.0, "ticks": 0.0}
        counts = {"heartbeats": 0, "agent_beats": 0, "polls": 0, "ticks": 0, "news_ticks": 0, "wakes_before": 0}

        def shell_calls(kind: str, calls: list[Callable[[float], Any]], news: News, woke_before: bool) -> None:
            """The calls as the shell makes them: a call with news is followed by a tick (timed
            as ticks). ``woke_before``: the shell's earlier rule woke the loop after it even without
            effects (a poll did; a heartbeat only when it logged an event)."""
            ticked, with_effects = 0.0, 0
            take_effects = self.machine.take_effects
            started = time.thread_time()
            for observation in calls:  # self.observe, inline: its overhead is a third of a heartbeat's cost
                result = observation(self.now)
                effects = take_effects()
                if effects.events or effects.kill_nodes:
                    self.events += len(effects.events)
                    with_effects += 1
                if news is not News.NEVER and (wakes_loop(news, effects) or (
                        isinstance(result, Order) and result.kind != OrderKind.NONE)):
                    ticked += self.tick()
                    counts["news_ticks"] += 1
            cpu[kind] += time.thread_time() - started - ticked
            cpu["ticks"] += ticked
            counts["wakes_before"] += len(calls) if woke_before else with_effects
        start = self.now
        for slot in range(slots):
            begin, end = start + slot * TICK, start + (slot + 1) * TICK
            self.now = end
            step = int(end / STEP_SECONDS)
            beats = [self.beat(rank, step) for rank in range(self.ranks)
                     if _due(beat_phase[rank], beat_every, begin, end) and rank // NPROC != silent]
            polls = [call for node in range(self.nnodes)
                     if _due(poll_phase[node], poll_every, begin, end) and node != silent
                     for call in self.poll_calls(node)]
            agent_beats = [self.agent_beat(node) for node in range(self.nnodes)
                           if _due(agent_phase[node], agent_every, begin, end) and node != silent]
            shell_calls("heartbeats", beats, News.NEVER, woke_before=False)
            shell_calls("agent_beats", agent_beats, News.NEVER, woke_before=False)
            shell_calls("polls", polls, News.IF_EFFECTS, woke_before=True)
            cpu["ticks"] += self.tick()
            counts["heartbeats"] += len(beats)
            counts["agent_beats"] += len(agent_beats)
            counts["polls"] += len(polls) // 2
            counts["ticks"] += 1
        assert self.machine.state is JobState.RUNNING, self.machine.state
        ticks = counts["ticks"] + counts["news_ticks"]
        tick_ms = 1000 * cpu["ticks"] / ticks
        return {**{f"{kind}_cpu_per_s": value / seconds for kind, value in cpu.items()},
                **{f"{kind}_per_s": value / seconds for kind, value in counts.items()},
                "tick_ms": tick_ms,
                # The earlier rule: a tick each TICK and after each wake-up, each at this tick's cost.
                "ticks_before_cpu_per_s": (counts["ticks"] + counts["wakes_before"]) * tick_ms / 1000 / seconds}

    # ------------------------------------------------------------ faults

    def recover_all(self, survivors: list[int], newcomers: list[int], decided_cpu: float) -> dict[str, Any]:
        """Survivors learn of the abort (heartbeat reply) and check in; newcomers check in once
        started; the loop's tick publishes the plan; everyone asks again and leaves with it."""
        machine = self.machine
        old_generation = machine.recovery.old_generation if machine.recovery else 0
        step = machine.membership.committed_step()
        survivor_requests = [RecoverRequest(rank, rank // NPROC, self.generation[rank], step, WORKER_PID + rank,
                                            "collective aborted", wait=5.0) for rank in survivors]
        newcomer_requests = [RecoverRequest(rank, rank // NPROC, machine.generation, 0, NEWCOMER_PID + rank,
                                            newcomer=True, wait=5.0) for rank in newcomers]
        first = [(lambda now, r=request: machine.check_in(now, r)) for request in survivor_requests]
        waiting = time.thread_time()
        first_plans = [self.call(check_in) for check_in in first]
        waiting = time.thread_time() - waiting
        assert {plan.action for plan in first_plans} == {PlanAction.WAIT}
        cpu = waiting
        # One more round of the same: what the shell spends each tick while the newcomers start
        # (every waiting check-in is woken and asks again).
        recheck = self.timed(first)
        cpu += self.timed([(lambda now, r=request: machine.check_in(now, r)) for request in newcomer_requests])
        cpu += self.tick()
        assert machine.state is JobState.RUNNING and machine.generation > old_generation, machine.state
        start = time.thread_time()
        plans: list[Plan] = [self.call(lambda now, r=request: machine.check_in(now, r))
                             for request in [*survivor_requests, *newcomer_requests]]
        cpu += time.thread_time() - start
        assert {(plan.action, plan.generation, len(plan.members)) for plan in plans} == {
            (PlanAction.RESUME, machine.generation, self.ranks)}, {plan.action for plan in plans}
        for rank in newcomers:
            self.spawned[rank] = machine.generation
        self.generation = [machine.generation] * self.ranks
        return {"decision_cpu_s": decided_cpu, "plans_to_all_cpu_s": decided_cpu + cpu,
                "first_check_ins_cpu_s": waiting, "recheck_round_ms": 1000 * recheck,
                **_encode_cpu(plans), "strategy": plans[0].strategy}

    def kill_rank(self, rank: int) -> dict[str, Any]:
        """The rank's process is SIGKILLed; its agent reports the exit at once; the report wakes the loop."""
        node = rank // NPROC
        status = WorkerStatus(rank, rank % NPROC, WORKER_PID + rank, self.spawned[rank], WorkerState.EXITED,
                              -9, "SIGKILL").to_dict()
        pid, host = self.agents[node]
        report = AgentPoll(node, self.spawned[rank], [status], wait=0.0, pid=pid, hostname=host)
        decided = self.timed([lambda now: self.machine.agent_report(now, report), self.machine.tick])
        assert self.machine.state is JobState.RECOVERING, self.machine.state
        start = time.thread_time()
        replace = self.take_order(node)  # the node's held poll leaves with its order
        replaced = time.thread_time() - start
        assert (replace.kind, replace.ranks) == (OrderKind.REPLACE, [rank]), replace
        result = self.recover_all([r for r in range(self.ranks) if r != rank], [rank], decided)
        result["plans_to_all_cpu_s"] += replaced
        return result

    def lose_node(self, node: int) -> dict[str, Any]:
        """The node's host dies: its agent's poll connection closes, it does not poll again within
        the grace; the tick that declares it lost decides; the spare adopts its place."""
        machine = self.machine
        pid, _ = self.agents[node]
        decided = self.timed([lambda now: machine.agent_disconnected(now, node, pid)])
        self.run_steady(DISCONNECT_GRACE - TICK, silent=node)  # the grace: steady state, not counted
        self.now += 2 * TICK
        decided += self.tick()
        assert machine.state is JobState.RECOVERING, machine.state
        spare_record: NodeRecord = machine.membership.nodes[self.spare]
        start = time.thread_time()
        adopt = self.call(lambda now: machine.take_order(now, spare_record))
        assert (adopt.kind, adopt.node) == (OrderKind.ADOPT, node), adopt
        self.agents[node] = (spare_record.pid, spare_record.hostname)
        assert self.call(lambda now: machine.hello(now, AgentHello(node, spare_record.pid, spare_record.hostname,
                                                                    NPROC))).accepted
        self.call(machine.tick)  # the node is back: its ranks are ordered to restart
        replace = self.take_order(node)
        cpu = time.thread_time() - start
        assert replace.kind == OrderKind.REPLACE, replace
        ranks = list(range(node * NPROC, (node + 1) * NPROC))
        result = self.recover_all([r for r in range(self.ranks) if r not in ranks], ranks, decided)
        result["plans_to_all_cpu_s"] += cpu
        return result


def _due(phase: float, every: float, begin: float, end: float) -> bool:
    """Whether a periodic call at ``phase + k * every`` falls in (begin, end]."""
    return (end - phase) // every > (begin - phase) // every


def _encode_cpu(plans: list[Plan]) -> dict[str, float]:
    """What the HTTP server spends turning every plan reply into JSON: each one apart (as it did,
    timed on a sample), and through ``PlanReplies`` (as it does), which must give the same bytes."""
    sample = plans[:50]
    start = time.thread_time()
    bodies = [json.dumps(plan.to_dict()).encode() for plan in sample]
    each_apart = (time.thread_time() - start) * len(plans) / len(sample)
    replies = PlanReplies()
    start = time.thread_time()
    cached = [replies.encode(plan) for plan in plans]
    once = time.thread_time() - start
    assert cached[:len(bodies)] == bodies
    return {"plan_encode_each_cpu_s": each_apart, "plan_encode_once_cpu_s": once,
            "plan_reply_bytes": float(len(bodies[0]))}


def measure(ranks: int, steady_seconds: float, repeats: int) -> dict[str, Any]:
    gc.collect()
    rss_before = rss_bytes()
    job = SimulatedJob(ranks)
    job.start()
    job.run_steady(1.0)  # warm: every rank beat at a committed step
    steady = job.run_steady(steady_seconds)
    steady["events_per_s"] = 0.0
    events_before, now_before = job.events, job.now
    job.run_steady(1.0)
    steady["events_per_s"] = (job.events - events_before) / (job.now - now_before)
    rss_job = rss_bytes() - rss_before
    in_place, lost_node = [], []
    for repeat in range(repeats):
        in_place.append(job.kill_rank((7919 * (repeat + 1)) % ranks))
        job.run_steady(1.0)
        lost_node.append(job.lose_node((repeat * 97 + 3) % job.nnodes))
        job.run_steady(1.0)
        job.add_spare()
    del job
    gc.collect()
    tracemalloc.start()
    job = SimulatedJob(ranks)
    job.start()
    job.run_steady(job.spec.monitor_interval)
    traced, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"ranks": ranks, "nodes": ranks // NPROC, "steady_seconds": steady_seconds, "steady": steady,
            "in_place": in_place, "lost_node": lost_node, "rss_growth_bytes": rss_job,
            "traced_bytes": traced, "traced_peak_bytes": traced_peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384],
                        help=f"rank counts (multiples of {NPROC})")
    parser.add_argument("--seconds", type=float, default=10.0, help="job-seconds of steady state")
    parser.add_argument("--repeats", type=int, default=3, help="faults of each kind per rank count")
    parser.add_argument("--out", type=Path, help="write every figure as JSON here")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one rank count, JSON to stdout
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.ranks[0], args.seconds, args.repeats)))
        return
    rows = []
    for ranks in args.ranks:
        if ranks % NPROC:
            sys.exit(f"--ranks: {ranks} is not a multiple of {NPROC} (ranks per node)")
        # A fresh process per size: its RSS growth is that job's alone.
        done = subprocess.run([sys.executable, __file__, "--one", "--ranks", str(ranks), "--seconds",
                               str(args.seconds), "--repeats", str(args.repeats)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{ranks} ranks failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout))
        print(f"{ranks} ranks done", file=sys.stderr, flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
