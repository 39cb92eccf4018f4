"""The job's event log: one JSON object per line in ``RUN_DIR/events.jsonl``.

Written by the controller only (agents and workers send their events to it over
HTTP), so the file has one writer and one order. Read by ``undying report``,
``undying demo`` and the tests.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"


class EventKind(StrEnum):
    """What an event says happened: its ``kind`` in the log (docs/events.md describes each, its emitter
    and its details). The values are the public format and never change; a reader meets kinds it does
    not know (a newer writer) as plain strings in ``Event.kind``."""

    JOB_START = "job_start"
    JOB_END = "job_end"
    STRATEGY_SELECTED = "strategy_selected"
    AGENT_REGISTERED = "agent_registered"
    AGENT_LOST = "agent_lost"
    # An agent's poll connection closed (its process may have died): lost unless it polls again at once.
    AGENT_DISCONNECTED = "agent_disconnected"
    AGENT_RESPAWNED = "agent_respawned"
    GENERATION_START = "generation_start"
    WORKER_STARTED = "worker_started"
    WORKER_EXIT = "worker_exit"
    WORKER_READY = "worker_ready"
    HEARTBEAT = "heartbeat"  # sampled (each rank at most every 0.5 s): phase and the scalars of ft.log
    FAULT_DETECTED = "fault_detected"
    DECISION = "decision"
    RESTART_BEGIN = "restart_begin"
    RESTART_END = "restart_end"
    CHECKPOINT_SAVE = "checkpoint_save"
    CHECKPOINT_LOAD = "checkpoint_load"
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"
    FIRST_STEP = "first_step"
    INJECTION = "injection"
    AUTH_REFUSED = "auth_refused"
    # A request with the job's token whose body the controller refused (400): path, client, the field and why.
    REQUEST_REFUSED = "request_refused"
    WORKER_DONE = "worker_done"
    STEP_FAILED = "step_failed"  # a worker left a step it could not complete (reason in details)
    RECOVERY_BEGIN = "recovery_begin"  # the controller starts a process-level recovery (strategy, new generation)
    RECOVERY_PLAN = "recovery_plan"  # the plan is published: target step, source replica, receivers
    RECOVERED = "recovered"  # a worker finished its part of a recovery (phase timings in details)
    RECOVERY_FAILED = "recovery_failed"  # a process-level recovery gave up; the chain falls back
    # The executor that owns a recovery hands it to another, which drives it from then on (from, to, why):
    # retry to recover-in-place (a process is gone), a recover to elastic-training (its node did not come back),
    # the dump to job-restart (its checkpoint is committed).
    RECOVERY_HANDOVER = "recovery_handover"
    REPLACE = "replace"  # an agent was told to restart only some ranks
    RNG_NOT_MIRRORED = "rng_not_mirrored"
    DUMP_BEGIN = "dump_begin"
    DUMP_COMMITTED = "dump_committed"
    HANG_SUSPECTED = "hang_suspected"  # watchdog off/detect-only: a hang seen and, by configuration, not acted on
    ELASTIC_SHRINK = "elastic_shrink"  # a lost node did not come back in time: fewer replicas (old/new world size)
    STANDBY_ADOPT = "standby_adopt"  # a spare agent was ordered to take a lost node's place
    ELASTIC_GROW = "elastic_grow"  # a returned node's ranks rejoined: back to more replicas (old/new world size)
    PERSIST_FAILED = "persist_failed"  # a background T2 write gave up (reason); the job trains on
    # A step's T2 checkpoint failed (logged once per step by the controller: controller/persist_health.py):
    # the first rank's reason, failures in a row, the newest durable checkpoint's step and age, warning.
    CHECKPOINT_FAILED = "checkpoint_failed"
    SNAPSHOT_UNAVAILABLE = "snapshot_unavailable"  # node shared memory could not hold a snapshot: private memory used
    SNAPSHOT_PAGEABLE = "snapshot_pageable"  # CUDA would not page-lock a T1 slot: device-to-host copies are slower
    # snapshot_interval: auto changed the interval (interval, previous; the means it was chosen from: stall,
    # step_seconds, and the cost that gives against the budget). Every rank emits it, at the same step.
    SNAPSHOT_INTERVAL = "snapshot_interval"
    CONTROLLER_LEADER = "controller_leader"  # a candidate won the etcd election (address, candidate id, node)
    CONTROLLER_TAKEOVER = "controller_takeover"  # the new leader carries on from the saved state (previous state)
    CONTROLLER_DEPOSED = "controller_deposed"  # a leader lost its etcd lease and stopped deciding
    STORE_MOVED = "store_moved"  # a worker switched to the new controller's store (a plan named it)
    # A restore from a checkpoint written under other numerics (device model, versions, deterministic mode):
    # recorded and current records, the keys that differ, the ranks whose record differs. Training goes on.
    NUMERICS_CHANGED = "numerics_changed"
    # A replacement rank of a sharded job received its shard of the models and optimizers: source "replica"
    # (donor: the rank of another replica that sent it) or "t1" (its node's T1 snapshot of the step).
    SHARD_RECEIVED = "shard_received"
    # A receiving rank of a repair got the training state of the plan's step: source "t1" (its node's T1
    # snapshot, read from node memory; path) or "replica" (sent by the plan's source rank: donor); seconds.
    STATE_RECEIVED = "state_received"
    # A pure-FSDP job whose replacement's T1 lacks the plan's step: every rank went back in place to the
    # newest step every rank holds in T1 (target: the plan's step; step: the one the job continues from).
    T1_ROLLBACK = "t1_rollback"
    # Peer copies of T1 (checkpoint.peer_copy): this rank's snapshot of the step is complete in the memory
    # of its holder's node (holder: that rank; bytes, seconds of the transfer) and every rank's copy of
    # that step is, so the step is the job's anchor; or a copy failed (reason; count since the last report).
    PEER_COPY = "peer_copy"
    PEER_COPY_FAILED = "peer_copy_failed"
    # The job stopped in a crash loop (controller/crash_loop.py): why, the recoveries it made, and the fault
    # that started it (rank, node, step, description, error, exitcode, signal, log_tail: its output's last lines).
    CRASH_LOOP = "crash_loop"
    # A node's agent wrote a probe under its T2 root that the controller cannot read under its own (root_probe.py):
    # host, problem. Before the first generation the job fails; later the node's hello is refused.
    CHECKPOINT_ROOT_UNSHARED = "checkpoint_root_unshared"
    # The job was asked to stop (SIGTERM, undying stop): every rank finishes its step in flight, then all
    # persist the newest committed step (why). The job ends as "stopped" once that checkpoint is committed.
    STOP_BEGIN = "stop_begin"
    # A rank's busy time per step (compute and data loading) is straggler_threshold times its peers' median or
    # more, over its last straggler_window steps (controller/stragglers.py): ratio, its means and the peers'
    # median, the node, and what is done (strategy: report, or switch once a spare is idle).
    STRAGGLER = "straggler"
    # A node's ranks move to an idle spare at a step boundary (strategies/switch.py): why (a straggler, a
    # transient bad step), the spare; its recovery_plan and the newcomers' recovered events follow.
    SWITCH_BEGIN = "switch_begin"
    # A step's commit vote found it bad (runtime/step_check.py), so no rank applied it: attempt, cause, action
    # (replay, skip, stop; "replayed" once a replay committed: the first attempt's fault was transient),
    # ranks (whose own checked values were bad), named_count, the first member's own bad values. Logged by
    # the generation's first member.
    BAD_STEP = "bad_step"
    # In a bad step where several ranks' own checked values (ft.check) were not finite, each of them says so:
    # attempt, values (name -> value).
    BAD_VALUE = "bad_value"
    # A node failed its health check (agent/node_check.py) and holds no ranks: host, problems, the check's timings,
    # when (hello, restart), and the spare id it now waits under.
    NODE_CHECK_FAILED = "node_check_failed"
    # A job restart let the survivors finish the T2 commit of this step before stopping them
    # (strategies/job_restart.py): outcome (committed, failed, timed out, writer gone) and the seconds waited.
    COMMIT_DRAIN = "commit_drain"


# The kinds by their old module-level names (``ev.HEARTBEAT``), as every emitter and reader spells them.
JOB_START = EventKind.JOB_START
JOB_END = EventKind.JOB_END
STRATEGY_SELECTED = EventKind.STRATEGY_SELECTED
AGENT_REGISTERED = EventKind.AGENT_REGISTERED
AGENT_LOST = EventKind.AGENT_LOST
AGENT_DISCONNECTED = EventKind.AGENT_DISCONNECTED
AGENT_RESPAWNED = EventKind.AGENT_RESPAWNED
GENERATION_START = EventKind.GENERATION_START
WORKER_STARTED = EventKind.WORKER_STARTED
WORKER_EXIT = EventKind.WORKER_EXIT
WORKER_READY = EventKind.WORKER_READY
HEARTBEAT = EventKind.HEARTBEAT
FAULT_DETECTED = EventKind.FAULT_DETECTED
DECISION = EventKind.DECISION
RESTART_BEGIN = EventKind.RESTART_BEGIN
RESTART_END = EventKind.RESTART_END
CHECKPOINT_SAVE = EventKind.CHECKPOINT_SAVE
CHECKPOINT_LOAD = EventKind.CHECKPOINT_LOAD
CHECKPOINT_CORRUPT = EventKind.CHECKPOINT_CORRUPT
FIRST_STEP = EventKind.FIRST_STEP
INJECTION = EventKind.INJECTION
AUTH_REFUSED = EventKind.AUTH_REFUSED
REQUEST_REFUSED = EventKind.REQUEST_REFUSED
WORKER_DONE = EventKind.WORKER_DONE
STEP_FAILED = EventKind.STEP_FAILED
RECOVERY_BEGIN = EventKind.RECOVERY_BEGIN
RECOVERY_PLAN = EventKind.RECOVERY_PLAN
RECOVERED = EventKind.RECOVERED
RECOVERY_FAILED = EventKind.RECOVERY_FAILED
RECOVERY_HANDOVER = EventKind.RECOVERY_HANDOVER
REPLACE = EventKind.REPLACE
RNG_NOT_MIRRORED = EventKind.RNG_NOT_MIRRORED
DUMP_BEGIN = EventKind.DUMP_BEGIN
DUMP_COMMITTED = EventKind.DUMP_COMMITTED
HANG_SUSPECTED = EventKind.HANG_SUSPECTED
ELASTIC_SHRINK = EventKind.ELASTIC_SHRINK
STANDBY_ADOPT = EventKind.STANDBY_ADOPT
ELASTIC_GROW = EventKind.ELASTIC_GROW
PERSIST_FAILED = EventKind.PERSIST_FAILED
CHECKPOINT_FAILED = EventKind.CHECKPOINT_FAILED
SNAPSHOT_UNAVAILABLE = EventKind.SNAPSHOT_UNAVAILABLE
SNAPSHOT_PAGEABLE = EventKind.SNAPSHOT_PAGEABLE
SNAPSHOT_INTERVAL = EventKind.SNAPSHOT_INTERVAL
CONTROLLER_LEADER = EventKind.CONTROLLER_LEADER
CONTROLLER_TAKEOVER = EventKind.CONTROLLER_TAKEOVER
CONTROLLER_DEPOSED = EventKind.CONTROLLER_DEPOSED
STORE_MOVED = EventKind.STORE_MOVED
NUMERICS_CHANGED = EventKind.NUMERICS_CHANGED
SHARD_RECEIVED = EventKind.SHARD_RECEIVED
STATE_RECEIVED = EventKind.STATE_RECEIVED
T1_ROLLBACK = EventKind.T1_ROLLBACK
PEER_COPY = EventKind.PEER_COPY
PEER_COPY_FAILED = EventKind.PEER_COPY_FAILED
CRASH_LOOP = EventKind.CRASH_LOOP
CHECKPOINT_ROOT_UNSHARED = EventKind.CHECKPOINT_ROOT_UNSHARED
STOP_BEGIN = EventKind.STOP_BEGIN
STRAGGLER = EventKind.STRAGGLER
SWITCH_BEGIN = EventKind.SWITCH_BEGIN
BAD_STEP = EventKind.BAD_STEP
BAD_VALUE = EventKind.BAD_VALUE
NODE_CHECK_FAILED = EventKind.NODE_CHECK_FAILED
COMMIT_DRAIN = EventKind.COMMIT_DRAIN

@dataclass
class Event:
    """One thing that happened in the job, at one place (node, rank) and one time."""

    kind: str
    time: float = field(default_factory=time.time)
    node: int | None = None
    rank: int | None = None
    step: int | None = None
    generation: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=str)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Event:
        known = {k: data[k] for k in ("kind", "time", "node", "rank", "step", "generation") if k in data}
        return cls(details=dict(data.get("details") or {}), **known)


class EventLog:
    """Appends events to a JSONL file; safe to call from many threads.

    Each line is flushed as written, so a crash of the controller loses at most
    the line being written, and readers may tail the file while the job runs.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the job's life
        self._listeners: list[Any] = []

    def add_listener(self, callback: Any) -> None:
        """Call ``callback(event)`` for every event emitted after this (e.g. a console printer)."""
        self._listeners.append(callback)

    def emit(self, event: Event) -> Event:
        with self._lock:
            self._file.write(event.to_json() + "\n")
            self._file.flush()
        for callback in self._listeners:
            callback(event)
        return event

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()


def heartbeat_scalars(details: dict[str, Any]) -> dict[str, float]:
    """The scalars a ``heartbeat`` event carries beside its ``phase``: what the rank last passed to
    ``ft.log`` (loss, lr, ...), by name."""
    return {name: float(value) for name, value in details.items()
            if name != "phase" and isinstance(value, int | float) and not isinstance(value, bool)}


def read_events(run_dir_or_file: str | os.PathLike[str]) -> list[Event]:
    """Every complete event of a run, in file order (a torn last line is skipped)."""
    return list(iter_events(run_dir_or_file))


def iter_events(run_dir_or_file: str | os.PathLike[str]) -> Iterator[Event]:
    path = Path(run_dir_or_file)
    if path.is_dir():
        path = path / EVENTS_FILE
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                yield Event.from_dict(json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue
