"""What went wrong: the fault reasons, the fault record, and its one description.

The controller builds a ``Fault`` when it detects one (in the controller process); the
console, the event log (``fault_detected``'s ``description``) and the report all describe
a fault with ``describe_fault``, so the three always say the same thing. A worker that
raised is described with its exception's line (``exception_line``: read from the tail of
its log by its agent, or sent by the worker itself when ``retry`` kept its process). A worker
whose recovery undying's own repair refused exits with ``protocol.WORKER_EXIT_REPAIR_REFUSED``; its
fault says so (``Fault.repair_refused``), for the crash-loop guard and for a person.
"""

from __future__ import annotations

import re
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
    STOP_REQUESTED = "stop_requested"  # not a fault: the job was asked to stop (SIGTERM, undying stop)
    SWITCH = "switch"  # not a fault: a slow or suspect node's ranks move to a spare (strategies/switch.py)


# Faults that mean the rank's process is gone or no longer usable.
PROCESS_FAULTS = frozenset({FaultReason.WORKER_EXIT, FaultReason.HEARTBEAT_MISSED, FaultReason.START_TIMEOUT,
                            FaultReason.EXIT_TIMEOUT, FaultReason.STEP_STALLED})


# A Python traceback's first line; the exception's own line is the first unindented line after its frames.
TRACEBACK_HEADER = "Traceback (most recent call last):"
ERROR_LINE_MAX = 300  # characters of an exception's line kept in a fault's description
# torch.distributed's own excepthook prefixes every line of a traceback with the rank.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def exception_line(lines: list[str]) -> str:
    """The line naming the exception that ended a Python process (``RuntimeError: boom``), from the
    last lines of its output; "" when they hold no traceback. With chained exceptions, the last one
    (the one that propagated). A message spanning several lines is cut to its first."""
    lines = [_RANK_PREFIX.sub("", line) for line in lines]
    start = max((index for index, line in enumerate(lines) if line.startswith(TRACEBACK_HEADER)), default=None)
    if start is None:
        return ""
    for line in lines[start + 1:]:
        if line.strip() and not line[:1].isspace() and not line.startswith(TRACEBACK_HEADER):
            line = line.strip()
            return line if len(line) <= ERROR_LINE_MAX else line[:ERROR_LINE_MAX - 3] + "..."
    return ""


def describe_fault(reason: str, rank: int | None = None, node: int | None = None, exitcode: int | None = None,
                   signal: str | None = None, detail: str = "", planned: bool = False, error: str = "",
                   repair_refused: bool = False) -> str:
    """One line for a person: where the fault is and what it was (with the exception, if one was raised)."""
    where = f"rank {rank}" if rank is not None else f"node {node}"
    raised = f": {error}" if error else ""
    if reason == FaultReason.WORKER_EXIT:
        if repair_refused:
            return f"{where} exited (repair refused){raised}"
        how = f"killed by {signal}" if signal else f"exit code {exitcode}"
        return f"{where} exited ({how}){raised}"
    if reason == FaultReason.AGENT_LOST:
        return f"node {node} left the job ({detail or 'planned'})" if planned else f"node {node} lost (agent gone)"
    if reason == FaultReason.HEARTBEAT_MISSED:
        return f"{where} missed its heartbeats (hang?)"
    if reason == FaultReason.STEP_STALLED:
        return f"{where} is alive but committed no step within step_timeout (hang?)"
    if reason == FaultReason.SWITCH:
        return f"node {node} switched to a spare ({detail})" if detail else f"node {node} switched to a spare"
    if reason == FaultReason.STOP_REQUESTED:
        return f"stop requested ({detail})" if detail else "stop requested"
    if reason == FaultReason.STEP_FAILED:
        if error:
            return f"{where} raised in its step{raised}"
        return f"{where} could not complete its step ({detail})" if detail else f"{where} could not complete its step"
    return f"{where}: {reason}{raised}"


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
    error: str = ""  # the exception's line, when the worker raised (``exception_line``)
    log_tail: tuple[str, ...] = ()  # the last lines of the failing rank's output, when known
    # The worker exited because undying's repair refused (``protocol.WORKER_EXIT_REPAIR_REFUSED``): the
    # strategy could not help; not the script failing again, whatever its ``error`` says.
    repair_refused: bool = False

    def describe(self) -> str:
        return describe_fault(self.reason, self.rank, self.node, self.exitcode, self.signal, self.detail,
                              self.planned, self.error, self.repair_refused)
