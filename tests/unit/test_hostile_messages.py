"""Hostile and stale messages with a valid token: every controller route fuzzed, nothing changes.

A real ``Controller`` behind a real ``ControllerServer`` is driven (the test plays the agents and
workers, and ticks the machine itself: no loop runs, so only the requests could change anything)
into a job running its second generation after a recovery: rank 3 was killed, recovered in place.
Then a seeded random stream of requests, each with the job's token: values of the wrong type,
ranks, nodes, steps, generations and waits out of range, unknown phases and states, missing
fields, well-formed messages that are stale (the first generation, a replaced process, an agent
that no longer holds its node) or that the job already had (a retried hello, poll or heartbeat),
claims of injections the job does not have; some sent twice, all out of order. Every one is answered (400 for
a bad value, the protocol's own answer for a stale one), no exception escapes a handler, and the
job machine's state (``export_state`` and each rank's and node's record) is what it was.
"""

from __future__ import annotations

import copy
import http.client
import json
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.unit.job_harness import FAST, JOB_ID, STORE_PORT
from undying import events as ev
from undying.config import JobSpec
from undying.controller.core import Controller
from undying.controller.saved_state import export_state
from undying.controller.server import ControllerServer
from undying.controller.state import JobState
from undying.events import EventLog, read_events
from undying.protocol import (
    ROUTE_AGENT_HELLO,
    ROUTE_AGENT_LEAVE,
    ROUTE_AGENT_POLL,
    ROUTE_AGENT_REPORT,
    ROUTE_EVENT,
    ROUTE_EVENTS,
    ROUTE_INJECT_CLAIM,
    ROUTE_JOB_STOP,
    ROUTE_METRICS,
    ROUTE_STATUS,
    ROUTE_WORKER_HEARTBEAT,
    ROUTE_WORKER_RECOVER,
    TOKEN_HEADER,
    AgentHello,
    AgentPoll,
    Heartbeat,
    OrderKind,
    Phase,
    PlanAction,
    RecoverRequest,
    WorkerState,
    WorkerStatus,
)

TOKEN = "fuzz-token-0123456789abcdef0123"
SEED = 30
REQUESTS = 1000
SPEC = {**FAST, "process_recover": True, "recover_strategy": ["recover-in-place"], "nnodes": 2,
        "nproc_per_node": 2, "inject": []}
WORLD, NNODES, NPROC = 4, 2, 2
# A value of every JSON type but the right one is tried for each field (an int field gets the rest).
WRONG_TYPES: list[Any] = [None, True, "7", 7.5, [], [1], {}, {"a": 1}, float("nan"), -1, 2**63]


def agent_pid(node: int) -> int:
    return 1000 + node


def worker_pid(rank: int, generation: int) -> int:
    return 2000 + rank + 100 * (generation - 1)


