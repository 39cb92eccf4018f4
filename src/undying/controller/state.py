"""The job's states and the transitions the controller may make between them.

Runs in the controller. Written as an explicit table so every state change is
checked and logged in one place (compare torchelastic's WorkerState).
"""

from __future__ import annotations

import enum

# The process exit code of `undying run` for each way a job ends.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2  # the job cannot run as configured (e.g. its nodes do not share the T2 root)
# Stopped on request with its newest committed step persisted: run it again (requeue) to resume there.
EXIT_STOPPED = 75  # EX_TEMPFAIL
EXIT_CANCELLED = 130


class JobState(enum.Enum):
    WAITING_FOR_NODES = "waiting_for_nodes"  # not every node's agent has said hello yet
    RUNNING = "running"  # the current generation trains
    RECOVERING = "recovering"  # process-level recovery (or a dying checkpoint) forms the next generation
    STOPPING = "stopping"  # a fault was seen; the generation's workers are being stopped
    RESTARTING = "restarting"  # workers stopped; waiting for every node before the next generation
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STOPPED = "stopped"  # stopped on request (SIGTERM, undying stop) after persisting its newest step

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.STOPPED)


ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.WAITING_FOR_NODES: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.RECOVERING, JobState.STOPPING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    # RECOVERING -> SUCCEEDED: a stop's ranks all finished their last step instead of checking in.
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.STOPPING, JobState.FAILED, JobState.CANCELLED,
                                    JobState.STOPPED, JobState.SUCCEEDED}),
    JobState.STOPPING: frozenset({JobState.RESTARTING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RESTARTING: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
    JobState.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(current: JobState, target: JobState) -> None:
    if target not in ALLOWED_TRANSITIONS[current]:
        raise IllegalTransition(f"job state {current.value} -> {target.value} is not allowed")
