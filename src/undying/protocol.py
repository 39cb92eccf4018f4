"""Typed, versioned messages between the controller, the agents and the workers.

Every message crosses a process boundary as JSON over HTTP (see ``client.py`` and
``controller/server.py``); this module is the one place their shapes are defined.
The routes live here too; the environment an agent gives its workers is ``worker_env.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import StrEnum
from typing import Any, ClassVar, Literal, TypeVar

from undying.field_types import decode_fields
from undying.strategy_names import StrategyName

# 2: a plan's and an order's rank lists travel as runs (``encode_runs``), not rank by rank.
# 3: a heartbeat carries ``max_steps`` (the console's step of total) and ``scalars`` (ft.log) instead of ``loss``.
# 4: a heartbeat carries the rank's step times (compute, wait in collectives, data loading) and the
#    T2 step it commits; an agent's hello and a poll after a stop carry its node's health check.
PROTOCOL_VERSION = 4

# HTTP routes served by the controller. Every route needs the job token.
ROUTE_AGENT_HELLO = "/v1/agent/hello"
ROUTE_AGENT_POLL = "/v1/agent/poll"
ROUTE_AGENT_REPORT = "/v1/agent/report"  # worker statuses only, sent the moment a worker exits
ROUTE_AGENT_LEAVE = "/v1/agent/leave"  # the node is leaving (its undying run got SIGTERM: preempted, drained)
ROUTE_WORKER_RECOVER = "/v1/worker/recover"  # a worker whose step failed checks in, waits for a plan
ROUTE_WORKER_HEARTBEAT = "/v1/worker/heartbeat"
ROUTE_EVENT = "/v1/event"
ROUTE_INJECT_CLAIM = "/v1/inject/claim"
ROUTE_JOB_STOP = "/v1/job/stop"
ROUTE_STATUS = "/status"
ROUTE_METRICS = "/metrics"
ROUTE_EVENTS = "/events"

TOKEN_HEADER = "Authorization"
TOKEN_SCHEME = "Bearer"
VERSION_HEADER = "X-Undying-Protocol"


class Phase(StrEnum):
    """Where a worker is in its step, as its heartbeat reports it (docs/design.md, "A step is a transaction")."""

    STARTING = "starting"
    COMPUTING = "computing"
    SYNCING = "syncing"  # in the gradient all-reduce: waiting on peers, not stuck itself
    UPDATING = "updating"
    UPDATED = "updated"
    DONE = "done"
    RECOVERING = "recovering"


class OrderKind(StrEnum):
    """What the controller tells an agent to do next."""

    NONE = "none"
    START = "start"
    STOP = "stop"
    EXIT = "exit"
    REPLACE = "replace"  # restart only the listed ranks, as newcomers of the given generation
    ADOPT = "adopt"  # a spare (standby) agent takes over the lost node ``Order.node``


class PlanAction(StrEnum):
    """What a recovery plan asks the workers to do."""

    WAIT = "wait"  # not ready yet: ask again
    RESUME = "resume"  # build the generation's group, repair, re-run the step in flight
    DUMP = "dump"  # the source writes the committed state to storage, then the job restarts
    PERSIST = "persist"  # the job stops: every rank writes its part of the target step's T2 checkpoint
    EXIT = "exit"  # this process has no part in what comes next


class WorkerState(StrEnum):
    """A worker process as its agent sees it."""

    RUNNING = "running"
    STOPPED = "stopped"  # alive but stopped by a signal (SIGSTOP): a hang, seen by its agent
    EXITED = "exited"


M = TypeVar("M", bound="Message")


def encode_runs(ranks: list[int]) -> list[list[int]]:
    """``ranks`` as runs of consecutive ranks, ``[start, stop)`` each, in their order: every rank of
    a 16k-rank job is ``[[0, 16384]]`` instead of 16,384 numbers (~100 KB of JSON). Exact for any
    list of ints (order and repeats kept); ``decode_runs`` gives it back."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([rank, rank + 1])
    return runs


def decode_runs(runs: Any, name: str) -> list[int]:
    """The rank list ``encode_runs`` gave ``runs`` for; ``name`` names the field in the error."""
    if not isinstance(runs, list) or not all(
            isinstance(run, list) and len(run) == 2 and all(type(bound) is int for bound in run)
            and run[0] < run[1] for run in runs):
        raise ValueError(f"{name}: expected a list of [start, stop) pairs of ints with start < stop, got {runs!r}")
    return [rank for start, stop in runs for rank in range(start, stop)]


