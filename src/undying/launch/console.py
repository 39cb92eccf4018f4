"""What the user sees on the terminal while a job runs: the job's banner and its notable events.

Runs in the ``undying run`` process, on the node whose controller leads (``launcher.py``
and, for a failover job, ``ha_node.py``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from undying import events as ev
from undying.controller.persist_health import failed_checkpoint_line
from undying.controller.strategies import describe_chain, effective_chain, unbuilt_strategies
from undying.events import Event
from undying.incidents import INCIDENT_KINDS, describe_incident
from undying.launch.launch_options import LaunchOptions

if TYPE_CHECKING:
    from undying.controller import Controller


def print_event(event: Event) -> None:
    """Console view of the events a user cares about while the job runs."""
    where = " ".join(part for part in (
        f"node {event.node}" if event.node is not None else "",
        f"rank {event.rank}" if event.rank is not None else "",
        f"step {event.step}" if event.step is not None else "",
        f"gen {event.generation}" if event.generation is not None else "") if part)
    stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
    details = event.details
    describers: dict[str, Callable[[], str]] = {
        ev.FAULT_DETECTED: lambda: f"FAULT {details.get('description')}",
        ev.DECISION: lambda: f"decision: {details.get('strategy')} ({details.get('reason')})",
        ev.RECOVERY_HANDOVER: lambda: f"recovery handed from {details.get('from')} to {details.get('to')}: {details.get('why')}",
        ev.GENERATION_START: lambda: f"generation started, world size {details.get('world_size')}",
        ev.CHECKPOINT_LOAD: lambda: f"loaded checkpoint of step {event.step} from {details.get('source')}",
        ev.CHECKPOINT_CORRUPT: lambda: f"skipped corrupt checkpoint {details.get('path')}: {details.get('reason')}",
        ev.FIRST_STEP: lambda: f"training again (resumed from step {details.get('resumed_from')})",
        ev.INJECTION: lambda: f"injecting {details.get('spec')}",
        ev.AGENT_LOST: lambda: f"node lost: {details.get('why')}",
        ev.AGENT_RESPAWNED: lambda: "agent respawned (simulated node rescheduled)",
        ev.STANDBY_ADOPT: lambda: f"standby agent {details.get('spare')} takes the place of this node",
        ev.ELASTIC_SHRINK: lambda: (f"elastic shrink: world {details.get('old_world_size')} -> "
                                    f"{details.get('new_world_size')} (node(s) {details.get('dropped_nodes')} "
                                    f"not back after {details.get('waited')} s)"),
        ev.ELASTIC_GROW: lambda: (f"elastic grow: world {details.get('old_world_size')} -> "
                                  f"{details.get('new_world_size')}"),
        ev.CRASH_LOOP: lambda: crash_loop_lines(details),
        ev.CHECKPOINT_FAILED: lambda: failed_checkpoint_line(event.step, details),
        ev.CHECKPOINT_ROOT_UNSHARED: lambda: (f"node {event.node} ({details.get('host')}) does not share the "
                                              f"T2 checkpoint root: {details.get('problem')}"),
        ev.REQUEST_REFUSED: lambda: (f"refused a request to {details.get('path')} from {details.get('client')}: "
                                     f"{details.get('error')}"),
        ev.SNAPSHOT_UNAVAILABLE: lambda: (f"T1 snapshots in this process's private memory (a replacement cannot "
                                          f"read them): node shared memory refused: {details.get('reason')}"),
        ev.JOB_END: lambda: f"job {details.get('outcome')}: {details.get('message')}",
        ev.AUTH_REFUSED: lambda: (f"refused a client without the job token"
                                  f"{' at the store' if details.get('service') == 'store' else ''} "
                                  f"({details.get('client')}{': ' + str(details['why']) if details.get('why') else ''})"),
    }
    text = describers.get(event.kind)
    if event.kind in INCIDENT_KINDS:
        text = lambda: describe_incident(event.kind, event.step, event.rank, event.node, details)  # noqa: E731
    if text is not None and (event.kind != ev.CHECKPOINT_LOAD or event.rank == 0):
        print(f"[undying {stamp}] {where}: {text()}", file=sys.stderr, flush=True)


def crash_loop_lines(details: dict[str, object]) -> str:
    """A crash loop's cause as the console shows it: the fault, then the failing rank's last lines."""
    tail = details.get("log_tail") or []
    lines = [f"CRASH LOOP, stopping the job: {details.get('why')}",
             f"  root cause: {details.get('description')}"]
    if isinstance(tail, list) and tail:
        lines.append(f"  last lines of rank {details.get('rank')}'s output:")
        lines.extend(f"  | {line}" for line in tail)
    return "\n".join(lines)


def emit_job_start(controller: Controller, options: LaunchOptions, address: str, store_port: int,
                   job_id: str) -> None:
    """Log the job's start (its shape and the strategies that will recover it); print its banner."""
    spec = options.spec
    chain = [strategy.name for strategy in effective_chain(spec)]
    controller.emit(ev.JOB_START, details={
        "nnodes": spec.nnodes, "nproc_per_node": spec.nproc_per_node, "world_size": spec.world_size,
        "strategies": list(spec.recover_strategy), "effective_strategy": chain,
        "unbuilt_strategies": unbuilt_strategies(spec), "max_restarts": spec.max_restarts,
        "controller": address, "store_port": store_port, "command": options.command,
        "job_id": job_id, "pid": os.getpid(), "failover": options.etcd is not None, "tls": options.tls is not None})
    if not options.quiet:
        print(f"[undying] job {job_id}: {spec.nnodes} node(s) x {spec.nproc_per_node} worker(s), "
              f"controller {'https://' if options.tls is not None else ''}{address}, run dir {options.run_dir}",
              file=sys.stderr)
        print(f"[undying] {describe_chain(spec)}; max_restarts {spec.max_restarts}", file=sys.stderr, flush=True)
