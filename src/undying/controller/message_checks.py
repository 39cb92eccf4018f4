"""The values a request may carry, checked before the job machine sees it.

Runs in the controller, on the HTTP handler's thread (``server.py``), after the body was decoded
with its types checked (``protocol.Message.from_dict``, which also refuses an unknown phase or worker
state: a value outside its enum). A rank outside the job, a negative step, generation, pid or wait, a
worker node outside ``nnodes``, a non-finite scalar: each is refused with one line naming the field
and the values allowed (HTTP 400), and nothing of the request is applied. What is in range but
stale (an old generation, a replaced process) is the job machine's to answer: stragglers are told
to leave, never obeyed.
"""

from __future__ import annotations

import math
import re
from typing import Any

from undying.config import JobSpec
from undying.events import Event
from undying.field_types import check_fields
from undying.protocol import (
    AgentHello,
    AgentLeave,
    AgentPoll,
    Heartbeat,
    InjectionClaim,
    Message,
    RecoverRequest,
    WorkerStatus,
)

EVENT_KIND = re.compile(r"[a-z][a-z0-9_]{0,63}")


class BadRequest(ValueError):
    """A request value outside what the job allows (its field and the allowed values in the text)."""


def _at_least(owner: str, name: str, value: int | float, low: int = 0) -> None:
    if not value >= low or not math.isfinite(value):  # NaN compares false: refused too
        raise BadRequest(f"{owner}.{name}: allowed {low} or more, got {value!r}")


def _below(owner: str, name: str, value: int, high: int, what: str) -> None:
    if not 0 <= value < high:
        raise BadRequest(f"{owner}.{name}: allowed 0..{high - 1} ({what}), got {value!r}")


def check_request(spec: JobSpec, message: Message) -> None:
    """Raise BadRequest for the first value of ``message`` outside the job ``spec`` describes."""
    owner = type(message).__name__
    world, nnodes = spec.world_size, spec.nnodes
    if isinstance(message, AgentHello | AgentLeave):
        _at_least(owner, "node", message.node)
        _at_least(owner, "pid", message.pid)
    if isinstance(message, AgentHello):
        _at_least(owner, "nproc", message.nproc, 1)
    if isinstance(message, AgentPoll):
        _at_least(owner, "node", message.node)
        _at_least(owner, "generation", message.generation)
        _at_least(owner, "wait", message.wait)
        _at_least(owner, "pid", message.pid)
        for raw in message.workers:
            _check_worker(spec, WorkerStatus.from_dict(raw))
    if isinstance(message, Heartbeat | RecoverRequest | InjectionClaim):
        _below(owner, "rank", message.rank, world, f"the job's {world} ranks")
        _below(owner, "node", message.node, nnodes, f"the job's {nnodes} nodes")
        _at_least(owner, "generation", message.generation)
    if isinstance(message, Heartbeat):
        _at_least(owner, "step", message.step)
        _at_least(owner, "pid", message.pid)
        _at_least(owner, "mesh_shard", message.mesh_shard)
        _at_least(owner, "max_steps", message.max_steps)
    if isinstance(message, RecoverRequest):
        _at_least(owner, "committed_step", message.committed_step)
        _at_least(owner, "pid", message.pid)
        _at_least(owner, "wait", message.wait)
    if isinstance(message, InjectionClaim):
        _at_least(owner, "index", message.index)
        _at_least(owner, "step", message.step)


def _check_worker(spec: JobSpec, status: WorkerStatus) -> None:
    owner = "WorkerStatus"
    _below(owner, "rank", status.rank, spec.world_size, f"the job's {spec.world_size} ranks")
    _below(owner, "local_rank", status.local_rank, spec.nproc_per_node, "the node's workers")
    _at_least(owner, "pid", status.pid)
    _at_least(owner, "generation", status.generation)


def worker_event(spec: JobSpec, data: dict[str, Any]) -> Event:
    """A worker's event (``/v1/event``), its fields typed and within the job; BadRequest otherwise."""
    check_fields(Event, {name: data[name] for name in ("kind", "time", "node", "rank", "step", "generation")
                         if name in data})
    if not isinstance(data.get("details", {}), dict):
        raise BadRequest(f"Event.details: allowed an object, got {data['details']!r:.40}")
    if "kind" not in data:
        raise BadRequest("Event.kind: required")
    event = Event.from_dict(data)
    if not EVENT_KIND.fullmatch(event.kind):
        raise BadRequest(f"Event.kind: allowed a lower-case name of letters, digits and '_', got {event.kind!r:.40}")
    if not math.isfinite(event.time):
        raise BadRequest(f"Event.time: allowed a finite number, got {event.time!r}")
    if event.rank is not None:
        _below("Event", "rank", event.rank, spec.world_size, f"the job's {spec.world_size} ranks")
    for name in ("node", "step", "generation"):
        value = getattr(event, name)
        if value is not None:
            _at_least("Event", name, value)
    return event