class Message:
    """Base of every message: plain dataclass <-> dict, unknown keys ignored (forward compatible).
    Fields named in ``RUN_FIELDS`` (lists of ranks) travel as ``<field>_runs`` (``encode_runs``).
    A field typed with an enum (``Phase``, ``OrderKind``, ...) travels as its value, a string, and
    is that enum's member once decoded; a value outside the enum is refused where it arrives."""

    RUN_FIELDS: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        # Field by field, not asdict: its per-value machinery is paid by every heartbeat, and its deep
        # copy of a 16k-rank list costs ~10 ms (bench/scale.py; such lists travel as runs).
        data = {name: _plain(getattr(self, name)) for name in _field_names(type(self)) if name not in self.RUN_FIELDS}
        data.update({f"{name}_runs": encode_runs(getattr(self, name)) for name in self.RUN_FIELDS})
        return data

    @classmethod
    def from_dict(cls: type[M], data: dict[str, Any]) -> M:
        """The message ``data`` holds; ValueError naming the field whose value is not of its type
        or, for an enum field, not one of its values (field_types.py), TypeError when a required
        field is missing."""
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        values = {k: v for k, v in data.items() if k in names}
        for name in cls.RUN_FIELDS:
            if f"{name}_runs" in data:
                values[name] = decode_runs(data[f"{name}_runs"], f"{cls.__name__}.{name}_runs")
        return cls(**decode_fields(cls, values))


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def _plain(value: Any) -> Any:
    """``value`` copied as ``asdict`` copies a field: containers anew, all the way down (a nested
    dataclass as its dict); a leaf (a number, a string, an enum member) as it is."""
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return value


@dataclass
class AgentHello(Message):
    node: int
    pid: int
    hostname: str
    nproc: int
    standby: bool = False  # a spare node: no ranks until it adopts a lost node's place
    # The T2 root check (root_probe.py): the probe file the agent wrote under its checkpoint root (empty:
    # the job writes no T2, or the agent could not write one: a problem of its health check below).
    root_probe: str = ""
    # The agent's validated job spec (config.spec_to_dict), so the controller can refuse a node
    # launched with another spec; empty from a sender that does not say.
    spec: dict[str, Any] = field(default_factory=dict)
    # The node's health check (node_check.NodeCheck.to_dict): its problems (none: fit) and timings.
    # Empty: not checked (node_check: false).
    check: dict[str, Any] = field(default_factory=dict)


@dataclass
class HelloReply(Message):
    job_id: str
    store_port: int
    accepted: bool = True
    reason: str = ""
    # -1: serve the node asked for. Else the agent joins as this spare node id: its node's place is
    # held by the spare that adopted it while it was away (a partition healed, a frozen node woke up).
    node: int = -1


# The exit status of a worker whose recovery undying's own repair refused (runtime/process_exit.py,
# ``repair_refusal_exits``): no replica, T1 snapshot or peer copy holds a lost shard, so the strategy
# tried cannot help; the script did not fail. It travels as ``WorkerStatus.exitcode``, and the controller
# decodes it into ``Fault.repair_refused``. Python gives a script no such status by itself (1: an
# uncaught exception, 2: a usage error, 120: a failed flush; a signal is a negative return code).
WORKER_EXIT_REPAIR_REFUSED = 86


@dataclass
class WorkerStatus(Message):
    rank: int
    local_rank: int
    pid: int
    generation: int
    state: WorkerState
    exitcode: int | None = None
    signal: str | None = None
    # An exit with a non-zero code or a signal: the exception line of its log's last traceback ("" if
    # none) and its log's last lines (log_tail.py), for the fault's description and a crash loop's cause.
    error: str = ""
    log_tail: list[str] = field(default_factory=list)


@dataclass
class AgentPoll(Message):
    node: int
    generation: int  # the generation the agent's workers belong to (0: none started)
    workers: list[dict[str, Any]] = field(default_factory=list)  # WorkerStatus dicts
    wait: float = 1.0  # seconds the controller may hold the request open
    pid: int = 0  # the agent's process: an agent the node's place no longer belongs to is told to say hello
    hostname: str = ""  # ... and its host (a pid names a process on one host only)
    # The node's health check, run again once a job restart stopped its workers (as AgentHello.check);
    # empty in every other poll.
    check: dict[str, Any] = field(default_factory=dict)


@dataclass
class AgentLeave(Message):
    """A node's agent says it is leaving the job before it stops its workers (a planned leave)."""

    node: int
    pid: int
    hostname: str
    reason: str = ""


