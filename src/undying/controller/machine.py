"""The job machine: the controller's every decision, as a pure state machine.

Runs in the controller process, driven by the shell (``controller/core.py``) under its lock.
It has no threads, sockets or clock of its own: each call hands it one observation (an agent's
hello or poll, a heartbeat, a worker's event or check-in, a lost agent, time passing) with
the monotonic time ``now``, and it answers with a reply and queues effects: events to log,
orders for agents (handed out when they poll), nodes to kill (simulated nodes). The state
it keeps is what a successor controller resumes from (``saved_state.py``).

Loop (compare torchelastic's ``_invoke_run``): detect (``detection.py``) -> decide (the chain,
``strategies/__init__.py``; ``crash_loop.py`` stops a job its recoveries bring no further) -> the
chosen strategy's executor (``strategies/*.py``) owns the recovery until it ends or hands it over
(``JobCore.hand_over``). The job's state and the changes the executors make to it are ``JobCore``
(``job.py``); this module adds the observations and ``tick``, and asks the executor that owns what
the job does (``JobCore.active_strategy``), never a named one.
"""

from __future__ import annotations

from typing import Any

from undying import events as ev
from undying.controller import strategies
from undying.controller.admission import hello_refusal
from undying.controller.deadlines import HEARTBEAT_LOG_EVERY
from undying.controller.fitness import check_after_restart, join_as_unfit_spare, unfit_reason
from undying.controller.job import Effects, JobCore
from undying.controller.membership import NodeRecord
from undying.controller.state import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    JobState,
)
from undying.controller.strategies.base import stamped
from undying.events import Event
from undying.faults import Fault, FaultReason
from undying.inject import decode as decode_injections
from undying.protocol import (
    AgentHello,
    AgentLeave,
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
    WorkerStatus,
    hello_order,
)
from undying.root_probe import refusal as unshared_root
from undying.strategy_names import StrategyName

__all__ = ["Effects", "JobMachine"]  # Effects: what the shell (core.py) takes after each call


