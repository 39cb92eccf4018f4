"""The controller's shell: the lock, the clock, long polls and failover around the job machine.

One per job, in the ``undying run`` process of node 0 (or of the leading candidate with
``--etcd``). Every decision is the job machine's (``machine.py``); this module only feeds it
observations with ``time.monotonic()``, holds agents' polls and workers' check-ins open until
the machine has something for them, writes the events it emits to the job's log, kills the
simulated nodes it declares lost, and saves its state to etcd after each change (a refused
save means another controller leads: this one stops deciding). The machine is handed the time
every TICK, and at once after an observation that carried news (``News``), not after routine ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

from undying.client import format_address
from undying.config import JobSpec
from undying.controller.deadlines import LONGEST_HOLD, TICK
from undying.controller.job import Effects
from undying.controller.machine import JobMachine
from undying.controller.metrics import JobMetrics
from undying.controller.saved_state import export_state, resume
from undying.controller.state import JobState
from undying.controller.status import job_status
from undying.events import Event, EventLog
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
    Plan,
    PlanAction,
    RecoverRequest,
    hello_order,
)
from undying.root_probe import take_probe

T = TypeVar("T")
# How often a held poll checks that its agent's connection is still open.
PEER_CHECK = 0.1


class News(Enum):
    """Whether an observation may change a decision. News wakes the loop, which ticks at once (a
    reported exit is decided on now, not at the next TICK), and every thread waiting here (held
    polls, check-ins) looks again. Anything else leaves them asleep: at 16k ranks, a tick (a scan of
    every rank, ~4 ms) after each of 16k heartbeats and 800 poll calls a second needs many cores."""

    ALWAYS = "always"  # a hello, a lost or leaving agent, a worker's event, a cancel, a takeover
    IF_EFFECTS = "if effects"  # a poll, a check-in: news only if it queued events or nodes to kill
    NEVER = "never"  # a heartbeat: its events are log lines; what it records, the next tick reads


def wakes_loop(news: News, effects: Effects) -> bool:
    """Whether an observation of kind ``news`` that queued ``effects`` makes the loop tick at once."""
    return news is News.ALWAYS or (news is News.IF_EFFECTS
                                   and (effects.news or bool(effects.events or effects.kill_nodes)))


class NotInCharge(RuntimeError):
    """This controller lost (or cannot confirm) its leadership: clients must ask the new leader."""


class Controller:
    """Serves one job machine to many threads. ``run()`` blocks until the job ends."""

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
        t2_root: str | None = None,
    ) -> None:
        self.events = events
        self.t2_root = t2_root  # where this controller reads the agents' T2 probes (None: no T2 to check)
        self.on_node_lost = on_node_lost
        self.save_state = save_state  # failover jobs: writes the machine's state to etcd (False: deposed)
        self._saved: dict[str, Any] | None = None
        self.deposed = False  # another controller leads now: stop deciding, keep the job's processes
        # Failover jobs: False while this controller's lease is not known to be held (a process that
        # was frozen and woke up): it then decides nothing and answers nobody until it knows.
        self.in_charge: Callable[[], bool] = lambda: True
        self.machine = JobMachine(spec, job_id, format_address(store_host, store_port), injections_text,
                                  now=time.monotonic(), wall_offset=time.time() - time.monotonic())
        # Every event this controller logs feeds its metrics (counters, times, the live view).
        self.metrics = JobMetrics(status=self.status)
        events.add_listener(self.metrics.observe)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # held polls and check-ins wait here for a change
        self._loop_wake = threading.Condition(lock)  # the loop waits here for its next tick or news
        self._news = False  # an observation since the last tick may change a decision: tick now

    # ---------------------------------------------------------------- plumbing

    def _apply(self, call: Callable[[float], T], news: News = News.ALWAYS) -> T:
        """Hand the machine one observation (under the lock), then carry out its effects; if it
        carried ``news``, wake the loop to tick and the threads waiting here. A check-in is news
        only with effects: waiting check-ins that woke each other would spin."""
        result = call(time.monotonic())
        effects = self.machine.take_effects()
        for event in effects.events:
            self.events.emit(event)
        if self.on_node_lost is not None:
            for node in effects.kill_nodes:
                self.on_node_lost(node)
        if wakes_loop(news, effects):
            self._wake()
        return result

    def _wake(self, waiters: bool = True) -> None:
        """The loop ticks at once; ``waiters``: the held polls and check-ins look again too."""
        self._news = True
        self._loop_wake.notify()
        if waiters:
            self._cond.notify_all()

    def _check_in_charge(self) -> None:
        if self.deposed or not self.in_charge():
            raise NotInCharge("this controller does not hold the job's leadership (failover)")

    def _save_if_changed(self) -> bool:
        if self.save_state is None or self.deposed:
            return not self.deposed
        state = export_state(self.machine)
        if state == self._saved:
            return True
        if not self.save_state(state):
            self.deposed = True
            self._wake()
            return False
        self._saved = state
        return True

    # ---------------------------------------------------------------- what the machine holds

    @property
    def state(self) -> JobState:
        return self.machine.state

    @property
    def generation(self) -> int:
        return self.machine.generation

    @property
    def exit_code(self) -> int | None:
        return self.machine.exit_code

    @property
    def message(self) -> str:
        return self.machine.message

    @property
    def store_address(self) -> str:
        return self.machine.store_address

    @property
    def backup_store(self) -> str:
        return self.machine.backup_store

    @backup_store.setter
    def backup_store(self, address: str) -> None:
        with self._cond:
            self.machine.backup_store = address

    @property
    def nodes(self) -> dict[int, Any]:
        return self.machine.membership.nodes

    @property
    def claimed_injections(self) -> set[int]:
        return self.machine.claimed_injections

    # ---------------------------------------------------------------- agents

    def emit(self, kind: str, **fields: Any) -> Event:
        return self.events.emit(Event(kind=kind, **fields))

    def hello(self, hello: AgentHello) -> HelloReply:
        # The probe is read before the lock: storage (a shared filesystem, an object store) may be slow.
        problem = ""
        if hello.root_probe and self.t2_root is not None:
            problem = take_probe(self.t2_root, hello.root_probe)
        with self._cond:
            self._check_in_charge()
            return self._apply(lambda now: self.machine.hello(now, hello, problem))

    def reserve_spare_id(self) -> int:
        """A node id no agent of this job has used: for a spare, or a node that returns as one."""
        with self._cond:
            return self.machine.membership.reserve_spare_id()

    def poll(self, poll: AgentPoll, connected: Callable[[], bool] | None = None) -> Order:
        """An agent reports its workers and waits up to ``poll.wait`` s for its next order;
        ``connected`` says whether the agent still holds the request open (its process lives)."""
        deadline = time.monotonic() + max(0.0, min(poll.wait, LONGEST_HOLD))
        with self._cond:
            self._check_in_charge()
            node = self._apply(lambda now: self.machine.agent_report(now, poll), News.IF_EFFECTS)
            if node is None:
                return hello_order()
            while not node.orders and node.alive:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, PEER_CHECK))
                if connected is not None and not connected():
                    self._apply(lambda now: self.machine.agent_disconnected(now, poll.node, poll.pid))
                    return hello_order()
            self._check_in_charge()  # orders queued by a controller that lost its lease are not handed out
            order = self._apply(lambda now: self.machine.take_order(now, node), News.IF_EFFECTS)
            if order.kind != OrderKind.NONE:
                self._wake(waiters=False)  # the loop sees the job's end (every exit order taken) at once
            return order

    def report(self, poll: AgentPoll) -> None:
        """An agent's immediate report of a worker's exit or stop, or its beat (no workers: news to
        nobody, as a rank's heartbeat). No order is handed out here."""
        with self._cond:
            self._check_in_charge()
            self._apply(lambda now: self.machine.agent_report(now, poll), News.ALWAYS if poll.workers else News.NEVER)

    def agent_leaving(self, leave: AgentLeave) -> bool:
        """A node's agent announces a planned leave (see ``JobMachine.agent_leaving``)."""
        with self._cond:
            self._check_in_charge()
            return self._apply(lambda now: self.machine.agent_leaving(now, leave))

    def agent_disconnected(self, node_id: int, pid: int) -> None:
        """The connection an agent polled on closed (its process may have died)."""
        with self._cond:
            if not self.deposed and self.in_charge():
                self._apply(lambda now: self.machine.agent_disconnected(now, node_id, pid))

    def report_agent_exit(self, node_id: int, returncode: int | None) -> None:
        """The launcher saw a local agent process end (a simulated node's death)."""
        with self._cond:
            self._apply(lambda now: self.machine.agent_exited(now, node_id, returncode))

    def agent_id_of(self, node: int) -> int:
        """The agent process id (as the launcher started it) now serving ``node``."""
        with self._cond:
            return self.machine.membership.adopted_by.get(node, node)

    def node_down_remaining(self, node: int) -> float:
        """Seconds an injected node fault still keeps ``node`` from being rescheduled."""
        with self._cond:
            return self.machine.node_down_remaining(time.monotonic(), node)

    # ---------------------------------------------------------------- workers

    def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        with self._cond:
            self._check_in_charge()
            return self._apply(lambda now: self.machine.heartbeat(now, beat), News.NEVER)

    def worker_event(self, event: Event | dict[str, Any]) -> None:
        """A worker's event (as the HTTP route checked it, message_checks.worker_event, or its fields)."""
        event = event if isinstance(event, Event) else Event.from_dict(event)
        with self._cond:
            self._check_in_charge()
            self._apply(lambda now: self.machine.worker_event(now, event))

    def recover(self, request: RecoverRequest) -> Plan:
        """A worker checks in after its step failed (or a replacement on joining); answers with its plan."""
        deadline = time.monotonic() + max(0.0, min(request.wait, LONGEST_HOLD))
        with self._cond:
            while True:
                self._check_in_charge()
                plan = self._apply(lambda now: self.machine.check_in(now, request), News.IF_EFFECTS)
                if plan.action != PlanAction.WAIT or time.monotonic() >= deadline:
                    return plan
                self._cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))

    def claim_injection(self, claim: InjectionClaim) -> bool:
        with self._cond:
            self._check_in_charge()
            if self.deposed or not self._apply(lambda now: self.machine.claim_injection(now, claim)):
                return False
            # The fault may follow at once (a node kill takes this controller with it): save first,
            # so a successor does not hand out the same injection again.
            return self._save_if_changed()

    def cancel(self, why: str) -> None:
        with self._cond:
            self._apply(lambda now: self.machine.cancel(now, why))

    def request_stop(self, why: str, at_once: bool = False) -> None:
        """Stop the job: its newest committed step persisted first, unless ``at_once`` (JobMachine.request_stop)."""
        with self._cond:
            self._apply(lambda now: self.machine.request_stop(now, why, at_once))

    def status(self) -> dict[str, Any]:
        with self._cond:
            return job_status(self.machine, time.monotonic(), self.metrics, time.time())

    # ---------------------------------------------------------------- the loop and failover

    def run(self) -> int | None:
        """Drive the job to its end; returns the process exit code (None: deposed, another leads)."""
        with self._cond:
            while True:
                if not self.deposed and self.in_charge():
                    self._apply(self.machine.tick)  # wakes the threads waiting here to look again
                    self._save_if_changed()
                self._news = False
                if self.deposed:
                    return None
                if self.machine.state.terminal and self.machine.all_agents_gone(time.monotonic()):
                    break
                self._sleep_until_news(time.monotonic() + TICK)
        assert self.machine.exit_code is not None
        return self.machine.exit_code

    def _sleep_until_news(self, next_tick: float) -> None:
        """Until the next tick is due or an observation carries news."""
        while not self._news and not self.deposed:
            remaining = next_tick - time.monotonic()
            if remaining <= 0:
                return
            self._loop_wake.wait(remaining)

    def depose(self) -> None:
        """Another controller leads (our etcd lease is gone): stop deciding at once."""
        with self._cond:
            self.deposed = True
            self._wake()

    def export_state(self) -> dict[str, Any]:
        with self._cond:
            return export_state(self.machine)

    def resume(self, saved: dict[str, Any], why: str, live: set[tuple[str, int]] | None = None) -> None:
        """Take over a job another controller ran (see ``saved_state.resume``)."""
        with self._cond:
            self._apply(lambda now: resume(self.machine, saved, why, now, live))
