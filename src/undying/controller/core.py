"""The controller: membership, health, and the job's recovery state machine.

One per job, in the ``undying run`` process of node 0. Agents say hello and long-poll
for orders; workers send heartbeats, events, injection claims and, when a step
fails, their check-in for a recovery plan. ``Controller.run`` is the single loop that
looks at what was reported and decides (compare torchelastic's ``_invoke_run``):
detect -> decide (strategies.decide) -> a process-level recovery (only the failed
processes restart, the others keep their memory), an elastic shrink (train on
without a node that did not come back) or grow, a dying checkpoint, or a
job-level restart. Every decision is an event in the job's log.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from undying import events as ev
from undying.client import format_address
from undying.config import JobSpec
from undying.controller.recovery import ActiveRecovery
from undying.controller.state import JobState, check_transition
from undying.events import Event, EventLog
from undying.inject import decode as decode_injections
from undying.protocol import (
    AgentHello,
    AgentPoll,
    Heartbeat,
    HeartbeatReply,
    HelloReply,
    InjectionClaim,
    Order,
    OrderKind,
    Phase,
    Plan,
    PlanAction,
    RecoverRequest,
    WorkerState,
    WorkerStatus,
)
from undying.strategies import (
    DUMP,
    ELASTIC,
    EXIT,
    JOB_RESTART,
    PROCESS_LEVEL,
    RECOVER,
    RECOVER_IN_PLACE,
    RETRY,
    Fault,
    RecoveryContext,
    decide,
    effective_chain,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CANCELLED = 130
# How long stopped workers may take to go before the restart goes ahead anyway.
STOP_TIMEOUT = 30.0
# How long agents have to pick up their exit order at the end of the job.
EXIT_GRACE = 10.0
HEARTBEAT_LOG_EVERY = 0.5
# A worker's own report that its step failed waits this long for the cause to show up
# (a dead peer's exit, a lost node), so the decision is made on the real fault.
STEP_FAILED_GRACE = 0.5
# After a controller failover: how much longer than one long poll a live agent may take to show up.
UNCONFIRMED_GRACE = 4.0
# Faults that mean the rank's process is gone or no longer usable.
PROCESS_FAULTS = ("worker_exit", "heartbeat_missed", "start_timeout", "exit_timeout", "step_stalled")


class NotInCharge(RuntimeError):
    """This controller lost (or cannot confirm) its leadership: clients must ask the new leader."""


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
    standby: bool = False  # a spare: no ranks; takes over a lost node's place when ordered to
    confirmed: bool = True  # False: known only from a failed-over controller's saved state, not polled yet
    adopting: int | None = None  # the node whose place this spare was ordered to take

    def running_workers(self) -> list[WorkerStatus]:
        return [status for status in self.workers.values() if status.state == WorkerState.RUNNING]


@dataclass
class RankRecord:
    """What the controller knows of one rank's current process."""

    rank: int
    node: int
    spawn_generation: int  # the generation its process was started in (matches agent reports)
    started_at: float
    last_heartbeat: float | None = None
    last_logged: float = 0.0
    logged_step: int | None = None
    step: int = 0
    phase: str = Phase.STARTING
    last_progress: float | None = None  # when ``step`` last changed (the step-progress watchdog)
    hang_reported_step: int | None = None  # watchdog off/detect-only: the step a hang was logged at
    pid: int | None = None
    done: bool = False
    done_at: float | None = None
    exitcode: int | None = None
    signal: str | None = None
    step_known: bool = True  # False: restored by a failover and not heard from since


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
        store_host: str = "127.0.0.1",
        save_state: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self.spec = spec
        self.events = events
        self.job_id = job_id
        self.store_port = store_port
        self.store_host = store_host
        self.save_state = save_state  # failover jobs: writes export_state() to etcd (False: deposed)
        self._saved: dict[str, Any] | None = None
        self.backup_store = ""  # failover jobs: another node's store that keeps a second RNG mirror
        self.rng_stores: list[str] = []  # after a takeover: stores that may hold mirrors of earlier steps
        self.deposed = False  # another controller leads now: stop deciding, keep the job's processes
        # Failover jobs: False while this controller's lease is not known to be held (a process that
        # was frozen and woke up): it then decides nothing and answers nobody until it knows.
        self.in_charge: Callable[[], bool] = lambda: True
        self.injections_text = injections_text
        self.on_node_lost = on_node_lost
        self.state = JobState.WAITING_FOR_NODES
        self.generation = 0
        self.abort_generation = 0
        self.restart_count = 0
        self.exit_code: int | None = None
        self.message = ""
        self.nodes: dict[int, NodeRecord] = {}
        self.ranks: dict[int, RankRecord] = {}  # the current generation's members only
        self.members: list[int] = []  # ranks of the current generation, in process-group order
        self.recovery: ActiveRecovery | None = None
        self.node_down_until: dict[int, float] = {}  # injected `node:...:down=D`: held down until
        self.adopted_by: dict[int, int] = {}  # node -> the spare agent id that took its place
        self.pending_grow: ActiveRecovery | None = None  # returned ranks starting while the survivors train
        self._grow_refused: set[tuple[int, int]] = set()  # (node, agent pid) already tried for a grow
        self.plans: dict[int, Plan] = {}  # generation -> the plan that formed it
        self.claimed_injections: set[int] = set()
        self.faults_total: collections.Counter[str] = collections.Counter()
        self.retries: collections.Counter[int] = collections.Counter()  # step -> in-place retries
        self.started = time.time()
        self._state_deadline = 0.0
        self._finished_at: float | None = None
        self._pending_faults: list[Fault] = []
        self._step_failures: list[tuple[float, Fault]] = []
        self._reported_failures: set[tuple[int, int]] = set()  # (rank, generation) step failures seen
        self._resumed = False
        self._last_spare_id = -1
        self._cond = threading.Condition()

    # ---------------------------------------------------------------- reports in

    def emit(self, kind: str, **fields: Any) -> Event:
        return self.events.emit(Event(kind=kind, **fields))

    def hello(self, hello: AgentHello) -> HelloReply:
        with self._cond:
            self._check_in_charge()
            if hello.standby and hello.node < self.spec.nnodes:
                return HelloReply(self.job_id, self.store_port, False,
                                  f"a standby agent needs a node id >= nnodes ({self.spec.nnodes}), got {hello.node}")
            if not hello.standby and not 0 <= hello.node < self.spec.nnodes:
                return HelloReply(self.job_id, self.store_port, False, f"node {hello.node} >= nnodes")
            if hello.nproc != self.spec.nproc_per_node:
                return HelloReply(self.job_id, self.store_port, False, "nproc_per_node differs from the job's")
            if self.state.terminal:
                return HelloReply(self.job_id, self.store_port, False, f"job {self.state.value}")
            previous = self.nodes.get(hello.node)
            if not hello.standby and previous is not None and previous.alive and hello.node in self.adopted_by \
                    and previous.pid != hello.pid:
                return self._returned_as_spare(hello)
            if previous is not None and previous.alive:
                # A node's agent came back before anyone saw it go: its workers are gone all the same.
                self._lose_node(previous, "agent said hello again (restarted)", notify=False)
            self.nodes[hello.node] = NodeRecord(hello.node, hello.pid, hello.hostname, time.time(),
                                                standby=hello.standby)
            self.emit(ev.AGENT_REGISTERED, node=hello.node,
                      details={"pid": hello.pid, "host": hello.hostname, "standby": hello.standby})
            self._cond.notify_all()
            return HelloReply(self.job_id, self.store_port)

    def reserve_spare_id(self) -> int:
        """A node id no agent of this job has used: for a spare, or a node that returns as one."""
        with self._cond:
            used = [*self.nodes, *self.adopted_by.values(), self.spec.nnodes - 1, self._last_spare_id]
            self._last_spare_id = max(used) + 1
            return self._last_spare_id

    def _returned_as_spare(self, hello: AgentHello) -> HelloReply:
        """A node's agent is back while the spare that adopted its place serves its ranks: it
        joins as a spare (it holds no ranks: its workers were replaced), not as the node again."""
        spare_id = self.reserve_spare_id()
        self.nodes[spare_id] = NodeRecord(spare_id, hello.pid, hello.hostname, time.time(), standby=True)
        self.emit(ev.AGENT_REGISTERED, node=spare_id, details={
            "pid": hello.pid, "host": hello.hostname, "standby": True, "returned_node": hello.node,
            "served_by": self.adopted_by[hello.node]})
        self._cond.notify_all()
        return HelloReply(self.job_id, self.store_port, node=spare_id)

    def poll(self, poll: AgentPoll) -> Order:
        """An agent reports its workers and waits up to ``poll.wait`` s for its next order."""
        deadline = time.time() + max(0.0, min(poll.wait, 30.0))
        with self._cond:
            self._check_in_charge()
            node = self.nodes.get(poll.node)
            if node is None or not node.alive or not self._polled_by_owner(node, poll):
                return Order(kind=OrderKind.NONE, reason="hello")
            self._take_statuses(node, poll.workers)
            while not node.orders and node.alive:
                remaining = deadline - time.time()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            self._check_in_charge()  # orders queued by a controller that lost its lease are not handed out
            node.last_seen = time.time()
            if not node.alive:
                return Order(kind=OrderKind.NONE, reason="hello")
            order = node.orders.popleft() if node.orders else Order()
            if order.kind == OrderKind.EXIT:
                node.exit_delivered = True
                self._cond.notify_all()
            if order.kind == OrderKind.ADOPT and self.nodes.get(poll.node) is node:
                del self.nodes[poll.node]  # it says hello again as the node it adopts
            return order

    def _polled_by_owner(self, node: NodeRecord, poll: AgentPoll) -> bool:
        """The poll comes from the agent that holds the node's place (not one that was away while a
        spare adopted it): same pid on the same host. A record restored from an older saved state
        (without them) learns its agent's here."""
        if not node.confirmed and node.pid == 0:
            node.pid = poll.pid
            node.hostname = poll.hostname or node.hostname
        same_host = not poll.hostname or not node.hostname or poll.hostname == node.hostname
        return not poll.pid or not node.pid or (poll.pid == node.pid and same_host)

    def report(self, poll: AgentPoll) -> None:
        """An agent's immediate report of a worker's exit (no order is handed out here)."""
        with self._cond:
            self._check_in_charge()
            node = self.nodes.get(poll.node)
            if node is not None and node.alive and self._polled_by_owner(node, poll):
                self._take_statuses(node, poll.workers)

    def _take_statuses(self, node: NodeRecord, workers: list[dict[str, Any]]) -> None:
        node.last_seen = time.time()
        node.confirmed = True
        for raw in workers:
            self._record_worker(node, WorkerStatus.from_dict(raw))
        self._cond.notify_all()

    def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        with self._cond:
            self._check_in_charge()
            reply = HeartbeatReply(abort_generation=self.abort_generation, mirror_store=self.backup_store)
            record = self.ranks.get(beat.rank)
            if record is None or beat.generation < record.spawn_generation or beat.generation > self.generation:
                return reply
            now = time.time()
            record.last_heartbeat = now
            if beat.step != record.step:
                record.last_progress = now  # armed from a rank's first committed step on
            record.step = beat.step
            record.step_known = True
            record.phase = beat.phase
            record.pid = beat.pid
            if beat.phase == Phase.DONE and not record.done:
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
            return reply

    def worker_event(self, data: dict[str, Any]) -> None:
        event = Event.from_dict(data)
        with self._cond:
            self._check_in_charge()
            record = self.ranks.get(event.rank) if event.rank is not None else None
            if event.kind == ev.WORKER_DONE and record is not None:
                if not record.done:
                    record.done_at = time.time()
                record.done = True
                record.step = event.step or record.step
                record.step_known = record.step_known or bool(event.step)
            self.events.emit(event)
            if event.kind == ev.DUMP_COMMITTED and self.recovery is not None and self.recovery.strategy == DUMP:
                self._dump_committed(event)
            self._cond.notify_all()

    def recover(self, request: RecoverRequest) -> Plan:
        """A worker checks in after its step failed (or a replacement on joining); answers with its plan."""
        deadline = time.time() + max(0.0, min(request.wait, 30.0))
        with self._cond:
            self._check_in_charge()
            superseded = self._superseded(request)
            if superseded is not None:
                return superseded
            while True:
                self._check_in_charge()
                self._check_in(request)
                plan = self._plan_for(request)
                if plan.action != PlanAction.WAIT or time.time() >= deadline:
                    return plan
                self._cond.wait(min(0.5, max(0.0, deadline - time.time())))

    def _check_in(self, request: RecoverRequest) -> None:
        record = self.ranks.get(request.rank)
        if record is not None:
            record.phase = "recovering"
            record.last_heartbeat = time.time()
        recovery = self.recovery
        pending = self.pending_grow
        if request.newcomer and recovery is None and pending is not None and request.generation == pending.generation:
            pending.newcomers_ready.add(request.rank)
        elif request.newcomer:
            if recovery is not None and request.generation == recovery.generation:
                recovery.newcomers_ready.add(request.rank)
            elif recovery is not None and request.rank in recovery.survivors and recovery.plan is None:
                # Alive but without the state (its own repair failed): it receives, it is not restarted.
                recovery.survivors.discard(request.rank)
                recovery.newcomers.add(request.rank)
                recovery.newcomers_ready.add(request.rank)
        elif recovery is not None and request.generation < recovery.generation \
                and request.rank in recovery.survivors:
            recovery.checked_in[request.rank] = request.committed_step
        elif self.state is JobState.RUNNING and request.generation == self.generation \
                and (request.rank, request.generation) not in self._reported_failures:
            self._reported_failures.add((request.rank, request.generation))
            self._step_failures.append((time.time(), Fault(
                "step_failed", node=record.node if record else request.node, rank=request.rank,
                step=request.committed_step, detail=request.reason[:300])))

    def _superseded(self, request: RecoverRequest) -> Plan | None:
        """An old process of a rank that was replaced meanwhile (its node froze and woke up)."""
        record = self.ranks.get(request.rank)
        if record is not None and record.pid is not None and request.pid != record.pid \
                and record.spawn_generation > request.generation:
            return Plan(action=PlanAction.EXIT, reason=f"rank {request.rank} is served by process {record.pid} now")
        return None

    def _plan_for(self, request: RecoverRequest) -> Plan:
        recovery = self.recovery
        if recovery is not None:
            if recovery.plan is None:
                return Plan(action=PlanAction.WAIT)
            in_plan = request.rank in recovery.checked_in or request.rank in recovery.newcomers
            return self._stamped(recovery.plan) if in_plan else Plan(action=PlanAction.EXIT,
                                                                      reason="not part of this recovery")
        if self.state is JobState.RUNNING:
            formed = self.plans.get(self.generation)
            # The plan was published while this worker was between two polls.
            fits = request.generation < self.generation or (request.newcomer and request.generation == self.generation)
            return self._stamped(formed) if formed is not None and fits else Plan(action=PlanAction.WAIT)
        if self.state in (JobState.STOPPING, JobState.RESTARTING) or self.state.terminal:
            return Plan(action=PlanAction.EXIT, reason=f"job {self.state.value}")
        return Plan(action=PlanAction.WAIT)

    def _stamped(self, plan: Plan) -> Plan:
        return replace(plan, store=self.store_address, rng_stores=list(self.rng_stores))

    @property
    def store_address(self) -> str:
        return format_address(self.store_host, self.store_port)

    def claim_injection(self, claim: InjectionClaim) -> bool:
        with self._cond:
            self._check_in_charge()
            record = self.ranks.get(claim.rank)
            stale = record is None or claim.generation < record.spawn_generation
            if claim.index in self.claimed_injections or stale or self.deposed:
                return False
            self.claimed_injections.add(claim.index)
            injection = next((i for i in decode_injections(self.injections_text) if i.index == claim.index), None)
            if injection is not None and injection.kind == "node" and injection.down is not None:
                self.node_down_until[claim.node] = time.time() + injection.down
            # The fault may follow at once (a node kill takes this controller with it): save first,
            # so a successor does not hand out the same injection again.
            if not self._save_if_changed():
                return False
        return True

    def node_down_remaining(self, node: int) -> float:
        """Seconds an injected node fault still keeps ``node`` from being rescheduled."""
        with self._cond:
            return max(0.0, self.node_down_until.get(node, 0.0) - time.time())

    def report_agent_exit(self, node_id: int, returncode: int | None) -> None:
        """The launcher saw a local agent process end (a simulated node's death)."""
        with self._cond:
            adopted = [node for node, spare in self.adopted_by.items() if spare == node_id]
            node = self.nodes.get(adopted[0] if adopted and node_id not in self.nodes else node_id)
            if node is not None and node.alive and not node.exit_delivered:
                self._lose_node(node, f"agent process ended (returncode {returncode})")
            self._cond.notify_all()

    def cancel(self, why: str) -> None:
        with self._cond:
            if not self.state.terminal:
                self._finish(JobState.CANCELLED, EXIT_CANCELLED, why)
            self._cond.notify_all()

    # ---------------------------------------------------------------- the loop

    def run(self) -> int | None:
        """Drive the job to its end; returns the process exit code (None: deposed, another leads)."""
        with self._cond:
            if not self._resumed:
                self._state_deadline = time.time() + self.spec.node_return_timeout
            while True:
                if not self.deposed and self.in_charge():
                    self._tick(time.time())
                    self._save_if_changed()
                if self.deposed:
                    return None
                if self.state.terminal and self._all_agents_gone():
                    break
                self._cond.wait(0.05)
        assert self.exit_code is not None
        return self.exit_code

    def _check_in_charge(self) -> None:
        if self.deposed or not self.in_charge():
            raise NotInCharge("this controller does not hold the job's leadership (failover)")

    def depose(self) -> None:
        """Another controller leads (our etcd lease is gone): stop deciding at once."""
        with self._cond:
            self.deposed = True
            self._cond.notify_all()

    # ---------------------------------------------------------------- failover state

    def export_state(self) -> dict[str, Any]:
        """What a successor needs to carry on (failover jobs keep it in etcd); the rest it
        rebuilds from the agents' polls and the workers' heartbeats."""
        return {
            "job_id": self.job_id,
            "state": self.state.value,
            "generation": self.generation,
            "abort_generation": self.abort_generation,
            "restart_count": self.restart_count,
            "members": list(self.members),
            "spawned": {str(rank): record.spawn_generation for rank, record in self.ranks.items()},
            "nodes": {str(n.node): {"standby": n.standby, "alive": n.alive, "pid": n.pid, "host": n.hostname}
                      for n in self.nodes.values()},
            "adopted_by": {str(node): spare for node, spare in self.adopted_by.items()},
            "plan": None if self.generation not in self.plans else self.plans[self.generation].to_dict(),
            "claimed_injections": sorted(self.claimed_injections),
            "node_down_until": {str(node): until for node, until in self.node_down_until.items()},
            "faults": dict(self.faults_total),
            "started": self.started,
            "store": self.store_address,
            "backup_store": self.backup_store,
        }

    def _save_if_changed(self) -> bool:
        if self.save_state is None or self.deposed:
            return not self.deposed
        state = self.export_state()
        if state == self._saved:
            return True
        if not self.save_state(state):
            self.deposed = True
            self._cond.notify_all()
            return False
        self._saved = state
        return True

    def resume(self, saved: dict[str, Any], why: str) -> None:
        """Take over a job another controller ran (it died or lost its lease). A running generation
        goes on untouched: its nodes and ranks are known from ``saved`` and confirm themselves by
        polling and beating here (a node that does not is lost, as any other). A job caught in the
        middle of a recovery or restart restarts (the successor cannot know how far it got)."""
        now = time.time()
        with self._cond:
            self._resumed = True
            self.job_id = saved["job_id"]
            self.generation = int(saved["generation"])
            self.abort_generation = int(saved["abort_generation"])
            self.restart_count = int(saved["restart_count"])
            self.members = [int(rank) for rank in saved["members"]]
            self.adopted_by = {int(node): int(spare) for node, spare in saved["adopted_by"].items()}
            self.claimed_injections = {int(index) for index in saved["claimed_injections"]}
            self.node_down_until = {int(node): float(until) for node, until in saved["node_down_until"].items()}
            self.faults_total.update(saved["faults"])
            self.started = float(saved["started"])
            # The RNG mirrors of the last steps are in the old store (gone with its node, most likely)
            # and in its backup store, which may be ours.
            self.rng_stores = [address for address in (saved.get("backup_store"), saved.get("store"))
                               if address and address != self.store_address]
            if saved.get("plan"):
                self.plans[self.generation] = Plan.from_dict(saved["plan"])
            for node_id, node in saved["nodes"].items():
                if node["alive"]:
                    # The agent's pid and host: a poll from another process is not the node's.
                    self.nodes[int(node_id)] = NodeRecord(int(node_id), int(node.get("pid") or 0),
                                                          str(node.get("host") or ""), now,
                                                          standby=bool(node["standby"]), confirmed=False)
            for rank_text, spawned in saved["spawned"].items():
                rank = int(rank_text)
                self.ranks[rank] = RankRecord(rank, self._node_of(rank), int(spawned), now, last_heartbeat=now,
                                              phase=Phase.COMPUTING, step_known=False)
            previous = JobState(saved["state"])
            self.emit(ev.CONTROLLER_TAKEOVER, generation=self.generation, details={
                "previous_state": previous.value, "why": why, "nodes": sorted(self.nodes),
                "members": self.members})
            self._state_deadline = now + self.spec.node_return_timeout
            if previous is JobState.RUNNING:
                self.state = JobState.RUNNING
            elif previous is JobState.WAITING_FOR_NODES:
                self.nodes.clear()  # agents say hello again; nothing ran yet
                self.ranks.clear()
            else:
                self.state = JobState.RECOVERING  # only to leave it by the legal path below
                self._begin_job_restart(f"controller failover during {previous.value}", now)
            self._cond.notify_all()

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
            elif self.ranks and all(record.done and record.exitcode == 0 for record in self.ranks.values()):
                self._finish(JobState.SUCCEEDED, EXIT_OK, f"finished at step {self._committed_step()}")
            else:
                self._grow_if_nodes_returned(now)
        elif self.state is JobState.RECOVERING:
            self._tick_recovery(now)
        elif self.state is JobState.STOPPING:
            still_running = [n.node for n in self.nodes.values() if n.alive and n.running_workers()]
            if not still_running or now > self._state_deadline:
                self._transition(JobState.RESTARTING)
                self._state_deadline = now + self.spec.node_return_timeout
        elif self.state is JobState.RESTARTING:
            self._adopt_spares_for(set(range(self.spec.nnodes)))
            if self._all_nodes_alive():
                self._start_generation(now)
            elif now > self._state_deadline:
                self._finish(JobState.FAILED, EXIT_FAILED, self._missing_nodes_message("restart"))

    # ---------------------------------------------------------------- detection

    def _record_worker(self, node: NodeRecord, status: WorkerStatus) -> None:
        node.workers[status.rank] = status
        if self.state.terminal:
            return  # the job has ended; its workers being stopped is no news
        record = self.ranks.get(status.rank)
        if record is None or status.generation != record.spawn_generation or record.exitcode is not None:
            return
        if status.state == WorkerState.EXITED:
            record.exitcode = status.exitcode if status.exitcode is not None else -1
            record.signal = status.signal
            if record.exitcode != 0 and record.done:
                # Training had finished and its result was written; only the teardown failed.
                self.emit(ev.WORKER_EXIT, node=node.node, rank=status.rank, step=record.step,
                          generation=self.generation,
                          details={"exitcode": status.exitcode, "signal": status.signal, "after_done": True})
                record.exitcode = 0
                return
            if record.exitcode == 0:
                record.done = True
            self.emit(ev.WORKER_EXIT, node=node.node, rank=status.rank, step=record.step,
                      generation=self.generation, details={"exitcode": status.exitcode, "signal": status.signal})

    def _detect_lost_agents(self, now: float) -> None:
        timeout = self.spec.monitor_interval * 2 + 5.0
        # After a failover a live agent finds the new controller within one long poll and a lookup.
        unconfirmed_timeout = self.spec.monitor_interval + UNCONFIRMED_GRACE
        for node in self.nodes.values():
            limit = timeout if node.confirmed else unconfirmed_timeout
            if node.alive and not node.exit_delivered and now - node.last_seen > limit:
                what = "no poll" if node.confirmed else "no poll since the controller failed over"
                self._lose_node(node, f"{what} for {now - node.last_seen:.1f} s")

    def agent_id_of(self, node: int) -> int:
        """The agent process id (as the launcher started it) now serving ``node``."""
        with self._cond:
            return self.adopted_by.get(node, node)

    def _lose_node(self, node: NodeRecord, why: str, notify: bool = True) -> None:
        node.alive = False
        node.orders.clear()
        self.emit(ev.AGENT_LOST, node=node.node, generation=self.generation,
                  details={"why": why, "standby": node.standby})
        if node.standby:
            return  # a spare held no ranks: nothing to recover
        if self.state in (JobState.RUNNING, JobState.RECOVERING):
            self._pending_faults.append(Fault("agent_lost", node=node.node, step=self._committed_step()))
        if notify and self.on_node_lost is not None and not self.state.terminal:
            self.on_node_lost(node.node)

    def _find_fault(self, now: float) -> Fault | None:
        if any(n.alive and not n.confirmed and not n.standby for n in self.nodes.values()):
            # Just failed over: every fault now (a failed step, a silent rank) may be the old leader's
            # node dying. Decide once each node has either polled here or been declared lost.
            return None
        if self._pending_faults:
            return self._pending_faults.pop(0)
        for record in self.ranks.values():
            if not self._node_alive(record.node):
                continue  # the node's agent_lost fault covers its ranks
            if record.exitcode not in (None, 0):
                return Fault("worker_exit", node=record.node, rank=record.rank, step=record.step,
                             exitcode=record.exitcode, signal=record.signal)
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
                fault = Fault("heartbeat_missed", node=record.node, rank=record.rank, step=record.step)
                if self.spec.watchdog == "on":
                    return fault
                self._note_unacted_hang(record, fault)
            elif self._stalled(record, now):
                # Alive (its heartbeat thread beats) but its training thread commits no step.
                fault = Fault("step_stalled", node=record.node, rank=record.rank, step=record.step)
                if self.spec.watchdog == "on":
                    return fault
                self._note_unacted_hang(record, fault)
        everyone_reported = len({fault.rank for _, fault in self._step_failures}) == len(self.ranks)
        if self._step_failures and (everyone_reported or now - self._step_failures[0][0] >= STEP_FAILED_GRACE):
            _, fault = self._step_failures.pop(0)
            self._step_failures.clear()
            return fault
        return None

    def _stalled(self, record: RankRecord, now: float) -> bool:
        timeout = self.spec.step_timeout
        # Only a rank still computing is stuck itself: its peers wait in the all-reduce ("syncing").
        return (timeout is not None and record.last_progress is not None
                and record.phase == Phase.COMPUTING and now - record.last_progress > timeout)

    def _note_unacted_hang(self, record: RankRecord, fault: Fault) -> None:
        """watchdog off / detect-only: a hang is reported (once per stuck step), never acted on."""
        if record.hang_reported_step != record.step:
            record.hang_reported_step = record.step
            self.emit(ev.HANG_SUSPECTED, node=record.node, rank=record.rank, step=record.step,
                      generation=self.generation,
                      details={"watchdog": self.spec.watchdog, "description": fault.describe()})

    # ---------------------------------------------------------------- decisions

    def _context(self, lost_ranks: set[int], excluded: frozenset[str] = frozenset(),
                 step: int | None = None) -> RecoveryContext:
        lost_nodes = {self.ranks[rank].node for rank in lost_ranks if rank in self.ranks}
        restoring = {rank for rank, record in self.ranks.items()
                     if rank not in lost_ranks and record.phase == Phase.STARTING and record.spawn_generation
                     == self.generation and self.generation not in self.plans}
        return RecoveryContext(self.spec, self.restart_count, frozenset(self._alive_nodes()),
                               frozenset(lost_ranks), self.retries[step] if step is not None else 0, excluded,
                               world_size=len(self.members),
                               lost_nodes=frozenset(node for node in lost_nodes if not self._node_alive(node)),
                               survivors_restoring=frozenset(restoring))

    def _lost_ranks(self, fault: Fault) -> set[int]:
        lost = {record.rank for record in self.ranks.values() if record.exitcode not in (None, 0)}
        if fault.reason == "agent_lost" and fault.node is not None:
            lost |= set(self._ranks_of(fault.node))
        if fault.reason in PROCESS_FAULTS and fault.rank is not None:
            lost.add(fault.rank)
        for node in self.nodes.values():
            if not node.alive:
                lost |= set(self._ranks_of(node.node))
        return lost & set(self.members)  # after an elastic shrink, a dropped node's ranks are not lost again

    def _handle_fault(self, fault: Fault, now: float, excluded: frozenset[str] = frozenset()) -> None:
        self.faults_total[fault.reason] += 1
        self.pending_grow = None  # its starting ranks are told to exit when they ask for a plan
        self._step_failures.clear()
        self.emit(ev.FAULT_DETECTED, node=fault.node, rank=fault.rank, step=fault.step,
                  generation=self.generation,
                  details={"reason": fault.reason, "exitcode": fault.exitcode, "signal": fault.signal,
                           "description": fault.describe(), "detail": fault.detail})
        self._decide_and_act(fault, now, excluded)

    def _decide_and_act(self, fault: Fault, now: float, excluded: frozenset[str] = frozenset()) -> None:
        lost = self._lost_ranks(fault)
        step = self._committed_step()
        decision = decide(fault, self._context(lost, excluded, step))
        self.emit(ev.DECISION, generation=self.generation, step=fault.step,
                  details={"strategy": decision.strategy, "reason": decision.reason,
                           "restart_count": self.restart_count, "max_restarts": self.spec.max_restarts,
                           "lost_ranks": sorted(lost)})
        if decision.strategy in (*PROCESS_LEVEL, DUMP):
            if decision.strategy == RETRY:
                self.retries[step] += 1
            self._begin_recovery(fault, decision.strategy, lost, now, excluded)
        elif decision.strategy == JOB_RESTART:
            self._begin_job_restart(fault.describe(), now)
        else:
            assert decision.strategy == EXIT
            self._finish(JobState.FAILED, EXIT_FAILED, f"{fault.describe()}; no recovery left: {decision.reason}")

    def _begin_job_restart(self, why: str, now: float, count: bool = True) -> None:
        if count:
            self.restart_count += 1
        self.recovery = None
        self.abort_generation = self.generation
        self.emit(ev.RESTART_BEGIN, generation=self.generation,
                  details={"restart_count": self.restart_count, "fault": why})
        self._order_all(Order(kind=OrderKind.STOP, generation=self.generation, reason=why))
        self._transition(JobState.STOPPING)
        self._state_deadline = now + STOP_TIMEOUT

    # ---------------------------------------------------------------- process-level recovery

    def _begin_recovery(self, fault: Fault, strategy: str, lost: set[int], now: float,
                        excluded: frozenset[str] = frozenset()) -> None:
        self.restart_count += 1
        old_generation = self.generation
        self.generation += 1
        self.abort_generation = old_generation
        survivors = set(self.members) - lost
        recovery = ActiveRecovery(strategy, fault, old_generation, self.generation, list(self.members),
                                  survivors=survivors, started=now,
                                  deadline=now + self.spec.start_timeout + self.spec.comm_timeout)
        if strategy != DUMP:
            recovery.newcomers = set(lost)
            lost_nodes = {self.ranks[rank].node for rank in lost}
            recovery.awaited_nodes = {node for node in lost_nodes if not self._node_alive(node)}
            for node in sorted(lost_nodes - recovery.awaited_nodes):
                self._replace(node, sorted(r for r in lost if self.ranks[r].node == node), now)
            self._adopt_spares_for(recovery.awaited_nodes)
            if recovery.awaited_nodes and self._elastic_enabled(excluded):
                # A lost node gets wait_reschedule_timeout to come back; after that the job trains on
                # without it (at once if a recover already waited for it).
                waited_already = strategy == ELASTIC and RECOVER in excluded
                wait = 0.0 if waited_already else self.spec.reschedule_wait()
                recovery.may_shrink = True
                recovery.reschedule_deadline = now + wait
                recovery.deadline += wait
        self.recovery = recovery
        self._transition(JobState.RECOVERING)
        details: dict[str, Any] = {"strategy": strategy, "old_generation": old_generation,
                                   "survivors": sorted(survivors), "newcomers": sorted(recovery.newcomers),
                                   "awaited_nodes": sorted(recovery.awaited_nodes)}
        if recovery.may_shrink:
            details["shrink_after"] = round(recovery.reschedule_deadline - now, 3)
        self.emit(ev.RECOVERY_BEGIN if strategy != DUMP else ev.DUMP_BEGIN, generation=self.generation,
                  step=fault.step, details=details)
        self._cond.notify_all()  # wake the workers already waiting in recover(): they are survivors now

    def _elastic_enabled(self, excluded: frozenset[str] = frozenset()) -> bool:
        return ELASTIC not in excluded and any(s.name == ELASTIC for s in effective_chain(self.spec))

    def _shrink(self, recovery: ActiveRecovery, now: float) -> bool:
        """Drop the nodes that did not come back from the recovery; False if that leaves too few."""
        dropped_nodes = sorted(recovery.awaited_nodes)
        dropped = {rank for rank in recovery.members if self.ranks[rank].node in recovery.awaited_nodes}
        members = [rank for rank in recovery.members if rank not in dropped]
        nodes_left = {self.ranks[rank].node for rank in members}
        if len(nodes_left) < self.spec.fewest_nodes or not recovery.survivors:
            why = (f"elastic-training: {len(nodes_left)} node(s) left, below min_nodes ({self.spec.fewest_nodes})"
                   if recovery.survivors else "elastic-training: no healthy replica left")
            self._recovery_failed(why, None, now)
            return False
        old_world = len(recovery.members)
        recovery.members = members
        recovery.newcomers -= dropped
        recovery.newcomers_ready -= dropped
        recovery.awaited_nodes.clear()
        recovery.strategy = ELASTIC
        recovery.deadline = now + self.spec.start_timeout + self.spec.comm_timeout
        for rank in dropped:
            self.ranks.pop(rank, None)
        self.emit(ev.ELASTIC_SHRINK, generation=recovery.generation, step=recovery.fault.step,
                  details={"old_world_size": old_world, "new_world_size": len(members),
                           "dropped_nodes": dropped_nodes, "dropped_ranks": sorted(dropped),
                           "waited": round(now - recovery.started, 3)})
        return True

    def _grow_if_nodes_returned(self, now: float) -> None:
        """Elastic grow-back: a node dropped by a shrink is alive again; bring its ranks back in.

        The returned ranks start first, while the survivors keep training; only once every one
        of them has started and checked in does the running generation end (at the survivors'
        next step boundary) and the regrouping begin, so the survivors never wait for a cold start.
        """
        if len(self.members) >= self.spec.world_size or not self._elastic_enabled():
            return
        pending = self.pending_grow
        if pending is not None:
            if pending.newcomers <= pending.newcomers_ready:
                self._begin_grow(pending, now)
            elif now > pending.deadline:
                self.pending_grow = None
                for node in {self._node_of(rank) for rank in pending.newcomers}:
                    if node in self.nodes:  # this agent incarnation is not asked again
                        self._grow_refused.add((node, self.nodes[node].pid))
                self.emit(ev.RECOVERY_FAILED, generation=self.generation,
                          details={"strategy": ELASTIC, "grow": True, "why": "returned ranks did not start "
                                   f"within start_timeout ({self.spec.start_timeout:g} s): "
                                   f"{sorted(pending.newcomers - pending.newcomers_ready)}"})
            return
        members = set(self.members)
        dropped = {node for node in range(self.spec.nnodes) if not set(self._ranks_of(node)) & members}
        returned = sorted(node for node in dropped & self._alive_nodes()
                          if (node, self.nodes[node].pid) not in self._grow_refused)
        if not returned:
            # A spare that joined since the shrink takes a dropped node's place (it says hello as it).
            self._adopt_spares_for(dropped)
            return
        if any(record.done for record in self.ranks.values()):
            return
        newcomers = {rank for node in returned for rank in self._ranks_of(node)}
        pending = ActiveRecovery(ELASTIC, Fault("node_returned", node=returned[0], step=self._committed_step()),
                                 self.generation, self.generation + 1, sorted(members | newcomers),
                                 survivors=set(members), newcomers=newcomers, started=now, grow=True,
                                 deadline=now + self.spec.start_timeout)
        self.pending_grow = pending
        for node in returned:
            self._order_replace(node, self._ranks_of(node), pending.generation, grow=True)

    def _begin_grow(self, pending: ActiveRecovery, now: float) -> None:
        """Every returned rank is up: end the running generation and regroup with them."""
        self.pending_grow = None
        old_generation = self.generation
        self.generation = pending.generation
        self.abort_generation = old_generation  # survivors leave at their next step boundary and check in
        for rank in sorted(pending.newcomers):
            self.ranks[rank] = RankRecord(rank, self._node_of(rank), pending.generation, now)
        pending.deadline = now + self.spec.start_timeout + self.spec.comm_timeout
        self.recovery = pending
        self._transition(JobState.RECOVERING)
        self.emit(ev.RECOVERY_BEGIN, generation=self.generation, step=self._committed_step(),
                  details={"strategy": ELASTIC, "grow": True, "old_generation": old_generation,
                           "survivors": sorted(pending.survivors), "newcomers": sorted(pending.newcomers),
                           "newcomers_started_in": round(now - pending.started, 3)})
        self._cond.notify_all()

    def _replace(self, node: int, ranks: list[int], now: float) -> None:
        """Order ``node``'s agent to restart ``ranks`` as replacements in the recovery's generation."""
        for rank in ranks:
            self.ranks[rank] = RankRecord(rank, node, self.generation, now)
        self._order_replace(node, ranks, self.generation)

    def _order_replace(self, node: int, ranks: list[int], generation: int, **details: Any) -> None:
        """Queue ``node``'s order to start ``ranks`` as newcomers of ``generation``."""
        self.nodes[node].orders.append(Order(kind=OrderKind.REPLACE, generation=generation, ranks=ranks,
                                             world_size=self.spec.world_size, store_port=self.store_port,
                                             restart_count=self.restart_count))
        self.emit(ev.REPLACE, node=node, generation=generation, details={"ranks": ranks, **details})
        self._cond.notify_all()

    def _tick_recovery(self, now: float) -> None:
        recovery = self.recovery
        assert recovery is not None
        finished = sorted(rank for rank in recovery.survivors if self.ranks[rank].done)
        if finished:
            self._recovery_failed(f"survivor(s) {finished} already finished training", None, now)
            return
        fault = self._find_fault(now)
        if fault is not None and not self._fault_absorbed(fault, recovery, now):
            self._recovery_failed(f"second fault during {recovery.strategy}: {fault.describe()}", fault, now)
            return
        self._adopt_spares_for(recovery.awaited_nodes)
        for node in sorted(recovery.awaited_nodes):
            if self._node_alive(node):
                recovery.awaited_nodes.discard(node)
                self._replace(node, sorted(r for r in recovery.newcomers if self.ranks[r].node == node), now)
        if recovery.awaited_nodes and recovery.may_shrink and now >= recovery.reschedule_deadline:
            if not self._shrink(recovery, now):
                return
        if recovery.plan is None and recovery.ready():
            plan = recovery.make_plan()
            self.plans[plan.generation] = plan
            self.emit(ev.RECOVERY_PLAN, generation=plan.generation, step=plan.target_step,
                      details={"strategy": plan.strategy, "action": plan.action, "source_rank": plan.source_rank,
                               "receivers": plan.receivers, "world_size": plan.world_size,
                               "seconds": round(now - recovery.started, 4)})
            if plan.action != "dump":
                old_world = len(self.members)
                self.members = list(plan.members)
                self.ranks = {rank: self.ranks[rank] for rank in self.members}
                for rank in recovery.survivors | recovery.newcomers:
                    self.ranks[rank].step = plan.target_step
                    self.ranks[rank].last_progress = None  # re-armed by the first step after the repair
                if recovery.grow:
                    self.emit(ev.ELASTIC_GROW, generation=plan.generation, step=plan.target_step,
                              details={"old_world_size": old_world, "new_world_size": len(self.members),
                                       "seconds": round(now - recovery.started, 4)})
                self.recovery = None
                self._transition(JobState.RUNNING)
            self._cond.notify_all()
        elif now > recovery.deadline:
            waiting = recovery.missing() or sorted(recovery.awaited_nodes)
            self._recovery_failed(f"{recovery.strategy} timed out waiting for {waiting}", None, now)

    def _fault_absorbed(self, fault: Fault, recovery: ActiveRecovery, now: float) -> bool:
        """A second fault that the running recovery can take in: a survivor's process died before
        it checked in (it becomes a replacement too), or the same fault seen twice."""
        if fault.reason == "step_failed":
            return True
        if fault.rank is not None and fault.rank not in recovery.survivors | recovery.newcomers:
            return True  # a rank already counted as lost when the recovery began
        if recovery.plan is not None or recovery.strategy == DUMP or fault.rank is None:
            return False
        rank = fault.rank
        if rank in recovery.newcomers and self.ranks[rank].spawn_generation < recovery.generation:
            return True  # the old process of a rank already being replaced
        if fault.reason in PROCESS_FAULTS and rank in recovery.survivors and rank not in recovery.checked_in \
                and self._node_alive(self.ranks[rank].node) \
                and RECOVER_IN_PLACE in self.spec.recover_strategy and self.spec.process_recover:
            recovery.survivors.discard(rank)
            recovery.newcomers.add(rank)
            recovery.strategy = RECOVER_IN_PLACE if recovery.strategy == RETRY else recovery.strategy
            self._replace(self.ranks[rank].node, [rank], now)
            return bool(recovery.survivors)
        return False

    def _recovery_failed(self, why: str, fault: Fault | None, now: float) -> None:
        recovery = self.recovery
        assert recovery is not None
        self.emit(ev.RECOVERY_FAILED, generation=self.generation, details={"strategy": recovery.strategy,
                                                                           "why": why})
        self.faults_total["recovery_failed"] += 1
        excluded = frozenset({RETRY, RECOVER_IN_PLACE, RECOVER, ELASTIC, DUMP})
        self.recovery = None
        self._transition(JobState.RUNNING)
        self._decide_and_act(fault or recovery.fault, now, excluded)

    def _dump_committed(self, event: Event) -> None:
        # The dump already counted against max_restarts: the restart that loads it is the same recovery.
        self._begin_job_restart(f"dying checkpoint of step {event.step} committed", time.time(), count=False)

    # ---------------------------------------------------------------- generations

    def _start_generation(self, now: float) -> None:
        self.generation += 1
        self._pending_faults.clear()
        self._step_failures.clear()
        world_size = self.spec.world_size
        self.ranks = {}
        self.members = list(range(world_size))
        for node in sorted(self.nodes.values(), key=lambda n: n.node):
            if not node.alive or node.standby:
                continue
            ranks = self._ranks_of(node.node)
            for rank in ranks:
                self.ranks[rank] = RankRecord(rank, node.node, self.generation, now)
            node.orders.append(Order(kind=OrderKind.START, generation=self.generation, ranks=ranks,
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
        self.recovery = None
        self._order_all(Order(kind=OrderKind.EXIT, generation=self.generation, reason=message))
        self.emit(ev.JOB_END, generation=self.generation, step=self._committed_step(),
                  details={"outcome": state.value, "exit_code": exit_code, "message": message,
                           "restarts": self.restart_count})

    # ---------------------------------------------------------------- helpers

    def _ranks_of(self, node: int) -> list[int]:
        per_node = self.spec.nproc_per_node
        return list(range(node * per_node, (node + 1) * per_node))

    def _node_of(self, rank: int) -> int:
        return rank // self.spec.nproc_per_node

    def _node_alive(self, node: int) -> bool:
        record = self.nodes.get(node)
        return record is not None and record.alive

    def _transition(self, target: JobState) -> None:
        check_transition(self.state, target)
        self.state = target

    def _order_all(self, order: Order) -> None:
        for node in self.nodes.values():
            if node.alive:
                node.orders.clear()
                node.orders.append(order)
        self._cond.notify_all()

    def _alive_nodes(self) -> set[int]:
        """Nodes whose agent is alive and serves ranks (spares excluded)."""
        return {n.node for n in self.nodes.values() if n.alive and not n.standby}

    def _all_nodes_alive(self) -> bool:
        return self._alive_nodes() == set(range(self.spec.nnodes))

    def _adopt_spares_for(self, nodes: set[int]) -> None:
        """Order an idle spare agent to take the place of each node in ``nodes`` that is not alive
        (pod-level rescheduling onto a standby node: ``undying run --standby``)."""
        for lost in sorted(nodes):
            if self._node_alive(lost) or any(n.adopting == lost for n in self.nodes.values()):
                continue
            spare = next((n for n in sorted(self.nodes.values(), key=lambda n: n.node)
                          if n.standby and n.alive and n.adopting is None), None)
            if spare is None:
                return
            spare.adopting = lost
            self.adopted_by[lost] = spare.node
            spare.orders.append(Order(kind=OrderKind.ADOPT, node=lost, generation=self.generation,
                                      reason=f"take the place of node {lost}"))
            self.emit(ev.STANDBY_ADOPT, node=lost, generation=self.generation,
                      details={"spare": spare.node, "host": spare.hostname})
            self._cond.notify_all()

    def _all_agents_gone(self) -> bool:
        assert self._finished_at is not None
        if time.time() - self._finished_at > EXIT_GRACE:
            return True
        return all(node.exit_delivered or not node.alive for node in self.nodes.values())

    def _missing_nodes_message(self, phase: str) -> str:
        missing = sorted(set(range(self.spec.nnodes)) - self._alive_nodes())
        return f"node(s) {missing} did not join within node_return_timeout ({self.spec.node_return_timeout:g} s) at {phase}"

    def _committed_step(self) -> int:
        # A rank restored by a failover knows no step until it beats here (one that died with the
        # old leader never does): the others tell where the job stands.
        known = [record.step for record in self.ranks.values() if record.step_known]
        return min(known, default=0)

    def status(self) -> dict[str, Any]:
        with self._cond:
            now = time.time()
            recovery = self.recovery
            return {
                "job_id": self.job_id,
                "state": self.state.value,
                "generation": self.generation,
                "restart_count": self.restart_count,
                "max_restarts": self.spec.max_restarts,
                "world_size": len(self.members) or self.spec.world_size,
                "members": list(self.members),
                "committed_step": self._committed_step(),
                "message": self.message,
                "uptime_seconds": now - self.started,
                "faults": dict(self.faults_total),
                "recovery": None if recovery is None else {
                    "strategy": recovery.strategy, "generation": recovery.generation,
                    "waiting_for": recovery.missing(), "awaited_nodes": sorted(recovery.awaited_nodes)},
                "nodes": {
                    str(n.node): {"alive": n.alive, "pid": n.pid, "host": n.hostname, "standby": n.standby,
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
