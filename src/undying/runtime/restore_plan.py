"""What a (re)starting job restores: rank 0's choice between the newest step every rank holds in
T1 and the newest verified T2 checkpoint, with the shared shard it read for the latter.

Runs in the worker (rank 0 of a restore); the restore at a start (runtime/start_restore.py) gathers
every rank's T1 steps, calls ``choose_restore`` and publishes the plan it returns to every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from undying.checkpoint import (
    CheckpointRoot,
    CommittedCheckpoint,
    CorruptCheckpoint,
    Location,
    load_object,
)
from undying.checkpoint.dcp_format import UNDYING_KEY, is_dcp_shard, read_shared_shard

LEGACY_SHARED_FILE = "train_state.pt"  # the shared shard before the DCP format (still loadable)
SOURCE_MEMORY = "memory"
SOURCE_STORAGE = "storage"
SOURCE_NONE = "none"


def choose_restore(root: CheckpointRoot, generation: int, held: list[set[int]], sharded: bool,
                   on_corrupt: Callable[[Location, str], None]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The plan every rank follows (``source``, ``step``) and, for storage, the shared shard already
    read. ``held``: each rank's T1 steps. T1 wins when its step is not older than the newest verified
    T2 checkpoint (then T2 need not even be read); a T2 checkpoint that fails verification or does not
    parse is reported (``on_corrupt``) and the next older one is tried."""
    root.make()
    root.remove_stale_partials(generation)
    memory_step = max(set.intersection(*held), default=-1) if held else -1
    listed = root.list_committed()
    if memory_step >= 0 and (not listed or memory_step >= listed[0].step):
        return {"source": SOURCE_MEMORY, "step": memory_step}, None
    older_than: int | None = None
    while True:
        checkpoint = root.latest_verified(on_corrupt=on_corrupt, older_than=older_than)
        if checkpoint is None or memory_step >= checkpoint.step:
            if memory_step >= 0:
                return {"source": SOURCE_MEMORY, "step": memory_step}, None
            return {"source": SOURCE_NONE, "step": -1}, None
        try:
            return {"source": SOURCE_STORAGE, "step": checkpoint.step}, read_shard(checkpoint, sharded)
        except CorruptCheckpoint as error:
            on_corrupt(checkpoint.path, str(error))
            older_than = checkpoint.step


def read_shard(checkpoint: CommittedCheckpoint, sharded: bool) -> dict[str, Any]:
    """The shared shard of a verified checkpoint, with its step as ``committed_step``."""
    if is_dcp_shard(checkpoint):
        # latest_verified just checked every file. A sharded job's ranks read their shards themselves.
        state = read_shared_shard(checkpoint, verified=True, keys={UNDYING_KEY} if sharded else None)
    else:
        state = load_object(checkpoint, LEGACY_SHARED_FILE)
    state["committed_step"] = checkpoint.step
    return state
