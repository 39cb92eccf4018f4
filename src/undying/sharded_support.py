"""Which recovery strategies a sharded job's mesh can serve, in one table.

Imported by the worker and by the controller. A sharded model (FSDP2 over ``ft.device_mesh``)
keeps one shard of the model and optimizer per rank of a replica: a lost rank's shard comes back
from another replica (``replicate >= 2``), or, with one replica, from its node's T1 snapshot
(recover-in-place, ``snapshot_interval`` not 0) or a peer copy of it on the next node (recover).
The worker refuses at ``ft.device_mesh`` a ``recover_strategy`` the mesh cannot serve, in one line;
the controller's strategies refuse the same ones at a fault (their ``applies()``), from the mesh the
ranks report in their heartbeats.
"""

from __future__ import annotations

from undying.strategy_names import StrategyName

# What a sharded job may list in recover_strategy besides exit and job-restart.
SHARDED_STRATEGIES = (StrategyName.RETRY, StrategyName.RECOVER_IN_PLACE, StrategyName.RECOVER, StrategyName.DUMP,
                      StrategyName.ELASTIC)
# They need another replica of each shard (replicate >= 2): a repair's donor, a dump's writer, the
# whole replicas an elastic shrink trains on.
REPLICA_STRATEGIES = (StrategyName.RECOVER_IN_PLACE, StrategyName.RECOVER, StrategyName.DUMP, StrategyName.ELASTIC)
# Why a mesh of one replica cannot serve one of them (the worker's start-up error quotes the first two).
NEEDS_T1 = "recover-in-place needs T1 snapshots: checkpoint.snapshot_interval >= 1 or auto"
NEEDS_PEER_COPIES = ("recover needs peer copies of T1: checkpoint.peer_copy auto, a job under agents on two or "
                     "more nodes")
NO_OTHER_REPLICA = "no other replica holds a lost rank's shard (a sharded mesh of one replica)"


def single_replica_strategies(t1_snapshots: bool, peer_copies: bool) -> tuple[StrategyName, ...]:
    """Of the replica strategies, those a mesh of one replica still serves: recover-in-place from the
    node's T1 snapshot, and recover from its peer copy on the next node."""
    served: tuple[StrategyName, ...] = (StrategyName.RECOVER_IN_PLACE,) if t1_snapshots else ()
    if t1_snapshots and peer_copies:
        served += (StrategyName.RECOVER,)
    return served


def mesh_refusal(strategy: StrategyName, replicate: int, t1_snapshots: bool, peer_copies: bool) -> str | None:
    """Why a sharded mesh of ``replicate`` replicas cannot serve ``strategy`` (None: it can)."""
    if replicate != 1 or strategy not in REPLICA_STRATEGIES:
        return None
    if strategy in single_replica_strategies(t1_snapshots, peer_copies):
        return None
    if strategy == StrategyName.RECOVER_IN_PLACE:
        return NEEDS_T1
    if strategy == StrategyName.RECOVER and t1_snapshots:
        return NEEDS_PEER_COPIES
    return NO_OTHER_REPLICA


def usable_strategies(replicate: int, t1_snapshots: bool, peer_copies: bool) -> tuple[StrategyName, ...]:
    """The strategies a sharded mesh serves besides job-restart and exit."""
    if replicate > 1:
        return SHARDED_STRATEGIES
    return (StrategyName.RETRY, *single_replica_strategies(t1_snapshots, peer_copies))