@dataclass
class Order(Message):
    RUN_FIELDS: ClassVar[tuple[str, ...]] = ("members",)

    kind: OrderKind = OrderKind.NONE
    generation: int = 0
    ranks: list[int] = field(default_factory=list)
    world_size: int = 0
    store_port: int = 0
    restart_count: int = 0
    reason: str = ""
    node: int = -1  # OrderKind.ADOPT: the node whose place the spare takes
    # OrderKind.START: the generation's ranks in process-group order; empty means every rank of
    # world_size. Fewer after an elastic shrink (a job restart at the shrunk size).
    members: list[int] = field(default_factory=list)
    # OrderKind.EXIT: the job's exit code (0 succeeded, 1 failed, 2 refused, 75 stopped, 130
    # cancelled), which every node's undying run exits with; -1: not the job's end (or not said).
    exit_code: int = -1
    # The agent does not hold its node's place (the controller does not know it, declared the node
    # lost, or gave the place to another): it stops its workers and says hello again.
    say_hello: bool = False


def hello_order() -> Order:
    """The order that tells an agent to stop its workers and say hello again (``Order.say_hello``)."""
    return Order(kind=OrderKind.NONE, reason="hello", say_hello=True)


@dataclass
class HeartbeatReply(Message):
    ok: bool = True
    abort_generation: int = 0  # the controller gave up on this generation: leave its collectives
    # The controller ends this generation at a step boundary (an elastic grow): finish the step in
    # flight, then check in. Only once a rank has checked in are the others' collectives aborted.
    end_generation: int = 0
    mirror_store: str = ""  # failover jobs: a second store (another node's) that also keeps the RNG mirror


@dataclass
class RecoverRequest(Message):
    """A worker's check-in after its step failed (or, for a newcomer, on joining)."""

    rank: int
    node: int
    generation: int  # the generation the worker is in (survivor: the failed one; newcomer: its new one)
    committed_step: int
    pid: int
    reason: str = ""
    newcomer: bool = False
    wait: float = 5.0
    # The step failed on an exception of this rank's own (kept from ending the process by ``with step:``
    # under retry): its exception line and its traceback's last lines. Empty: a peer's fault.
    error: str = ""
    error_tail: list[str] = field(default_factory=list)


@dataclass
class Plan(Message):
    """What every rank does to leave a fault behind (docs/design.md, "Process-level recovery")."""

    RUN_FIELDS: ClassVar[tuple[str, ...]] = ("members", "receivers", "holders")

    action: PlanAction = PlanAction.WAIT
    strategy: StrategyName | Literal[""] = ""  # "": none (a wait, or an exit from the job)
    generation: int = 0
    world_size: int = 0
    target_step: int = 0  # the committed step everyone resumes from
    source_rank: int = 0  # a healthy replica holding target_step
    receivers: list[int] = field(default_factory=list)  # ranks that get the state from the source
    reason: str = ""
    # The ranks of the new generation, in process-group order; empty means every rank of world_size.
    # Fewer than world_size after an elastic shrink: a rank's place in the group is its index here.
    members: list[int] = field(default_factory=list)
    # host:port of the store the new generation meets in; it changes when the controller fails over.
    store: str = ""
    # Other stores that may hold the RNG mirror of target_step (the backup store of a failed-over controller).
    rng_stores: list[str] = field(default_factory=list)
    # The ranks that hold target_step's state (checked in at it): a sharded job's dump is written by them.
    holders: list[int] = field(default_factory=list)


@dataclass
class Heartbeat(Message):
    rank: int
    node: int
    generation: int
    step: int  # committed steps so far
    phase: Phase
    pid: int
    # The newest value of each scalar the worker logged (``ft.log(loss=..., lr=...)``): name -> value.
    scalars: dict[str, float] = field(default_factory=dict)
    mesh_shard: int = 0  # a sharded job's ranks per replica (ft.device_mesh's shard); 0: not sharded
    max_steps: int = 0  # ft.steps(n)'s n, the steps the job runs to; 0: not known yet
    # The rank's step times (runtime/step_timing.py): medians over its newest ``timed_steps`` committed steps
    # in this process (straggler_window at most), in seconds: its own compute, its wait inside
    # collectives (for its peers), and its data loading. 0 steps: none timed yet.
    timed_steps: int = 0
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    data_seconds: float = 0.0
    # The step whose T2 checkpoint this rank's persister writes as the committing rank (0: none): a job
    # restart lets it commit before the workers are stopped (strategies/job_restart.py).
    committing: int = 0
    # A sharded job of one replica: its T1 snapshots are copied to the next node (runtime/peer_copy.py),
    # so a lost node's shards come back from there (sharded_support.py).
    mesh_peer_copies: bool = False


@dataclass
class InjectionClaim(Message):
    index: int
    rank: int
    node: int
    generation: int
    step: int


@dataclass
class Granted(Message):
    granted: bool


@dataclass
class StopRequest(Message):
    """``undying stop`` (or SIGTERM's equivalent over HTTP): stop the job, gracefully unless ``now``."""

    reason: str = ""
    now: bool = False
