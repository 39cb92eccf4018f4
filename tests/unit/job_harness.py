"""A job machine driven by the test, with a fake clock: the test plays every agent and worker.

No threads, no sleeps, no sockets. ``MachineController`` offers the shell's calls (hello, poll,
heartbeat, recover, ...) over a ``JobMachine``: a long poll or a check-in that would wait
advances the fake clock in the shell's tick steps instead, the machine ticking at each once
``Job.start()`` was called (as the shell's loop does once ``run()`` starts).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from undying.config import JobSpec
from undying.controller.core import TICK, Controller
from undying.controller.deadlines import LONGEST_HOLD, Deadlines
from undying.controller.machine import JobMachine
from undying.controller.saved_state import export_state, resume
from undying.controller.state import JobState
from undying.controller.status import job_status
from undying.events import Event, EventLog, read_events
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
    WorkerState,
    WorkerStatus,
    hello_order,
)

JOB_ID = "job-test"
STORE_PORT = 29555
# How long (fake seconds) a test waits for the controller to act.
WAIT = 3.0
# Timeouts small enough for unit tests; wait_reschedule_timeout keeps its default (30..270).
FAST = {
    "heartbeat_interval": 0.05,
    "heartbeat_timeout": 0.4,
    "monitor_interval": 0.05,
    "node_return_timeout": 5.0,
    # The test's agents send no health check after a stop unless the test plays one (test_node_check.py).
    "node_check": False,
}
# A test that forgets an agent still ends quickly.
EXIT_GRACE = 1.0
T = TypeVar("T")


class MachineController:
    """The shell's API over a JobMachine, on a fake clock."""

    def __init__(self, spec: JobSpec, events: EventLog, on_node_lost: Callable[[int], None]) -> None:
        self.clock = 1000.0
        self.events = events
        self.on_node_lost = on_node_lost
        self.running = False
        deadlines = dataclasses.replace(Deadlines.from_spec(spec), exit_grace=EXIT_GRACE)
        self.machine = JobMachine(spec, JOB_ID, f"127.0.0.1:{STORE_PORT}", now=self.clock,
                                  wall_offset=time.time() - self.clock, deadlines=deadlines)

    def __getattr__(self, name: str) -> Any:
        # What the machine holds (state, generation, message, ...), read as from the shell.
        machine = self.__dict__["machine"]
        if hasattr(machine.membership, name):
            return getattr(machine.membership, name)
        return getattr(machine, name)

    def _apply(self, call: Callable[[float], T]) -> T:
        result = call(self.clock)
        effects = self.machine.take_effects()
        for event in effects.events:
            self.events.emit(event)
        for node in effects.kill_nodes:
            self.on_node_lost(node)
        return result

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass, the machine ticking every TICK (once the loop runs)."""
        end = self.clock + seconds
        while self.clock < end - 1e-9:
            self.clock = min(end, self.clock + TICK)
            if self.running:
                self._apply(self.machine.tick)

    def run_until(self, done: Callable[[], bool], timeout: float) -> bool:
        end = self.clock + timeout
        while not done():
            if self.clock >= end:
                return False
            self.advance(TICK)
        return True

    # ------------------------------------------------------------ the shell's calls

    def hello(self, hello: AgentHello) -> HelloReply:
        return self._apply(lambda now: self.machine.hello(now, hello))

    def poll(self, poll: AgentPoll) -> Order:
        node = self._apply(lambda now: self.machine.agent_report(now, poll))
        if node is None:
            return hello_order()
        self.run_until(lambda: bool(node.orders) or not node.alive, min(poll.wait, LONGEST_HOLD))
        return self._apply(lambda now: self.machine.take_order(now, node))

    def report(self, poll: AgentPoll) -> None:
        self._apply(lambda now: self.machine.agent_report(now, poll))

    def agent_leaving(self, leave: AgentLeave) -> bool:
        return self._apply(lambda now: self.machine.agent_leaving(now, leave))

    def agent_disconnected(self, node_id: int, pid: int) -> None:
        self._apply(lambda now: self.machine.agent_disconnected(now, node_id, pid))

    def report_agent_exit(self, node_id: int, returncode: int | None) -> None:
        self._apply(lambda now: self.machine.agent_exited(now, node_id, returncode))

    def agent_id_of(self, node: int) -> int:
        return self.machine.membership.adopted_by.get(node, node)

    def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        return self._apply(lambda now: self.machine.heartbeat(now, beat))

    def worker_event(self, data: dict[str, Any]) -> None:
        event = Event.from_dict(data)
        self._apply(lambda now: self.machine.worker_event(now, event))

    def check_in(self, request: RecoverRequest) -> Plan:
        return self._apply(lambda now: self.machine.check_in(now, request))

    def recover(self, request: RecoverRequest) -> Plan:
        return check_in_together(self, [request])[request.rank]

    def claim_injection(self, claim: InjectionClaim) -> bool:
        return self._apply(lambda now: self.machine.claim_injection(now, claim))

    def cancel(self, why: str) -> None:
        self._apply(lambda now: self.machine.cancel(now, why))

    def status(self) -> dict[str, Any]:
        return job_status(self.machine, self.clock)

    def export_state(self) -> dict[str, Any]:
        return export_state(self.machine)

    def resume(self, saved: dict[str, Any], why: str, live: set[tuple[str, int]] | None = None) -> None:
        self._apply(lambda now: resume(self.machine, saved, why, now, live))


def check_in_together(controller: MachineController, requests: list[RecoverRequest]) -> dict[int, Plan]:
    """Every request checks in, and asks again each tick while its plan is WAIT and its wait lasts,
    as concurrent workers long-polling the shell do."""
    plans: dict[int, Plan] = {}
    ends = {request.rank: controller.clock + min(request.wait, LONGEST_HOLD) for request in requests}
    while True:
        for request in requests:
            if request.rank not in plans or plans[request.rank].action == PlanAction.WAIT:
                plan = controller.check_in(request)
                if plan.action != PlanAction.WAIT or controller.clock >= ends[request.rank]:
                    plans[request.rank] = plan
        if len(plans) == len(requests) and all(plan.action != PlanAction.WAIT or controller.clock >= ends[rank]
                                               for rank, plan in plans.items()):
            return plans
        controller.advance(TICK)


class Job:
    """One job machine; the methods play agents and workers."""

    def __init__(self, run_dir: Path, **spec_fields: Any) -> None:
        self.spec = JobSpec(**{**FAST, **spec_fields})
        self.run_dir = run_dir
        self.events_log = EventLog(run_dir)
        self.lost_nodes: list[int] = []
        self.controller = MachineController(self.spec, self.events_log, self.lost_nodes.append)

    def start(self) -> None:
        """The shell's loop starts: from now on the machine ticks as time passes."""
        self.controller.running = True
        self.controller._apply(self.controller.machine.tick)

    def now(self) -> float:
        return self.controller.clock

    def advance(self, seconds: float) -> None:
        self.controller.advance(seconds)

    @property
    def exit_code(self) -> int | None:
        return self.controller.machine.exit_code

    # ------------------------------------------------------------ the agents

    def ranks_of(self, node: int) -> list[int]:
        per_node = self.spec.nproc_per_node
        return list(range(node * per_node, (node + 1) * per_node))

    def hello(self, node: int, nproc: int | None = None) -> HelloReply:
        nproc = self.spec.nproc_per_node if nproc is None else nproc
        return self.controller.hello(AgentHello(node, 1000 + node, f"host{node}", nproc))

    def statuses(self, node: int, generation: int, state: str = WorkerState.RUNNING,
                 exitcode: int | None = None, signal: str | None = None) -> list[dict[str, Any]]:
        """What node's agent reports of its workers, all in one state."""
        return [
            WorkerStatus(rank, local, 2000 + rank, generation, state, exitcode, signal).to_dict()
            for local, rank in enumerate(self.ranks_of(node))
        ]

    def poll(self, node: int, generation: int = 0, workers: list[dict[str, Any]] | None = None,
             wait: float = 0.0) -> Order:
        return self.controller.poll(AgentPoll(node, generation, workers or [], wait))

    def next_order(self, node: int, generation: int = 0, workers: list[dict[str, Any]] | None = None,
                   timeout: float = WAIT) -> Order:
        """Poll like an agent until an order other than 'none' comes, or ``timeout`` passes."""
        deadline = self.now() + timeout
        while True:
            order = self.poll(node, generation, workers, wait=0.1)
            if order.kind != OrderKind.NONE or self.now() > deadline:
                return order
            if order.say_hello:
                self.advance(0.1)  # an agent told to say hello does not hold the poll open

    def start_running(self) -> list[Order]:
        """Every node says hello, the loop starts, and each agent takes its generation-1 start order."""
        for node in range(self.spec.nnodes):
            assert self.hello(node).accepted
        self.start()
        orders = [self.next_order(node) for node in range(self.spec.nnodes)]
        assert [order.kind for order in orders] == [OrderKind.START] * self.spec.nnodes
        for node in range(self.spec.nnodes):
            self.poll(node, 1, self.statuses(node, 1))
        assert self.controller.state is JobState.RUNNING
        return orders

    # ------------------------------------------------------------ the workers

    def beat(self, rank: int, step: int, phase: str = Phase.COMPUTING, generation: int = 1) -> None:
        node = rank // self.spec.nproc_per_node
        self.controller.heartbeat(Heartbeat(rank, node, generation, step, phase, 2000 + rank))

    def keep_beating(self, rank: int, step: int, seconds: float, poll_wait: float = 0.05,
                     until: Callable[[], bool] = lambda: False, agents: Sequence[int] = ()) -> None:
        """A rank alive but stuck: it beats at ``step`` (its node's agent polling meanwhile, and the
        agents of the nodes in ``agents`` beating) for ``seconds`` or until ``until()``."""
        node = rank // self.spec.nproc_per_node
        deadline = self.now() + seconds
        while self.now() < deadline and not until():
            before = self.now()
            for other in agents:
                self.controller.report(AgentPoll(other, 1, []))
            self.beat(rank, step)
            self.poll(node, 1, self.statuses(node, 1), wait=poll_wait)
            if self.now() == before:
                self.advance(poll_wait)

    # ------------------------------------------------------------ observing

    def wait_for(self, predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
        return self.controller.run_until(predicate, timeout)

    def wait_state(self, state: JobState, timeout: float = WAIT) -> None:
        reached = self.wait_for(lambda: self.controller.state is state, timeout)
        assert reached, f"state {self.controller.state.value}, expected {state.value}"

    def events(self, kind: str | None = None) -> list[Event]:
        return [event for event in read_events(self.run_dir) if kind is None or event.kind == kind]

    def join(self, timeout: float = WAIT) -> int | None:
        """The loop runs until the job has ended and every agent took its exit order."""
        machine = self.controller.machine
        ended = self.wait_for(lambda: machine.state.terminal and machine.all_agents_gone(self.now()), timeout)
        assert ended, "Controller.run() did not return"
        return self.exit_code

    def close(self) -> None:
        self.events_log.close()


class ShellJob:
    """The real shell (``Controller``) around its machine, ``run()`` in a thread: for what only the
    shell does (leadership, saving state, answering while not in charge)."""

    def __init__(self, run_dir: Path, **spec_fields: Any) -> None:
        self.spec = JobSpec(**{**FAST, **spec_fields})
        self.events_log = EventLog(run_dir)
        self.controller = Controller(self.spec, self.events_log, JOB_ID, STORE_PORT)
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name="controller-run", daemon=True)

    def _run(self) -> None:
        self.exit_code = self.controller.run()

    def start(self) -> None:
        self._thread.start()

    def hello(self, node: int) -> HelloReply:
        return self.controller.hello(AgentHello(node, 1000 + node, f"host{node}", self.spec.nproc_per_node))

    def wait_for(self, predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def start_two_nodes_and_kill_rank3(self) -> None:
        """Nodes 0 and 1 (2 ranks each) say hello, start and beat at step 7; then node 1's agent
        reports rank 3 killed: with a process-level strategy, generation 1 is aborted for 2."""
        controller = self.controller
        for node in (0, 1):
            assert self.hello(node).accepted
        self.start()
        for node in (0, 1):
            deadline = time.monotonic() + 5
            while controller.poll(AgentPoll(node, 0, [], 0.2, pid=1000 + node, hostname=f"host{node}")).kind \
                    != OrderKind.START and time.monotonic() < deadline:
                pass
        for rank in range(4):
            controller.heartbeat(Heartbeat(rank, rank // 2, 1, 7, Phase.COMPUTING, 2000 + rank))
        killed = WorkerStatus(3, 1, 2003, 1, WorkerState.EXITED, -9, "SIGKILL").to_dict()
        controller.report(AgentPoll(1, 1, [killed], 0.0, pid=1001, hostname="host1"))
        assert self.wait_for(lambda: controller.generation == 2)

    def close(self) -> None:
        if self._thread.is_alive():
            self.controller.cancel("test teardown")
            self.controller.depose()
            self._thread.join(WAIT)
        self.events_log.close()
