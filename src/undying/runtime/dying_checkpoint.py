"""The dying checkpoint (``dump``): the committed state written by the ranks that still hold it.

Runs in the worker; the recovery client (runtime/recovery_client.py) calls ``write`` when a plan's
action is ``dump``. Data parallel: the plan's source writes the replica (the shared shard) and every
rank's file, each rank's RNG taken from the mirror. Sharded (``ft.device_mesh``): a rank holds only
its own shard, so every holder of the target step writes its shards into one DCP checkpoint, as a
periodic sharded checkpoint is written (checkpoint/dcp_sharded.py: each replicated chunk once; plain
``dcp.load`` reads it), and its own rank file (RNG, user state); a rank without the state gets its
rank file from the first holder of its shard in another replica (the lost rank's mirrored RNG):
its shard is in the DCP checkpoint already, written by that holder or another. The source writes
the ``undying`` entry (data position, user state), collects every writer's file records through the
job's store and commits, as a periodic checkpoint's rank 0 does (checkpoint/persister.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from undying import events as ev
from undying.checkpoint import FileRecord
from undying.checkpoint.dcp_format import UNDYING_KEY, to_dcp, write_shared_shard
from undying.checkpoint.dcp_sharded import Exchange, save_sharded
from undying.checkpoint.manifest import NUMERICS_KEY, rank_state_file
from undying.config import JobSpec
from undying.protocol import Plan
from undying.runtime.event_sink import EventSink
from undying.runtime.membership import Membership
from undying.runtime.mesh import SwappableMesh
from undying.runtime.rng_mirror import RngMirror
from undying.runtime.sharded import ShardLost
from undying.runtime.training_state import TrainingState

if TYPE_CHECKING:
    from undying.runtime.snapshots import CheckpointEngine

# How long the source waits for the other writers' file records: each writes one rank file or two.
RECORDS_TIMEOUT_S = 120.0
OWN, MIRRORED = "own", "mirrored"  # a rank file with the writer's own RNG and user state, or a lost rank's


def dump_files(plan: Plan, rank: int, members: list[int], mesh: SwappableMesh | None) -> dict[int, str]:
    """The rank files ``rank`` writes for ``plan``: file rank -> whose RNG (OWN or MIRRORED).

    Data parallel: the source writes them all, from the mirror. Sharded: see the module docstring;
    raises ShardLost if no holder is left for a rank's shard (the dump cannot be complete)."""
    if mesh is None:
        return {member: MIRRORED for member in members} if rank == plan.source_rank else {}
    holders = set(plan.holders)
    files: dict[int, str] = {}
    for member in members:
        if member in holders:
            if member == rank:
                files[member] = OWN
            continue
        donors = [peer for peer in mesh.replica_peers(member) if peer in holders]
        if not donors:
            raise ShardLost(f"dump: no rank holding step {plan.target_step} has shard {member % mesh.shard} "
                            f"(rank {member}'s)")
        if donors[0] == rank:
            files[member] = MIRRORED
    return files


class DyingCheckpoint:
    """Writes this rank's part of a dump (see the module docstring)."""

    def __init__(self, spec: JobSpec, membership: Membership, state: TrainingState, reporter: EventSink,
                 rng_mirror: RngMirror, checkpoints: CheckpointEngine) -> None:
        self.spec = spec
        self.membership = membership
        self.state = state
        self.reporter = reporter
        self.rng_mirror = rng_mirror
        self.checkpoints = checkpoints

    def write(self, plan: Plan) -> None:
        membership, rank = self.membership, self.membership.rank
        members = plan.members or list(range(membership.world_size))
        sharded = membership.mesh is not None
        if sharded:
            self.state.forget_failed_step()  # a step that failed mid-way may leave parameters unsharded
        files = dump_files(plan, rank, members, membership.mesh)
        writes_shards = sharded and rank in plan.holders
        if not files and rank != plan.source_rank and not writes_shards:
            return
        started = time.time()
        step = plan.target_step
        root = self.checkpoints.root
        staging = root.staging_dir(step, plan.generation)
        records: list[FileRecord] = []
        replica = {**self.state.replica_state(), "committed_step": step}
        # The holders (the source first, so it coordinates) exchange DCP plans and file records.
        exchange = Exchange(self.membership.store, f"{self.membership.store_prefix}/dump/g{plan.generation}",
                            rank, sorted(set(plan.holders)), RECORDS_TIMEOUT_S, lambda: True)
        if writes_shards:
            extras = to_dcp(replica, [])[UNDYING_KEY] if rank == plan.source_rank else None
            state_dict = self.checkpoints.dcp_layout().state_dict(self.state.shard_state(), extras)
            records += save_sharded(staging, state_dict, exchange, root)
        elif rank == plan.source_rank:
            records += write_shared_shard(staging, replica, self.checkpoints.param_names(), root)
        for file_rank, whose in files.items():
            records.append(root.save_object(staging, rank_state_file(file_rank), self._rank_file_state(plan, file_rank, whose)))
        if sharded:
            gathered = exchange.gather("records", records)
            if gathered is None:
                return
            records = [record for writer in gathered for record in writer]
        if rank != plan.source_rank:
            return
        committed = root.commit(staging, step=step, generation=plan.generation, world_size=len(members),
                                files=records, meta={"dump": True, "node": membership.node, "members": members,
                                                     NUMERICS_KEY: self.checkpoints.numerics},
                                keep=self.spec.checkpoint.keep)
        self.reporter.emit(ev.DUMP_COMMITTED, step=step, path=str(committed.path),
                           seconds=round(time.time() - started, 4), bytes=sum(r.size for r in records),
                           writers=sorted(set(plan.holders)) if sharded else [rank])

    def _rank_file_state(self, plan: Plan, file_rank: int, whose: str) -> dict[str, Any]:
        """A rank file: this rank's own (RNG, user state), or a lost rank's RNG from the mirror. A
        sharded job's shards are in the DCP checkpoint, not here."""
        if whose == OWN:
            return {key: value for key, value in self.state.rank_state().items() if key != "shards"}
        return {"rng": self.rng_mirror.read(plan.target_step, file_rank, plan.rng_stores), "statefuls": {}}