class JobMachine(JobCore):
    """One job's decisions: the observations and time passing, on the job's state and its changes
    (``JobCore``). Not thread-safe: the shell serialises calls."""

    # ---------------------------------------------------------------- agents

    def hello(self, now: float, hello: AgentHello, root_problem: str = "") -> HelloReply:
        """An agent joins; ``root_problem``: why its node does not share the T2 root (root_probe.py)."""
        self.now = now
        refused = hello_refusal(self.spec, self.state, hello)
        if refused:
            return HelloReply(self.job_id, self.store_port, False, refused)
        if root_problem:
            message = unshared_root(hello.node, hello.hostname, root_problem)
            self.emit(ev.CHECKPOINT_ROOT_UNSHARED, node=hello.node,
                      details={"host": hello.hostname, "problem": root_problem})
            if self.state is JobState.WAITING_FOR_NODES:
                self.finish(JobState.FAILED, EXIT_REFUSED, message, now)  # before a single rank ran
            return HelloReply(self.job_id, self.store_port, False, message)
        why_unfit = unfit_reason(self.membership, hello)
        if why_unfit:
            return join_as_unfit_spare(self, hello, why_unfit, now)
        if not hello.standby:
            self.membership.unfit_places.discard(hello.node)
        nodes = self.membership.nodes
        previous = nodes.get(hello.node)
        if previous is not None and previous.alive and hello.pid and previous.pid == hello.pid \
                and previous.hostname == hello.hostname and previous.standby == hello.standby:
            return HelloReply(self.job_id, self.store_port)  # the same agent's hello again (a retry): no news
        if not hello.standby and previous is not None and previous.alive and hello.node in self.membership.adopted_by \
                and previous.pid != hello.pid:
            return self._returned_as_spare(hello, now)
        if hello.standby and previous is not None and previous.alive and previous.pid != hello.pid \
                and previous.disconnected_since is None:
            # Another agent, still connected, holds this id (one the controller gave a returning node's
            # agent, or a spare started twice with one id): a spare's id is only a label, so this one
            # gets a new one, rather than the two taking it from each other at every hello. (A spare
            # whose agent restarted finds its old connection closed: it takes its id back below.)
            return self._returned_as_spare(hello, now)
        if not hello.standby:
            # The node is back (as a rule the spare ordered to take its place, saying hello as the node):
            # the spare's record, kept so that no second spare was sent for the node meanwhile, goes.
            for spare in [n for n in nodes.values() if n.standby and n.adopting == hello.node]:
                del nodes[spare.node]
        if previous is not None and previous.alive:
            # A node's agent came back before anyone saw it go: its workers are gone all the same.
            self.lose_node(previous, "agent said hello again (restarted)", now, kill=False)
        nodes[hello.node] = NodeRecord(hello.node, hello.pid, hello.hostname, now, standby=hello.standby)
        details: dict[str, Any] = {"pid": hello.pid, "host": hello.hostname, "standby": hello.standby}
        if hello.check:
            details["check"] = hello.check.get("timings", {})  # its health check's times (agent/node_check.py)
        self.emit(ev.AGENT_REGISTERED, node=hello.node, details=details)
        return HelloReply(self.job_id, self.store_port)

    def _returned_as_spare(self, hello: AgentHello, now: float) -> HelloReply:
        """A node's agent is back while the spare that adopted its place serves its ranks: it
        joins as a spare (it holds no ranks: its workers were replaced), not as the node again. Also
        a spare whose id a live agent holds: it joins under a new one."""
        spare_id = self.membership.reserve_spare_id()
        self.membership.nodes[spare_id] = NodeRecord(spare_id, hello.pid, hello.hostname, now, standby=True)
        where = {"asked_for": hello.node} if hello.standby else {
            "returned_node": hello.node, "served_by": self.membership.adopted_by[hello.node]}
        self.emit(ev.AGENT_REGISTERED, node=spare_id, details={
            "pid": hello.pid, "host": hello.hostname, "standby": True, **where})
        return HelloReply(self.job_id, self.store_port, node=spare_id)

    def agent_report(self, now: float, poll: AgentPoll) -> NodeRecord | None:
        """An agent reports its workers (a poll, or its immediate report of an exit). Returns its node's
        record, or None when the agent does not hold that node's place (it must say hello)."""
        self.now = now
        node = self.membership.nodes.get(poll.node)
        if node is None or not node.alive or not node.polled_by_owner(poll.pid, poll.hostname):
            return None
        node.last_seen = now
        node.last_heard = now
        node.confirmed = True
        node.disconnected_since = None
        if poll.check:
            check_after_restart(self, node, poll.check, now)
        for raw in poll.workers:
            status = WorkerStatus.from_dict(raw)
            node.workers[status.rank] = status
            if not self.state.terminal:  # once the job has ended, its workers being stopped is no news
                self.detector.record_worker(node, status, self.generation)
        return node

    def take_order(self, now: float, node: NodeRecord) -> Order:
        """The order a polling agent leaves with (the shell held the poll open until one was queued)."""
        self.now = now
        node.last_seen = now
        if not node.alive:
            return hello_order()
        order = node.orders.popleft() if node.orders else Order()
        if order.kind == OrderKind.EXIT:
            node.exit_delivered = True
        # An ADOPT order: the spare says hello again as the node it adopts; its record stays (adopting
        # that node) until then, so that the node is not given a second spare meanwhile.
        return order

    def agent_leaving(self, now: float, leave: AgentLeave) -> bool:
        """A node announces it is leaving (its ``undying run`` got SIGTERM: a preempted or drained pod):
        it is lost now, as a planned leave, before its workers stop, so the chain handles a lost node
        (a spare takes its place, or elastic training shrinks without waiting for it to come back)."""
        self.now = now
        node = self.membership.nodes.get(leave.node)
        if self.state.terminal or node is None or not node.alive \
                or not node.polled_by_owner(leave.pid, leave.hostname):
            return False
        self.lose_node(node, f"left the job: {leave.reason or 'SIGTERM'}", now, kill=False, planned=True)
        return True

    def agent_disconnected(self, now: float, node_id: int, pid: int) -> None:
        """The connection an agent polled on closed. A live agent polls again at once (its client
        reconnects); one that does not within ``disconnected_agent_lost_after`` is lost (detection.py),
        and until then a survivor's failed step is not taken for the fault."""
        self.now = now
        node = self.membership.nodes.get(node_id)
        if node is None or not node.alive or node.exit_delivered or (pid and node.pid and pid != node.pid):
            return
        if node.disconnected_since is None:
            node.disconnected_since = now
            self.emit(ev.AGENT_DISCONNECTED, node=node_id, generation=self.generation, details={"pid": pid})

    def agent_exited(self, now: float, agent_id: int, returncode: int | None) -> None:
        """The launcher saw a local agent process end (a simulated node's death)."""
        self.now = now
        membership = self.membership
        adopted = [node for node, spare in membership.adopted_by.items() if spare == agent_id]
        node = membership.nodes.get(adopted[0] if adopted and agent_id not in membership.nodes else agent_id)
        if node is not None and node.alive and not node.exit_delivered:
            self.lose_node(node, f"agent process ended (returncode {returncode})", now)

    # ---------------------------------------------------------------- workers

    def heartbeat(self, now: float, beat: Heartbeat) -> HeartbeatReply:
        self.now = now
        reply = HeartbeatReply(abort_generation=self.abort_generation, end_generation=self.end_generation,
                               mirror_store=self.backup_store)
        record = self.membership.ranks.get(beat.rank)
        if record is None or beat.generation < record.spawn_generation or beat.generation > self.generation:
            return reply
        self.detector.record_heartbeat(record, beat, now)
        record.committing = beat.committing
        self.suspects.heartbeat(beat)
        self.crash_loop.heard(beat.generation, beat.step, beat.phase)
        if beat.mesh_shard:
            self.membership.mesh_shard = beat.mesh_shard
            self.membership.mesh_peer_copies = beat.mesh_peer_copies
        if record.logged_step != beat.step and now - record.last_logged >= HEARTBEAT_LOG_EVERY:
            record.last_logged = now
            record.logged_step = beat.step
            # The scalars sit beside the phase (``events.heartbeat_scalars`` reads them back).
            details: dict[str, Any] = {**beat.scalars, "phase": beat.phase}
            if beat.max_steps:
                details["max_steps"] = beat.max_steps
            if beat.timed_steps:  # a dict: not one of the scalars beside the phase
                details["step_times"] = {"steps": beat.timed_steps, "compute": beat.compute_seconds,
                                         "comm": beat.comm_seconds, "data": beat.data_seconds}
            self.emit(ev.HEARTBEAT, node=beat.node, rank=beat.rank, step=beat.step,
                      generation=beat.generation, details=details)
        return reply

    def _committed_before_bad_step(self, event: Event) -> None:
        """A bad step stops the job: every member joined that step's commit vote (the bad-step check
        rides on it), so every one has committed the steps before it (its committed step is the bad
        step's number), whatever its last heartbeat (sent at most every 0.1 s) said. The job's end
        then records that step."""
        if event.step is None:
            return
        for record in self.membership.ranks.values():
            if record.spawn_generation <= (event.generation or self.generation) and record.step < event.step:
                record.step, record.step_known = event.step, True

    def worker_event(self, now: float, event: Event) -> None:
        self.now = now
        record = self.membership.ranks.get(event.rank) if event.rank is not None else None
        if event.kind == ev.WORKER_DONE and record is not None:
            if not record.done:
                record.done_at = now
            record.done = True
            record.step = event.step or record.step
            record.step_known = record.step_known or bool(event.step)
        # Names a bad step's ranks before it is logged.
        stop = self.suspects.worker_event(self.membership, event, self.state.terminal)
        self.effects.events.append(event)
        if stop:
            self._committed_before_bad_step(event)
            self.finish(JobState.FAILED, EXIT_FAILED, stop, now)
        if event.kind == ev.CHECKPOINT_SAVE and event.step is not None:
            self.persist_health.saved(event.step, now)
        elif event.kind == ev.PERSIST_FAILED and event.step is not None:
            failed = self.persist_health.failed(event.step, event.rank, str(event.details.get("reason", "")), now)
            if failed is not None:
                self.emit(ev.CHECKPOINT_FAILED, step=event.step, generation=event.generation, details=failed)
        owner = self.active_strategy()
        if owner is not None:
            strategies.executor_for(owner).on_worker_event(self, event, now)

    def check_in(self, now: float, request: RecoverRequest) -> Plan:
        """A worker whose step failed (or a replacement, on joining) checks in; WAIT: ask again."""
        self.now = now
        record = self.membership.ranks.get(request.rank)
        if record is not None and record.pid is not None and request.pid != record.pid \
                and record.spawn_generation > request.generation:
            # An old process of a rank that was replaced meanwhile (its node froze and woke up).
            return Plan(action=PlanAction.EXIT, reason=f"rank {request.rank} is served by process {record.pid} now")
        if record is not None:
            record.phase = Phase.RECOVERING
            record.last_heartbeat = now
        recovery = self.recovery
        if recovery is not None:  # its owner records it and answers
            owner = strategies.executor_for(recovery.strategy)
            owner.check_in(self, recovery, request, now)
            return owner.plan_for(self, recovery, request)
        pending = self.pending_grow
        if request.newcomer and pending is not None and request.generation == pending.generation:
            strategies.executor_for(pending.strategy).check_in(self, pending, request, now)
        elif not request.newcomer and self.state is JobState.RUNNING and request.generation == self.generation:
            # A step failure: news when it is one (the detector holds it briefly for its real cause).
            self.effects.news |= self.detector.step_failed(now, Fault(
                FaultReason.STEP_FAILED, node=record.node if record else request.node, rank=request.rank,
                step=request.committed_step, detail=request.reason[:300], error=request.error,
                log_tail=tuple(request.error_tail)), request.generation)
        return self._plan_without_recovery(request)

    def _plan_without_recovery(self, request: RecoverRequest) -> Plan:
        if self.state is JobState.RUNNING:
            formed = self.plans.get(self.generation)
            # The plan was published while this worker was between two polls.
            fits = request.generation < self.generation or (request.newcomer and request.generation == self.generation)
            return stamped(self, formed) if formed is not None and fits else Plan(action=PlanAction.WAIT)
        if self.state in (JobState.STOPPING, JobState.RESTARTING) or self.state.terminal:
            return Plan(action=PlanAction.EXIT, reason=f"job {self.state.value}")
        return Plan(action=PlanAction.WAIT)

    def claim_injection(self, now: float, claim: InjectionClaim) -> bool:
        self.now = now
        record = self.membership.ranks.get(claim.rank)
        stale = record is None or claim.generation < record.spawn_generation
        injection = next((i for i in decode_injections(self.injections_text) if i.index == claim.index), None)
        if claim.index in self.claimed_injections or stale or injection is None:
            return False
        self.claimed_injections.add(claim.index)
        if injection.kind == "node" and injection.down is not None:
            self.node_down_until[claim.node] = now + injection.down
        return True

    def node_down_remaining(self, now: float, node: int) -> float:
        """Seconds an injected node fault still keeps ``node`` from being rescheduled."""
        return max(0.0, self.node_down_until.get(node, 0.0) - now)

    def cancel(self, now: float, why: str) -> None:
        self.now = now
        if not self.state.terminal:
            self.finish(JobState.CANCELLED, EXIT_CANCELLED, why, now)

    def request_stop(self, now: float, why: str, at_once: bool = False) -> None:
        """Stop the job: gracefully (every rank persists the newest committed step, strategies/stop.py)
        as soon as it trains, or at once (``at_once``, a job that writes no T2 or has not started:
        cancelled). Asking again for a graceful stop (every node of a Slurm step is signalled) changes nothing."""
        self.now = now
        if self.state.terminal or (self.stop_requested is not None and not at_once):
            return
        if at_once or not self.spec.checkpoint.persist or self.state is JobState.WAITING_FOR_NODES:
            self.cancel(now, why)
            return
        self.stop_requested = why
        self.stop_deadline = now + self.deadlines.graceful_stop
        if self.state is JobState.RUNNING and not self._training_ended():
            strategies.begin_stop(self, why, now)

    def _training_ended(self) -> bool:
        """Has a rank finished training? Then the job is ending by itself: a stop asked now lets it
        finish (every rank runs the same steps) rather than gather ranks that will not check in."""
        return any(record.done for record in self.membership.ranks.values())

    # ---------------------------------------------------------------- time passing

    def tick(self, now: float) -> None:
        self.now = now
        if self.state.terminal:
            return
        for node, why in self.detector.silent_agents(now):
            self.lose_node(node, why, now)
        if self.stop_requested is not None:
            if now > self.stop_deadline:
                self.cancel(now, f"{self.stop_requested}; the newest step could not be persisted within "
                                 f"stop_timeout ({self.spec.stop_timeout:g} s)")
                return
            if self.state is JobState.RUNNING and not self._training_ended():
                strategies.begin_stop(self, self.stop_requested, now)
                return
        if self.state is JobState.WAITING_FOR_NODES:
            self.adopt_spares_for(self.membership.unfit_places, now)  # a node that failed its check
            if self.membership.all_nodes_alive():
                self.start_generation(now)
            elif now > self.state_deadline:
                self.finish(JobState.FAILED, EXIT_FAILED, self.membership.missing_message("start", self.spec.node_return_timeout), now)
        elif self.state is JobState.RUNNING:
            fault = self.detector.find(now, self.generation)
            if fault is not None:
                strategies.handle_fault(self, fault, now)
            elif self.membership.ranks and all(r.done and r.exitcode == 0 for r in self.membership.ranks.values()):
                self.finish(JobState.SUCCEEDED, EXIT_OK, f"finished at step {self.membership.committed_step()}", now)
            else:
                self.suspects.find_stragglers(self.membership, self.emit, self.generation, now)
                for executor in strategies.executors():  # what a strategy starts by itself (a grow, a switch)
                    executor.while_running(self, now)
                    if self.state is not JobState.RUNNING:
                        break
        elif (owner := self.active_strategy()) is not None:  # recovering, stopping, restarting
            strategies.executor_for(owner).progress(self, now)

    def all_agents_gone(self, now: float) -> bool:
        """The job has ended and every agent took its exit order (or the grace ran out)."""
        assert self.finished_at is not None
        if now - self.finished_at > self.deadlines.exit_grace:
            return True
        return all(node.exit_delivered or not node.alive for node in self.membership.nodes.values())

    def act_on(self, fault: Fault, now: float, excluded: frozenset[StrategyName] = frozenset(),
               stateless: set[int] | None = None) -> None:
        """Let the chain decide again (a recovery failed: without the strategies in ``excluded``)."""
        strategies.act_on(self, fault, now, excluded, stateless)
