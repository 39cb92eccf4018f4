"""The job's state and every change the controller makes to it: what the strategies act through.

Runs in the controller process, inside the job machine. ``JobCore`` holds what one job is (its
state, generations, membership, the recovery or restart in progress, the effects queued for the
shell) and the methods that change it: a generation's start, a recovery's begin, hand-over and
end, a job restart's begin, the job's end, orders to agents. Each state change goes through
``transition`` (the table in ``state.py``). ``JobMachine`` (``machine.py``) adds the
observations and time passing on top; the executors (``strategies/``) see a ``JobCore`` only, so
neither this module nor they import the machine, and the machine is the only one that imports
the strategies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from undying import events as ev
from undying.config import JobSpec
from undying.controller.commit_drain import CommitDrain
from undying.controller.crash_loop import CrashLoop
from undying.controller.deadlines import Deadlines
from undying.controller.detection import FaultDetector
from undying.controller.membership import Membership, NodeRecord, RankRecord
from undying.controller.persist_health import PersistHealth
from undying.controller.recovery import ActiveRecovery
from undying.controller.state import JobState, check_transition
from undying.controller.suspects import Suspects
from undying.events import Event
from undying.faults import Fault, FaultReason
from undying.protocol import Order, OrderKind, Plan
from undying.strategy_names import StrategyName


@dataclass
class Effects:
    """What a call asks the shell to do once it returns."""

    events: list[Event] = field(default_factory=list)
    kill_nodes: list[int] = field(default_factory=list)  # simulated nodes whose agent was declared lost
    news: bool = False  # a decision may be due now (a new step failure, a recovery's last check-in)


class JobCore(ABC):
    """One job's membership, health, generations and recoveries. Not thread-safe: the shell serialises calls."""

    def __init__(self, spec: JobSpec, job_id: str, store_address: str, injections_text: str = "",
                 now: float = 0.0, wall_offset: float = 0.0, deadlines: Deadlines | None = None) -> None:
        self.spec = spec
        self.deadlines = deadlines or Deadlines.from_spec(spec)
        self.job_id = job_id
        self.store_address = store_address
        self.store_port = int(store_address.rsplit(":", 1)[1])
        self.injections_text = injections_text
        self.wall_offset = wall_offset  # wall time = monotonic + wall_offset (event times, saved state)
        self.state = JobState.WAITING_FOR_NODES
        self.generation = 0
        self.abort_generation = 0
        self.end_generation = 0  # a generation that ends at its next step boundary (an elastic grow)
        self.restart_count = 0  # recoveries of every kind (what max_restarts bounds)
        self.job_restarts = 0  # the job-level restarts among them
        self.crash_loop = CrashLoop(spec.crash_loop_limit)
        self.persist_health = PersistHealth()
        self.suspects = Suspects(spec)  # stragglers and transient bad steps: nodes to switch to a spare
        self.commit_drain: CommitDrain | None = None  # a job restart's stop held for a T2 commit
        self.stop_requested: str | None = None  # why the job was asked to stop (a graceful stop follows)
        self.stop_deadline = 0.0
        self.exit_code: int | None = None
        self.message = ""
        self.membership = Membership(spec.nnodes, spec.nproc_per_node)
        self.detector = FaultDetector(self.membership, self.deadlines, spec.watchdog, self.emit)
        self.recovery: ActiveRecovery | None = None  # owned by the executor of ``recovery.strategy``
        self.restarting_by: StrategyName | None = None  # the executor that owns a job restart (stopping, restarting)
        self.pending_grow: ActiveRecovery | None = None  # returned ranks starting while the survivors train
        self.grow_refused: set[tuple[int, int]] = set()  # (node, agent pid) already tried for a grow
        self.plans: dict[int, Plan] = {}  # generation -> the plan that formed it
        self.claimed_injections: set[int] = set()
        self.node_down_until: dict[int, float] = {}  # injected `node:...:down=D`: held down until
        self.faults_total: dict[str, int] = {}
        self.retries: dict[int, int] = {}  # step -> in-place retries
        self.backup_store = ""  # failover jobs: another node's store that keeps a second RNG mirror
        self.rng_stores: list[str] = []  # after a takeover: stores that may hold mirrors of earlier steps
        self.now = now  # the time of the observation being handled
        self.started = now
        self.state_deadline = now + self.deadlines.node_return
        self.finished_at: float | None = None
        self.effects = Effects()

    # ---------------------------------------------------------------- effects

    def emit(self, kind: str, **fields: Any) -> None:
        """Log an event, stamped with the time of the observation being handled."""
        self.effects.events.append(Event(kind=kind, time=self.now + self.wall_offset, **fields))

    def take_effects(self) -> Effects:
        effects, self.effects = self.effects, Effects()
        return effects

    def count_fault(self, reason: str) -> None:
        self.faults_total[reason] = self.faults_total.get(reason, 0) + 1

    # ---------------------------------------------------------------- who drives the job

    def active_strategy(self) -> StrategyName | None:
        """The strategy whose executor drives what the job does now: the recovery's owner (recovering),
        the job restart's (stopping, restarting); None while the job waits, trains or has ended."""
        return self.recovery.strategy if self.recovery is not None else self.restarting_by

    @abstractmethod
    def act_on(self, fault: Fault, now: float, excluded: frozenset[StrategyName] = frozenset(),
               stateless: set[int] | None = None) -> None:
        """Let the chain decide again (a recovery failed: without the strategies in ``excluded``);
        the job machine walks the chain (``strategies.act_on``)."""

    def transition(self, target: JobState) -> None:
        check_transition(self.state, target)
        self.state = target

    def abort_through(self, generation: int) -> None:
        """Every rank of ``generation`` or older leaves its collectives (told by its next heartbeat reply)."""
        self.abort_generation = max(self.abort_generation, generation)

    # ---------------------------------------------------------------- recoveries

    def begin_recovery(self, recovery: ActiveRecovery, at_boundary: bool = False, counted: bool = True) -> None:
        """Enter ``recovery``'s generation, owned by the executor of ``recovery.strategy``: the old one is
        aborted (its collectives left at once) or, ``at_boundary``, ended at its next step boundary
        (each rank finishes its step in flight; the first check-in aborts a straggler's step).
        ``counted``: it spends one of ``max_restarts``."""
        if counted:
            self.restart_count += 1
        old_generation, self.generation = self.generation, recovery.generation
        if at_boundary:
            self.end_generation = old_generation
        else:
            self.abort_through(old_generation)
        self.recovery = recovery
        self.transition(JobState.RECOVERING)

    def hand_over(self, to: StrategyName, why: str) -> None:
        """The active recovery's owner gives it to ``to``'s executor, which drives it from now on (its
        progress, check-ins, plan, end or failure); the one that hands over counts as tried for the
        fault (if the recovery fails, the chain skips both). Logged as ``recovery_handover``."""
        recovery = self.recovery
        assert recovery is not None and to != recovery.strategy
        previous = recovery.strategy
        recovery.tried.add(previous)
        recovery.strategy = to
        self.emit(ev.RECOVERY_HANDOVER, generation=recovery.generation, step=recovery.fault.step,
                  details={"from": previous, "to": to, "why": why})

    def end_recovery(self) -> None:
        """The recovery is over (its plan formed the generation that trains now, or it failed)."""
        self.recovery = None
        self.transition(JobState.RUNNING)

    def begin_restart(self, by: StrategyName, counted: bool = True) -> None:
        """A job restart, owned by ``by``'s executor, ends the generation (its workers are stopped)."""
        if counted:
            self.restart_count += 1
        self.job_restarts += 1
        self.recovery = None
        self.restarting_by = by
        self.abort_through(self.generation)
        self.transition(JobState.STOPPING)

    # ---------------------------------------------------------------- what the executors keep on the job

    def publish(self, plan: Plan) -> None:
        """``plan`` forms its generation: every check-in of it is answered with it from now on, and
        the crash-loop watch counts progress from its target step."""
        self.plans[plan.generation] = plan
        self.crash_loop.watch(plan.generation, plan.target_step)

    def count_retry(self, step: int) -> None:
        """One more in-place retry of ``step`` (retry's ``max_retries_per_step`` counts them)."""
        self.retries[step] = self.retries.get(step, 0) + 1

    def await_grow(self, pending: ActiveRecovery | None) -> None:
        """Returned ranks start while the survivors train (an elastic grow); None: none are awaited."""
        self.pending_grow = pending

    def refuse_grow(self, node: int, agent_pid: int) -> None:
        """This incarnation of ``node``'s agent failed to start its ranks for a grow: not asked again."""
        self.grow_refused.add((node, agent_pid))

    def hold_stop(self, drain: CommitDrain | None) -> None:
        """A job restart's stop held while a survivor finishes a T2 commit (None: not, or no longer)."""
        self.commit_drain = drain

    def deadline_at(self, deadline: float) -> None:
        """When the state the job is in (stopping, restarting, waiting for nodes) gives up."""
        self.state_deadline = deadline

    # ---------------------------------------------------------------- generations

    def start_generation(self, now: float, members: list[int] | None = None) -> None:
        """Start every rank of ``members`` (default: every rank of the job) on its node, afresh.
        Fewer members: a job restart at the size an elastic shrink left (job_restart.py)."""
        self.generation += 1
        self.detector.clear()
        self.suspects.new_generation()
        membership = self.membership
        world_size = self.spec.world_size
        membership.ranks = {}
        membership.members = list(range(world_size)) if members is None else list(members)
        shrunk = len(membership.members) < world_size
        for node in sorted(membership.nodes.values(), key=lambda n: n.node):
            if not node.alive or node.standby:
                continue
            ranks = [rank for rank in membership.ranks_of(node.node) if rank in membership.members]
            if not ranks:
                continue  # a node left out of a shrunk restart (elastic grow-back may bring it in)
            for rank in ranks:
                membership.ranks[rank] = RankRecord(rank, node.node, self.generation, now)
            node.orders.append(Order(kind=OrderKind.START, generation=self.generation, ranks=ranks,
                                     world_size=world_size, store_port=self.store_port,
                                     restart_count=self.restart_count,
                                     members=list(membership.members) if shrunk else []))
        previous = self.state
        self.transition(JobState.RUNNING)
        self.restarting_by = None
        self.crash_loop.watch(self.generation)
        details: dict[str, Any] = {"world_size": world_size, "restart_count": self.restart_count}
        if shrunk:
            details["members"] = list(membership.members)
        self.emit(ev.GENERATION_START, generation=self.generation, details=details)
        if previous is JobState.RESTARTING:
            self.emit(ev.RESTART_END, generation=self.generation, details={"restart_count": self.restart_count})

    def finish(self, state: JobState, exit_code: int, message: str, now: float) -> None:
        self.transition(state)
        self.exit_code = exit_code
        self.message = message
        self.finished_at = now
        self.recovery = None
        self.restarting_by = None
        self.order_all(Order(kind=OrderKind.EXIT, generation=self.generation, reason=message, exit_code=exit_code))
        self.emit(ev.JOB_END, generation=self.generation, step=self.membership.committed_step(),
                  details={"outcome": state.value, "exit_code": exit_code, "message": message,
                           "recoveries": self.restart_count, "job_restarts": self.job_restarts})

    # ---------------------------------------------------------------- nodes and orders

    def lose_node(self, node: NodeRecord, why: str, now: float, kill: bool = True, planned: bool = False) -> None:
        node.alive = False
        node.orders.clear()
        self.emit(ev.AGENT_LOST, node=node.node, generation=self.generation,
                  details={"why": why, "standby": node.standby, "planned": planned})
        if node.standby:
            return  # a spare held no ranks: nothing to recover
        if self.state in (JobState.RUNNING, JobState.RECOVERING):
            self.detector.pending.append(Fault(FaultReason.AGENT_LOST, node=node.node,
                                               step=self.membership.committed_step(),
                                               detail=why if planned else "", planned=planned))
        if kill and not self.state.terminal:
            self.effects.kill_nodes.append(node.node)

    def retire_node(self, node_id: int, why: str, now: float) -> None:
        """Take ``node_id``'s place from its agent for good (switched out, strategies/switch.py): it is
        told to say hello again (its workers stop) and joins as a spare never given ranks (fitness.py)."""
        self.now = now
        node = self.membership.nodes.get(node_id)
        if node is None or not node.alive:
            return
        node.alive = False
        node.orders.clear()
        self.membership.retired[(node.hostname, node.pid)] = why

    def order_all(self, order: Order) -> None:
        for node in self.membership.nodes.values():
            if node.alive:
                node.orders.clear()
                node.orders.append(order)

    def replace(self, node: int, ranks: list[int], now: float) -> None:
        """Order ``node``'s agent to restart ``ranks`` as replacements in the current generation."""
        for rank in ranks:
            # Its step is unknown until it beats: the job's committed step is the survivors'.
            self.membership.ranks[rank] = RankRecord(rank, node, self.generation, now, step_known=False)
        self.order_replace(node, ranks, self.generation, now)

    def order_replace(self, node: int, ranks: list[int], generation: int, now: float, **details: Any) -> None:
        """Queue ``node``'s order to start ``ranks`` as newcomers of ``generation``."""
        self.membership.nodes[node].orders.append(Order(
            kind=OrderKind.REPLACE, generation=generation, ranks=ranks, world_size=self.spec.world_size,
            store_port=self.store_port, restart_count=self.restart_count))
        self.emit(ev.REPLACE, node=node, generation=generation, details={"ranks": ranks, **details})

    def adopt_spares_for(self, nodes: set[int], now: float) -> None:
        """Order an idle spare agent to take the place of each node in ``nodes`` that is not alive
        (pod-level rescheduling onto a standby node: ``undying run --standby``)."""
        membership = self.membership
        for lost in sorted(nodes):
            if membership.node_alive(lost) or membership.being_adopted(lost):
                continue
            spare = membership.idle_spare()
            if spare is None:
                return
            spare.adopting = lost
            membership.adopted_by[lost] = spare.node
            spare.orders.append(Order(kind=OrderKind.ADOPT, node=lost, generation=self.generation,
                                      reason=f"take the place of node {lost}"))
            self.emit(ev.STANDBY_ADOPT, node=lost, generation=self.generation,
                      details={"spare": spare.node, "host": spare.hostname})
