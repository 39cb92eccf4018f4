"""Every rank's restore when the job (re)starts: which step each rank holds, rank 0's plan, the load.

Runs in the worker, on the training thread, once per start (``ft.steps`` calls
``CheckpointEngine.restore``, runtime/snapshots.py). Every rank reports the steps it holds in node
memory (T1, and peer copies of a lost node's ranks); rank 0 chooses between them and the newest
verified T2 checkpoint (runtime/restore_plan.py) and publishes the plan; every rank then loads that
step: from its node's T1 or a peer copy, or the T2 replica state broadcast by rank 0 plus its own
rank file.
"""

from __future__ import annotations

import functools
import json
import time
from typing import TYPE_CHECKING, Any

from undying import events as ev
from undying.checkpoint import CommittedCheckpoint, Location, load_object
from undying.checkpoint.manifest import NUMERICS_KEY, rank_state_file
from undying.runtime.devices import numerics_differences
from undying.runtime.restore_plan import SOURCE_MEMORY, SOURCE_STORAGE, choose_restore
from undying.runtime.state_transfer import broadcast_state

if TYPE_CHECKING:
    from undying.runtime.snapshots import CheckpointEngine


def restore_at_start(engine: CheckpointEngine) -> bool:
    """Load the newest state every rank can reach (``CheckpointEngine``'s guarantees) into ``engine``'s
    training state and report it; False when there was none (a fresh start)."""
    membership, training = engine.membership, engine.state
    started = time.time()
    group = membership.current_group()
    # A snapshot records the replicas it was taken with: after a restart at a shrunk size only
    # those taken at that size count (the full-size ones predate the shrink).
    held = engine.node_t1().held(membership.replicas)
    holders = engine.peer.holders()  # peer copies: a rank whose node was lost restores from its holder's
    copies = engine.peer.steps_held(membership.replicas) if holders is not None else []
    report = {"held": held, "copies": copies, "numerics": engine.numerics}
    gathered = group.gather_objects("restore/t1", json.dumps(report).encode(), engine.restore_timeout)
    loaded: dict[str, Any] | None = None
    reports: list[dict[str, Any]] = []  # rank 0: every rank's, in group order
    if gathered is not None:
        reports = [json.loads(blob) for blob in gathered]
        own = [set(each["held"]) for each in reports]
        reach = [steps | set(reports[holders[index]]["copies"]) if holders and index in holders else steps
                 for index, steps in enumerate(own)]
        plan, loaded = choose_restore(engine.root, membership.generation, reach, training.sharded,
                                      functools.partial(_report_corrupt, engine))
        if plan["source"] == SOURCE_MEMORY and holders:
            plan["from_copies"] = {index: holders[index] for index, steps in enumerate(own)
                                   if plan["step"] not in steps}
        group.publish("restore_plan", json.dumps(plan).encode())
    plan = json.loads(group.read("restore_plan", engine.restore_timeout))
    source, step = plan["source"], plan["step"]
    if source == SOURCE_MEMORY:
        from_copies = {int(index): holder for index, holder in plan.get("from_copies", {}).items()}
        details: dict[str, Any] = {"path": None if engine.directory is None else str(engine.directory),
                                   "dump": False}
        index = membership.members.index(membership.rank)
        engine.peer.send_copies(step, from_copies)
        if index in from_copies:  # this rank's node was lost: its holder's copy
            engine.peer.receive_copy(from_copies[index], training)
            details["peer_copy"] = membership.members[from_copies[index]]
        else:
            # Into the live tensors where they exist (the model's parameters; optimizer state once
            # it has stepped): a restore allocates only what the process does not hold yet.
            engine.load_t1(step)
        engine.snapshots.invalidate(keep_step=step)
    elif source == SOURCE_STORAGE:
        training.load_replica_state(broadcast_state(group, loaded, 0, membership.device,
                                                    live=training.replica_state()))
        checkpoint = next(c for c in engine.root.list_committed() if c.step == step)
        if reports:
            _report_numerics(engine, checkpoint, [each["numerics"] for each in reports])
        rank_state: dict[str, Any] = {}
        if _written_by(checkpoint) == membership.members:
            rank_state = load_object(checkpoint, rank_state_file(membership.rank))
            training.load_rank_state(rank_state)
        if training.sharded and "shards" not in rank_state:
            engine.dcp_layout().load(checkpoint)  # this rank's part of every shard, whatever mesh wrote it
        engine.snapshots.invalidate()
        details = {"path": str(checkpoint.path), "dump": bool(checkpoint.manifest.meta.get("dump"))}
    else:
        engine.snapshots.invalidate()
        engine.peer.continued(training.committed_step)
        return False
    engine.peer.continued(training.committed_step)
    engine.reporter.update(step=training.committed_step)
    engine.reporter.emit(ev.CHECKPOINT_LOAD, step=training.committed_step, source=source,
                       seconds=round(time.time() - started, 4), **details)
    return True

def _report_corrupt(engine: CheckpointEngine, path: Location, reason: str) -> None:
    engine.reporter.emit(ev.CHECKPOINT_CORRUPT, path=str(path), reason=reason)

def _report_numerics(engine: CheckpointEngine, checkpoint: CommittedCheckpoint, records: list[dict[str, Any]]) -> None:
    """Rank 0, restoring from storage: one ``numerics_changed`` when any rank's numerics differ
    from those the checkpoint was written under; its ``current`` is the first such rank's record.
    A checkpoint that recorded none (an older undying) is not compared."""
    recorded = checkpoint.manifest.meta.get(NUMERICS_KEY)
    if not isinstance(recorded, dict):
        return
    changed = {rank: record for rank, record in zip(engine.membership.members, records, strict=False)
               if numerics_differences(recorded, record)}
    if not changed:
        return
    differs = sorted({key for record in changed.values() for key in numerics_differences(recorded, record)})
    engine.reporter.emit(ev.NUMERICS_CHANGED, step=checkpoint.step, path=str(checkpoint.path), differs=differs,
                       ranks=list(changed), recorded=recorded, current=next(iter(changed.values())))


def _written_by(checkpoint: CommittedCheckpoint) -> list[int]:
    """The ranks whose files a checkpoint holds (older manifests name none: every rank of its size)."""
    members = checkpoint.manifest.meta.get("members")
    return [int(rank) for rank in members] if members else list(range(checkpoint.manifest.world_size))
