"""What a pod's exit code tells the cluster engine: the one table (docs/kubernetes.md) that every
engine's rendered failure policy follows.

Runs in the ``undying k8s render`` process. The codes are `undying run`'s own: the job's outcome
on every pod at the job's end (controller/state.py; the controller's exit order carries it to every
agent), and ``EXIT_NODE_LEFT`` on a node whose agent ended while the job goes on (agent/node_agent.py).
"""

from __future__ import annotations

import enum

from undying.agent.node_agent import EXIT_NODE_LEFT
from undying.controller.state import EXIT_CANCELLED, EXIT_FAILED, EXIT_OK, EXIT_REFUSED, EXIT_STOPPED


class PodExit(enum.StrEnum):
    """What the engine is to do about a pod that ended."""

    DONE = "done"  # its part ended with the job: not recreated
    FAIL_JOB = "fail the job"  # retrying cannot help
    RESTART_JOB = "restart the job"  # every pod anew; the job resumes from its newest checkpoint
    RECREATE_POD = "recreate the pod"  # that pod alone; it rejoins as its node or as a spare


# Retrying cannot help: a failed job (a crash loop, max_restarts used up, a chain that ended in
# exit, nodes missing at the start) fails again, a refused one (a bad spec, flag or label, a T2
# root the nodes do not share, a wrong token) is refused again.
NOT_RETRIED = (EXIT_FAILED, EXIT_REFUSED)
# Node 0 stopped the job (its SIGTERM: a drain or preemption; `undying stop`): 75 with the newest
# committed step persisted, 130 without (then the newest durable checkpoint is the last periodic
# one). Run again, the job resumes there: the engine restarts it, without counting a failure.
STOPPED = (EXIT_STOPPED, EXIT_CANCELLED)
# A node or spare that left a job that goes on (a drain's or preemption's SIGTERM, or its controller
# gone): recreated, it rejoins.
LEFT = EXIT_NODE_LEFT


def pod_exit(code: int, pod_level: bool) -> PodExit:
    """The table: what the engine is to do about a pod whose `undying run` exited with ``code``
    (128 + N when a signal N killed it). ``pod_level``: ``pod_rescheduling: on``, where a pod that
    left or died is recreated alone; otherwise the whole job restarts (MindCluster's job level)."""
    if code == EXIT_OK:
        return PodExit.DONE
    if code in NOT_RETRIED:
        return PodExit.FAIL_JOB
    if code in STOPPED:
        return PodExit.RESTART_JOB
    return PodExit.RECREATE_POD if pod_level else PodExit.RESTART_JOB

