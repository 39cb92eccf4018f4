"""The controller: membership, health, and the job's recovery state machine.

One per job, in the ``undying run`` process of node 0. Agents say hello and long-poll
for orders; workers send heartbeats, events and injection claims. ``Controller.run``
is the single loop that looks at what was reported and decides (compare
torchelastic's ``_invoke_run``): detect -> decide -> stop -> restart. Every decision
is an event in the job's log.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from undying import events as ev
from undying.config import JobSpec
from undying.controller.state import JobState, check_transition
from undying.events import Event, EventLog
from undying.protocol import (
    ORDER_EXIT,
    ORDER_NONE,
    ORDER_START,
    ORDER_STOP,
    PHASE_DONE,
    WORKER_EXITED,
    WORKER_RUNNING,
    AgentHello,
    AgentPoll,
    Heartbeat,
    HelloReply,
    InjectionClaim,
    Order,
    WorkerStatus,
)
from undying.strategies import EXIT, JOB_RESTART, Fault, RecoveryContext, decide

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CANCELLED = 130
# How long stopped workers may take to go before the restart goes ahead anyway.
STOP_TIMEOUT = 30.0
# How long agents have to pick up their exit order at the end of the job.
EXIT_GRACE = 10.0
HEARTBEAT_LOG_EVERY = 0.5


@dataclass
class NodeRecord:
    """What the controller knows of one node's agent."""

    node: int
    pid: int
    hostname: str
    last_seen: float
    alive: bool = True
    generation: int = 0
    workers: dict[int, WorkerStatus] = field(default_factory=dict)
    orders: collections.deque[Order] = field(default_factory=collections.deque)
    exit_delivered: bool = False

    def running_workers(self) -> list[WorkerStatus]:
        return [status for status in self.workers.values() if status.state == WORKER_RUNNING]


@dataclass
class RankRecord:
    """What the controller knows of one rank in the current generation."""

    rank: int
    node: int
    generation: int
    started_at: float
    last_heartbeat: float | None = None
    last_logged: float = 0.0
    logged_step: int | None = None
    step: int = 0
    phase: str = "starting"
    pid: int | None = None
    done: bool = False
    done_at: float | None = None
    exitcode: int | None = None


