"""What went wrong: the fault reasons, the fault record, and its one description.

The controller builds a ``Fault`` when it detects one (in the controller process); the
console, the event log (``fault_detected``'s ``description``) and the report all describe
a fault with ``describe_fault``, so the three always say the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FaultReason(StrEnum):
    """Why the controller decided something is wrong."""

    WORKER_EXIT = "worker_exit"  # a worker process ended with a non-zero code or a signal
    AGENT_LOST = "agent_lost"  # a node's agent is gone (its process ended, or no poll)
    HEARTBEAT_MISSED = "heartbeat_missed"  # no heartbeat for heartbeat_timeout: a hung process
    STEP_STALLED = "step_stalled"  # heartbeats go on but no step commits within step_timeout
    START_TIMEOUT = "start_timeout"  # no first heartbeat within start_timeout
    EXIT_TIMEOUT = "exit_timeout"  # said it finished but its process does not end
    STEP_FAILED = "step_failed"  # a worker could not complete its step (a peer's fault, a collective error)
    NODE_RETURNED = "node_returned"  # not a fault: a dropped node is back (an elastic grow)
    RECOVERY_FAILED = "recovery_failed"  # counted when a recovery gives up (never a Fault's reason)


# Faults that mean the rank's process is gone or no longer usable.
PROCESS_FAULTS = frozenset({FaultReason.WORKER_EXIT, FaultReason.HEARTBEAT_MISSED, FaultReason.START_TIMEOUT,
                            FaultReason.EXIT_TIMEOUT, FaultReason.STEP_STALLED})


def describe_fault(reason: str, rank: int | None = None, node: int | None = None, exitcode: int | None = None,
                   signal: str | None = None, detail: str = "", planned: bool = False) -> str:
    """One line for a person: where the fault is and what it was."""
    where = f"rank {rank}" if rank is not None else f"node {node}"
    if reason == FaultReason.WORKER_EXIT:
        how = f"killed by {signal}" if signal else f"exit code {exitcode}"
        return f"{where} exited ({how})"
    if reason == FaultReason.AGENT_LOST:
        return f"node {node} left the job ({detail or 'planned'})" if planned else f"node {node} lost (agent gone)"
    if reason == FaultReason.HEARTBEAT_MISSED:
        return f"{where} missed its heartbeats (hang?)"
    if reason == FaultReason.STEP_STALLED:
        return f"{where} is alive but committed no step within step_timeout (hang?)"
    if reason == FaultReason.STEP_FAILED:
        return f"{where} could not complete its step ({detail})" if detail else f"{where} could not complete its step"
    return f"{where}: {reason}"


@dataclass(frozen=True)
class Fault:
    """What the controller saw go wrong."""

    reason: FaultReason
    node: int | None = None
    rank: int | None = None
    step: int | None = None
    exitcode: int | None = None
    signal: str | None = None
    detail: str = ""
    planned: bool = False  # announced by the node itself (a planned leave), not discovered

    def describe(self) -> str:
        return describe_fault(self.reason, self.rank, self.node, self.exitcode, self.signal, self.detail,
                              self.planned)
