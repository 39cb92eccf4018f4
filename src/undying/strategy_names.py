"""The names of the recovery strategies and MindCluster's order of preference among them.

Read by every process: the job spec validates ``recover_strategy`` against them, the
controller's chain walks them in order, and a worker asks whether its job may retry a
failed step in place. No behaviour lives here, only the vocabulary.
"""

from __future__ import annotations

from enum import StrEnum


class StrategyName(StrEnum):
    """A way to leave a fault behind; the spec's ``recover_strategy`` lists some of them."""

    RETRY = "retry"  # re-run the failed step in the same processes
    RECOVER_IN_PLACE = "recover-in-place"  # restart only the failed process, on its own node
    RECOVER = "recover"  # replace a lost node (pod rescheduling)
    ELASTIC = "elastic-training"  # train on without a lost node, grow back when it returns
    DUMP = "dump"  # the dying checkpoint, then a job restart
    JOB_RESTART = "job-restart"  # every worker restarts from the newest verified checkpoint
    EXIT = "exit"  # stop the job with a non-zero exit
    STOP = "stop"  # not a recovery: the job was asked to stop; every rank persists its newest committed step
    SWITCH = "switch"  # not a recovery: a slow or suspect node's ranks move to an idle spare at a step boundary


# The process-level strategies and the dump, in MindCluster's order of preference.
CHAIN_ORDER = (StrategyName.RETRY, StrategyName.RECOVER_IN_PLACE, StrategyName.RECOVER,
               StrategyName.ELASTIC, StrategyName.DUMP)
# Strategies that keep the healthy processes and rebuild the process group around them.
PROCESS_LEVEL = (StrategyName.RETRY, StrategyName.RECOVER_IN_PLACE, StrategyName.RECOVER,
                 StrategyName.ELASTIC)
# What a user may write in recover_strategy (job-restart is the fallback under all of them, never listed).
SPEC_STRATEGIES = (*CHAIN_ORDER, StrategyName.EXIT)