class Controller:
    """Decides what every process of the job does next. Thread-safe; ``run()`` blocks."""

    def __init__(
        self,
        spec: JobSpec,
        events: EventLog,
        job_id: str,
        store_port: int,
        injections_text: str = "",
        on_node_lost: Callable[[int], None] | None = None,
    ) -> None:
        self.spec = spec
        self.events = events
        self.job_id = job_id
        self.store_port = store_port
        self.injections_text = injections_text
        self.on_node_lost = on_node_lost
        self.state = JobState.WAITING_FOR_NODES
        self.generation = 0
        self.restart_count = 0
        self.exit_code: int | None = None
        self.message = ""
        self.nodes: dict[int, NodeRecord] = {}
        self.ranks: dict[int, RankRecord] = {}
        self.claimed_injections: set[int] = set()
        self.faults_total: collections.Counter[str] = collections.Counter()
        self.started = time.time()
        self._state_deadline = 0.0
        self._finished_at: float | None = None
        self._pending_faults: list[Fault] = []
        self._cond = threading.Condition()

    # ---------------------------------------------------------------- reports in

    def emit(self, kind: str, **fields: Any) -> Event:
        return self.events.emit(Event(kind=kind, **fields))

    def hello(self, hello: AgentHello) -> HelloReply:
        with self._cond:
            if not 0 <= hello.node < self.spec.nnodes:
                return HelloReply(self.job_id, self.store_port, False, f"node {hello.node} >= nnodes")
            if hello.nproc != self.spec.nproc_per_node:
                return HelloReply(self.job_id, self.store_port, False, "nproc_per_node differs from the job's")
            if self.state.terminal:
                return HelloReply(self.job_id, self.store_port, False, f"job {self.state.value}")
            previous = self.nodes.get(hello.node)
            if previous is not None and previous.alive:
                # A node's agent came back before anyone saw it go: its workers are gone all the same.
                self._lose_node(previous, "agent said hello again (restarted)", notify=False)
            self.nodes[hello.node] = NodeRecord(hello.node, hello.pid, hello.hostname, time.time())
            self.emit(ev.AGENT_REGISTERED, node=hello.node, details={"pid": hello.pid, "host": hello.hostname})
            self._cond.notify_all()
            return HelloReply(self.job_id, self.store_port)

    def poll(self, poll: AgentPoll) -> Order:
        """An agent reports its workers and waits up to ``poll.wait`` s for its next order."""
        deadline = time.time() + max(0.0, min(poll.wait, 30.0))
        with self._cond:
            node = self.nodes.get(poll.node)
            if node is None or not node.alive:
                return Order(kind=ORDER_NONE, reason="hello")
            node.last_seen = time.time()
            node.generation = poll.generation
            for raw in poll.workers:
                self._record_worker(node, WorkerStatus.from_dict(raw))
            self._cond.notify_all()
            while not node.orders and node.alive:
                remaining = deadline - time.time()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            node.last_seen = time.time()
            if not node.alive:
                return Order(kind=ORDER_NONE, reason="hello")
            order = node.orders.popleft() if node.orders else Order()
            if order.kind == ORDER_EXIT:
                node.exit_delivered = True
                self._cond.notify_all()
            return order

    def heartbeat(self, beat: Heartbeat) -> None:
        with self._cond:
            record = self.ranks.get(beat.rank)
            if record is None or beat.generation != self.generation:
                return
            now = time.time()
            record.last_heartbeat = now
            record.step = beat.step
            record.phase = beat.phase
            record.pid = beat.pid
            if beat.phase == PHASE_DONE and not record.done:
                record.done = True
                record.done_at = now
            if record.logged_step != beat.step and now - record.last_logged >= HEARTBEAT_LOG_EVERY:
                record.last_logged = now
                record.logged_step = beat.step
                details: dict[str, Any] = {"phase": beat.phase}
                if beat.loss is not None:
                    details["loss"] = beat.loss
                self.emit(ev.HEARTBEAT, node=beat.node, rank=beat.rank, step=beat.step,
                          generation=beat.generation, details=details)

    def worker_event(self, data: dict[str, Any]) -> None:
        event = Event.from_dict(data)
        with self._cond:
            if event.kind == ev.WORKER_DONE and event.rank in self.ranks and event.generation == self.generation:
                if not self.ranks[event.rank].done:
                    self.ranks[event.rank].done_at = time.time()
                self.ranks[event.rank].done = True
                self.ranks[event.rank].step = event.step or self.ranks[event.rank].step
        self.events.emit(event)

    def claim_injection(self, claim: InjectionClaim) -> bool:
        with self._cond:
            if claim.index in self.claimed_injections or claim.generation != self.generation:
                return False
            self.claimed_injections.add(claim.index)
        return True

    def report_agent_exit(self, node_id: int, returncode: int | None) -> None:
        """The launcher saw a local agent process end (a simulated node's death)."""
        with self._cond:
            node = self.nodes.get(node_id)
            if node is not None and node.alive and not node.exit_delivered:
                self._lose_node(node, f"agent process ended (returncode {returncode})")
            self._cond.notify_all()

    def cancel(self, why: str) -> None:
        with self._cond:
            if not self.state.terminal:
                self._finish(JobState.CANCELLED, EXIT_CANCELLED, why)
            self._cond.notify_all()

    # ---------------------------------------------------------------- the loop

    def run(self) -> int:
        """Drive the job to its end; returns the process exit code."""
        with self._cond:
            self._state_deadline = time.time() + self.spec.node_return_timeout
            while True:
                self._tick(time.time())
                if self.state.terminal and self._all_agents_gone():
                    break
                self._cond.wait(0.1)
        assert self.exit_code is not None
        return self.exit_code

    def _tick(self, now: float) -> None:
        if self.state.terminal:
            return
        self._detect_lost_agents(now)
        if self.state is JobState.WAITING_FOR_NODES:
            if self._all_nodes_alive():
                self._start_generation(now)
            elif now > self._state_deadline:
                self._finish(JobState.FAILED, EXIT_FAILED, self._missing_nodes_message("start"))
        elif self.state is JobState.RUNNING:
            fault = self._find_fault(now)
            if fault is not None:
                self._handle_fault(fault, now)
            elif all(record.done and record.exitcode == 0 for record in self.ranks.values()):
                self._finish(JobState.SUCCEEDED, EXIT_OK, f"finished at step {self._committed_step()}")
        elif self.state is JobState.STOPPING:
            still_running = [n.node for n in self.nodes.values() if n.alive and n.running_workers()]
            if not still_running or now > self._state_deadline:
                self._transition(JobState.RESTARTING)
                self._state_deadline = now + self.spec.node_return_timeout
        elif self.state is JobState.RESTARTING:
            if self._all_nodes_alive():
                self._start_generation(now)
            elif now > self._state_deadline:
                self._finish(JobState.FAILED, EXIT_FAILED, self._missing_nodes_message("restart"))

    # ---------------------------------------------------------------- detection

    def _record_worker(self, node: NodeRecord, status: WorkerStatus) -> None:
        node.workers[status.rank] = status
        record = self.ranks.get(status.rank)
        if record is None or status.generation != self.generation or record.exitcode is not None:
            return
        if status.state == WORKER_EXITED:
            record.exitcode = status.exitcode if status.exitcode is not None else -1
            if record.exitcode == 0:
                record.done = True
            self.emit(ev.WORKER_EXIT, node=node.node, rank=status.rank, step=record.step,
                      generation=status.generation,
                      details={"exitcode": status.exitcode, "signal": status.signal})

    def _detect_lost_agents(self, now: float) -> None:
        timeout = self.spec.monitor_interval * 2 + 5.0
        for node in self.nodes.values():
            if node.alive and not node.exit_delivered and now - node.last_seen > timeout:
                self._lose_node(node, f"no poll for {now - node.last_seen:.1f} s")

    def _lose_node(self, node: NodeRecord, why: str, notify: bool = True) -> None:
        node.alive = False
        node.orders.clear()
        self.emit(ev.AGENT_LOST, node=node.node, generation=self.generation, details={"why": why})
        if self.state is JobState.RUNNING:
            self._pending_faults.append(Fault("agent_lost", node=node.node, step=self._committed_step()))
        if notify and self.on_node_lost is not None and not self.state.terminal:
            self.on_node_lost(node.node)

    def _find_fault(self, now: float) -> Fault | None:
        if self._pending_faults:
            return self._pending_faults.pop(0)
        for record in self.ranks.values():
            if record.exitcode not in (None, 0):
                status = self.nodes[record.node].workers.get(record.rank)
                return Fault("worker_exit", node=record.node, rank=record.rank, step=record.step,
                             exitcode=record.exitcode, signal=status.signal if status else None)
            if record.exitcode == 0:
                continue
            if record.done:
                # Said it finished but its process has not ended: stuck in teardown.
                if record.done_at is not None and now - record.done_at > STOP_TIMEOUT:
                    return Fault("exit_timeout", node=record.node, rank=record.rank, step=record.step)
                continue
            if record.last_heartbeat is None:
                if now - record.started_at > self.spec.start_timeout:
                    return Fault("start_timeout", node=record.node, rank=record.rank, step=record.step)
            elif now - record.last_heartbeat > self.spec.heartbeat_timeout:
                return Fault("heartbeat_missed", node=record.node, rank=record.rank, step=record.step)
        return None

    # ---------------------------------------------------------------- decisions

    def _handle_fault(self, fault: Fault, now: float) -> None:
        self.faults_total[fault.reason] += 1
        self.emit(ev.FAULT_DETECTED, node=fault.node, rank=fault.rank, step=fault.step,
                  generation=self.generation,
                  details={"reason": fault.reason, "exitcode": fault.exitcode, "signal": fault.signal,
                           "description": fault.describe()})
        decision = decide(fault, RecoveryContext(self.spec, self.restart_count))
        self.emit(ev.DECISION, generation=self.generation, step=fault.step,
                  details={"strategy": decision.strategy, "reason": decision.reason,
                           "restart_count": self.restart_count, "max_restarts": self.spec.max_restarts})
        if decision.strategy == JOB_RESTART:
            self.restart_count += 1
            self.emit(ev.RESTART_BEGIN, generation=self.generation,
                      details={"restart_count": self.restart_count, "fault": fault.describe()})
            self._order_all(Order(kind=ORDER_STOP, generation=self.generation, reason=fault.describe()))
            self._transition(JobState.STOPPING)
            self._state_deadline = now + STOP_TIMEOUT
        else:
            assert decision.strategy == EXIT
            message = f"{fault.describe()}; no recovery left: {decision.reason}"
            self._finish(JobState.FAILED, EXIT_FAILED, message)

    def _start_generation(self, now: float) -> None:
        self.generation += 1
        self._pending_faults.clear()
        world_size = self.spec.world_size
        per_node = self.spec.nproc_per_node
        self.ranks = {}
        for node in sorted(self.nodes.values(), key=lambda n: n.node):
            ranks = list(range(node.node * per_node, (node.node + 1) * per_node))
            for rank in ranks:
                self.ranks[rank] = RankRecord(rank, node.node, self.generation, now)
            node.orders.append(Order(kind=ORDER_START, generation=self.generation, ranks=ranks,
                                     world_size=world_size, store_port=self.store_port,
                                     restart_count=self.restart_count))
        previous = self.state
        self._transition(JobState.RUNNING)
        self.emit(ev.GENERATION_START, generation=self.generation,
                  details={"world_size": world_size, "restart_count": self.restart_count})
        if previous is JobState.RESTARTING:
            self.emit(ev.RESTART_END, generation=self.generation, details={"restart_count": self.restart_count})
        self._cond.notify_all()

    def _finish(self, state: JobState, exit_code: int, message: str) -> None:
        self._transition(state)
        self.exit_code = exit_code
        self.message = message
        self._finished_at = time.time()
        self._order_all(Order(kind=ORDER_EXIT, generation=self.generation, reason=message))
        self.emit(ev.JOB_END, generation=self.generation, step=self._committed_step(),
                  details={"outcome": state.value, "exit_code": exit_code, "message": message,
                           "restarts": self.restart_count})

    # ---------------------------------------------------------------- helpers

    def _transition(self, target: JobState) -> None:
        check_transition(self.state, target)
        self.state = target

    def _order_all(self, order: Order) -> None:
        for node in self.nodes.values():
            if node.alive:
                node.orders.clear()
                node.orders.append(order)
        self._cond.notify_all()

    def _all_nodes_alive(self) -> bool:
        alive = {n.node for n in self.nodes.values() if n.alive}
        return alive == set(range(self.spec.nnodes))

    def _all_agents_gone(self) -> bool:
        assert self._finished_at is not None
        if time.time() - self._finished_at > EXIT_GRACE:
            return True
        return all(node.exit_delivered or not node.alive for node in self.nodes.values())

    def _missing_nodes_message(self, phase: str) -> str:
        missing = sorted(set(range(self.spec.nnodes)) - {n.node for n in self.nodes.values() if n.alive})
        return f"node(s) {missing} did not join within node_return_timeout ({self.spec.node_return_timeout:g} s) at {phase}"

    def _committed_step(self) -> int:
        return min((record.step for record in self.ranks.values()), default=0)

    def status(self) -> dict[str, Any]:
        with self._cond:
            now = time.time()
            return {
                "job_id": self.job_id,
                "state": self.state.value,
                "generation": self.generation,
                "restart_count": self.restart_count,
                "max_restarts": self.spec.max_restarts,
                "world_size": self.spec.world_size,
                "committed_step": self._committed_step(),
                "message": self.message,
                "uptime_seconds": now - self.started,
                "faults": dict(self.faults_total),
                "nodes": {
                    str(n.node): {"alive": n.alive, "pid": n.pid, "host": n.hostname,
                                  "seconds_since_poll": round(now - n.last_seen, 3),
                                  "running_workers": len(n.running_workers())}
                    for n in self.nodes.values()
                },
                "ranks": {
                    str(r.rank): {"node": r.node, "step": r.step, "phase": r.phase, "pid": r.pid,
                                  "done": r.done, "exitcode": r.exitcode,
                                  "seconds_since_heartbeat": None if r.last_heartbeat is None
                                  else round(now - r.last_heartbeat, 3)}
                    for r in self.ranks.values()
                },
            }