class RunningJob:
    """The controller after a recovery: generation 2 running, rank 3 a replacement (new pid)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.events = EventLog(run_dir)
        self.controller = Controller(JobSpec(**{k: v for k, v in SPEC.items() if k != "inject"}), self.events,
                                     JOB_ID, STORE_PORT)
        controller = self.controller
        for node in range(NNODES):
            assert controller.hello(AgentHello(node, agent_pid(node), f"host{node}", NPROC)).accepted
        self.tick()
        for node in range(NNODES):
            assert self.poll(node, 0, []).kind == OrderKind.START
            self.poll(node, 1, self.statuses(node, 1))
        for rank in range(WORLD):
            controller.heartbeat(Heartbeat(rank, rank // NPROC, 1, 7, Phase.COMPUTING, worker_pid(rank, 1)))
        killed = WorkerStatus(3, 1, worker_pid(3, 1), 1, WorkerState.EXITED, -9, "SIGKILL").to_dict()
        controller.report(AgentPoll(1, 1, [killed], 0.0, pid=agent_pid(1), hostname="host1"))
        self.tick()
        assert controller.generation == 2
        assert self.poll(1, 1, self.statuses(1, 1)).kind == OrderKind.REPLACE
        for rank in range(3):
            controller.recover(RecoverRequest(rank, rank // NPROC, 1, 7, worker_pid(rank, 1), wait=0.0))
        controller.recover(RecoverRequest(3, 1, 2, 0, worker_pid(3, 2), newcomer=True, wait=0.0))
        self.tick()
        plans = [controller.recover(RecoverRequest(rank, rank // NPROC, 1, 7, worker_pid(rank, 1), wait=0.0))
                 for rank in range(3)]
        assert {plan.action for plan in plans} == {PlanAction.RESUME}, plans
        self.tick()
        for node in range(NNODES):
            self.poll(node, 2, self.statuses(node, 2))
        for rank in range(WORLD):
            controller.heartbeat(Heartbeat(rank, rank // NPROC, 2, 8, Phase.COMPUTING,
                                           worker_pid(rank, 2 if rank == 3 else 1)))
        assert controller.state is JobState.RUNNING and controller.generation == 2

    def tick(self) -> None:
        with self.controller._cond:  # as the shell's loop does, once: the test decides when time acts
            self.controller._apply(self.controller.machine.tick)

    def poll(self, node: int, generation: int, workers: list[dict[str, Any]]) -> Any:
        return self.controller.poll(AgentPoll(node, generation, workers, 0.0, pid=agent_pid(node),
                                              hostname=f"host{node}"))

    @staticmethod
    def statuses(node: int, generation: int) -> list[dict[str, Any]]:
        return [WorkerStatus(rank, rank - node * NPROC, worker_pid(rank, generation if rank == 3 else 1),
                             generation, WorkerState.RUNNING).to_dict() for rank in range(node * NPROC,
                                                                                         (node + 1) * NPROC)]

    def fingerprint(self) -> dict[str, Any]:
        """What the job machine holds, times left out (a stale process's request may prove it alive)."""
        machine = self.controller.machine
        membership = machine.membership
        return {
            "saved": export_state(machine),
            "ranks": {rank: (r.node, r.spawn_generation, r.step, r.phase, r.pid, r.done, r.exitcode, r.signal)
                      for rank, r in membership.ranks.items()},
            "nodes": {node: (n.pid, n.hostname, n.alive, n.standby, n.exit_delivered, n.adopting, list(n.orders),
                             {rank: status.to_dict() for rank, status in n.workers.items()})
                      for node, n in membership.nodes.items()},
            "pending_faults": list(machine.detector.pending),
            "step_failures": list(machine.detector.step_failures),
            "recovery": machine.recovery,
            "stop_requested": machine.stop_requested,
            "end_generation": machine.end_generation,
            "persist_health": vars(machine.persist_health).copy(),
        }

    def close(self) -> None:
        self.events.close()


# ------------------------------------------------------------------ the messages

# Each template is a valid message of the current generation; a case mutates it into a bad or a
# stale one. ``expect``: "400" (a value the job does not allow) or "answered" (any answer below 500:
# a stale message gets the protocol's own answer, which tells its sender to go).
Case = tuple[str, dict[str, Any], str]


def templates() -> dict[str, dict[str, Any]]:
    return {
        ROUTE_AGENT_HELLO: AgentHello(0, agent_pid(0), "host0", NPROC).to_dict(),
        ROUTE_AGENT_POLL: AgentPoll(0, 2, RunningJob.statuses(0, 2), 0.0, agent_pid(0), "host0").to_dict(),
        ROUTE_AGENT_REPORT: AgentPoll(1, 2, RunningJob.statuses(1, 2), 0.0, agent_pid(1), "host1").to_dict(),
        ROUTE_AGENT_LEAVE: {"node": 1, "pid": agent_pid(1), "hostname": "host1", "reason": "fuzz"},
        ROUTE_WORKER_HEARTBEAT: Heartbeat(2, 1, 2, 8, Phase.COMPUTING, worker_pid(2, 1)).to_dict(),
        ROUTE_WORKER_RECOVER: RecoverRequest(2, 1, 2, 8, worker_pid(2, 1), wait=0.0).to_dict(),
        # A kind the machine only logs: a mutation that leaves it valid must change nothing either.
        ROUTE_EVENT: {"kind": "fuzz_note", "node": 0, "rank": 0, "step": 5, "generation": 2,
                      "details": {"path": "/nowhere"}},
        ROUTE_INJECT_CLAIM: {"index": 0, "rank": 0, "node": 0, "generation": 2, "step": 8},
        ROUTE_JOB_STOP: {"reason": "fuzz", "now": False},
    }


# Fields whose values are bounded, with values outside the bound.
OUT_OF_RANGE: dict[str, list[Any]] = {
    "rank": [-1, WORLD, 2**31, -2**63],
    "local_rank": [-1, NPROC, 99],
    "node": [-1, -2**40],
    "generation": [-1, -7],
    "step": [-1, -2**40],
    "committed_step": [-1],
    "pid": [-1],
    "wait": [-0.5, float("inf"), float("nan")],
    "nproc": [0, -3],
    "index": [-1],
    "phase": ["bogus", "", "COMPUTING"],
    "state": ["zombie", ""],
    "mesh_shard": [-1],
    "max_steps": [-1],
    "kind": ["", "Bad Kind", "x" * 100],
    "time": [float("inf"), float("nan")],
}
# Routes whose "node" must be one of the job's nodes (workers run on nodes 0..nnodes-1).
WORKER_ROUTES = (ROUTE_WORKER_HEARTBEAT, ROUTE_WORKER_RECOVER, ROUTE_INJECT_CLAIM)
REQUIRED = {  # fields without a default: a message lacking one is refused
    ROUTE_AGENT_HELLO: ["node", "pid", "hostname", "nproc"],
    ROUTE_AGENT_POLL: ["node", "generation"],
    ROUTE_AGENT_REPORT: ["node", "generation"],
    ROUTE_AGENT_LEAVE: ["node", "pid", "hostname"],
    ROUTE_WORKER_HEARTBEAT: ["rank", "node", "generation", "step", "phase", "pid"],
    ROUTE_WORKER_RECOVER: ["rank", "node", "generation", "committed_step", "pid"],
    ROUTE_INJECT_CLAIM: ["index", "rank", "node", "generation", "step"],
    ROUTE_EVENT: ["kind"],
}


def bad_type(rng: random.Random, route: str, body: dict[str, Any]) -> Case:
    name = rng.choice(sorted(body))
    value = body[name]
    wrong = [v for v in WRONG_TYPES if not _same_type(v, value)]
    if route == ROUTE_EVENT and name in ("node", "rank", "step", "generation"):
        wrong = [v for v in wrong if v is not None]  # optional: null is a value they may take
    if name in ("details", "spec"):
        wrong = [v for v in wrong if not isinstance(v, dict)]
    if name == "workers":
        wrong += [[{"rank": "x"}], [[1, 2]], [{"rank": 0}]]
    if name == "scalars":
        wrong += [{"loss": "high"}, {"loss": [1]}]
    body[name] = rng.choice(wrong)
    return route, body, "400"


def _same_type(candidate: Any, value: Any) -> bool:
    if isinstance(value, bool) or isinstance(candidate, bool):
        return type(candidate) is type(value)
    if isinstance(value, float):
        return isinstance(candidate, int | float)
    if isinstance(value, int) and isinstance(candidate, int):
        return True
    if value is None:
        return False  # an optional field: every other type is wrong only where its type says so
    return type(candidate) is type(value)


def out_of_range(rng: random.Random, route: str, body: dict[str, Any]) -> Case | None:
    names = [name for name in body if name in OUT_OF_RANGE]
    if route == ROUTE_AGENT_HELLO:
        names = [name for name in names if name != "node"] + ["nproc"]  # a hello's node: admission's refusal
    if route in (ROUTE_AGENT_POLL, ROUTE_AGENT_REPORT) and body.get("workers"):
        status = rng.choice(body["workers"])
        field = rng.choice(["rank", "local_rank", "pid", "generation", "state"])
        status[field] = rng.choice(OUT_OF_RANGE[field])
        return route, body, "400"
    if not names:
        return None
    name = rng.choice(names)
    choices = list(OUT_OF_RANGE[name])
    if name == "node" and route in WORKER_ROUTES:
        choices += [NNODES, NNODES + 5]
    if name == "node" and route == ROUTE_EVENT or name == "wait" and route == ROUTE_AGENT_HELLO:
        choices = [c for c in choices if c < 0]
    body[name] = rng.choice(choices)
    return route, body, "400"


def missing(rng: random.Random, route: str, body: dict[str, Any]) -> Case | None:
    if route not in REQUIRED:
        return None
    del body[rng.choice(REQUIRED[route])]
    return route, body, "400"


def stale(rng: random.Random, route: str, body: dict[str, Any]) -> Case | None:
    """Well-formed, in range, and stale: an old generation, a replaced process, another agent."""
    if route == ROUTE_WORKER_HEARTBEAT:
        body.update(rank=3, node=1, generation=1, pid=worker_pid(3, 1), step=rng.choice([0, 6, 7, 99]),
                    phase=rng.choice([p.value for p in Phase]))  # the killed rank 3's process
    elif route == ROUTE_WORKER_RECOVER:
        body.update(rank=3, node=1, generation=1, pid=worker_pid(3, 1), committed_step=rng.choice([0, 7, 50]),
                    newcomer=rng.random() < 0.5, reason="stale", wait=0.0)
    elif route == ROUTE_INJECT_CLAIM:
        body.update(rank=3, node=1, generation=1)  # an injection claimed by the replaced process
    elif route in (ROUTE_AGENT_POLL, ROUTE_AGENT_REPORT, ROUTE_AGENT_LEAVE):
        body.update(pid=agent_pid(7), hostname="elsewhere")  # an agent whose node is served by another
        if route != ROUTE_AGENT_LEAVE:
            body["generation"] = rng.choice([0, 1, 2])
            body["workers"] = [WorkerStatus(rank, rank % NPROC, worker_pid(rank, 1), 1, WorkerState.EXITED,
                                            -9, "SIGKILL").to_dict() for rank in range(body["node"] * NPROC,
                                                                                       (body["node"] + 1) * NPROC)]
    elif route == ROUTE_AGENT_HELLO:
        body.update(node=rng.choice([NNODES, 5, 0]), standby=rng.random() < 0.3, nproc=rng.choice([NPROC + 1, 7]))
        return route, body, "answered"  # refused by admission: its reply says why
    else:
        return None
    return route, body, "answered"


def replay(rng: random.Random, route: str, body: dict[str, Any]) -> Case | None:
    """A message the job already had, again (a retry whose first answer was lost, a duplicate), or an
    injection the job does not have."""
    if route == ROUTE_INJECT_CLAIM:
        body["index"] = rng.choice([1, 5, 2**40])
        return route, body, "answered"
    if route in (ROUTE_AGENT_HELLO, ROUTE_AGENT_POLL, ROUTE_AGENT_REPORT, ROUTE_WORKER_HEARTBEAT, ROUTE_EVENT):
        return route, body, "answered"  # each template repeats the newest real message of its sender
    return None


MUTATIONS: list[Callable[[random.Random, str, dict[str, Any]], Case | None]] = [bad_type, out_of_range, missing,
                                                                               stale, replay]


def cases(seed: int, count: int) -> list[Case]:
    rng = random.Random(seed)
    made: list[Case] = []
    while len(made) < count:
        route, template = rng.choice(sorted(templates().items()))
        case = rng.choice(MUTATIONS)(rng, route, copy.deepcopy(template))
        if case is None:
            continue
        made.append(case)
        if rng.random() < 0.2:
            made.append(case)  # a duplicate
    made += [(ROUTE_EVENTS + "?since=" + text, {}, "400") for text in ("-1", "x", "1e9", "")]
    rng.shuffle(made)  # reordered
    return made


# ------------------------------------------------------------------ the test


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    job = RunningJob(tmp_path)
    server = ControllerServer(job.controller, TOKEN, "127.0.0.1", 0)
    escaped: list[BaseException] = []
    # An exception that escapes a handler reaches the server's handle_error: every one is recorded.
    original = server.httpd.handle_error
    monkeypatch.setattr(server.httpd, "handle_error", lambda request, address: (
        escaped.append(__import__("sys").exc_info()[1]), original(request, address)))
    thread = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield job, server, escaped
    server.stop()
    job.close()


def send(connection: http.client.HTTPConnection, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    method = "GET" if route.startswith(ROUTE_EVENTS) else "POST"
    payload = None if method == "GET" else json.dumps(body, allow_nan=True).encode()
    connection.request(method, route, body=payload, headers={TOKEN_HEADER: f"Bearer {TOKEN}",
                                                             "Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def test_every_route_answers_bad_and_stale_messages_and_changes_nothing(served) -> None:
    job, server, escaped = served
    before = job.fingerprint()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10.0)
    answered: dict[str, int] = {}
    try:
        for index, (route, body, expect) in enumerate(cases(SEED, REQUESTS)):
            try:
                status, reply = send(connection, route, body)
            except (ConnectionError, http.client.HTTPException) as error:
                raise AssertionError(f"request {index} {route} {body}: no answer ({error}); escaped: {escaped}") from None
            where = f"request {index}: {route} {json.dumps(body, allow_nan=True)[:300]} -> {status} {reply}"
            assert status < 500, where
            if expect == "400":
                assert status == 400 and "error" in reply, where
            answered[f"{route.split('?')[0]} {status}"] = answered.get(f"{route.split('?')[0]} {status}", 0) + 1
            assert job.fingerprint() == before, where
    finally:
        connection.close()
    assert not escaped, escaped
    # Each refused body is logged with its route, client and reason (a client's bug is worth seeing).
    refused = [e for e in read_events(job.run_dir) if e.kind == ev.REQUEST_REFUSED]
    posted_400 = sum(count for key, count in answered.items() if key.endswith(" 400") and ROUTE_EVENTS not in key)
    assert len(refused) == posted_400 and all(e.details["client"] == "127.0.0.1" for e in refused)
    # Every route was tried, bad values refused, stale messages answered.
    assert {key.split()[0] for key in answered} >= set(templates()) | {ROUTE_EVENTS}, answered
    assert sum(count for key, count in answered.items() if key.endswith(" 400")) > REQUESTS // 2, answered
    # The job goes on: its ranks' next real heartbeats are taken as before.
    reply = job.controller.heartbeat(Heartbeat(0, 0, 2, 9, Phase.COMPUTING, worker_pid(0, 1)))
    assert reply.abort_generation < 2 and job.controller.machine.membership.ranks[0].step == 9


def test_reads_are_refused_for_bad_values_and_change_nothing(served) -> None:
    job, server, escaped = served
    before = job.fingerprint()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10.0)
    for path in (ROUTE_STATUS, ROUTE_METRICS, ROUTE_EVENTS + "?since=3", "/v1/nothing", "/status/../etc"):
        connection.request("GET", path, headers={TOKEN_HEADER: f"Bearer {TOKEN}"})
        response = connection.getresponse()
        response.read()
        assert response.status in (200, 404), (path, response.status)
    connection.close()
    assert job.fingerprint() == before and not escaped
