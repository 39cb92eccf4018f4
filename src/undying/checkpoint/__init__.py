"""Checkpoint engine: saving and restoring training state across the state tiers.

Runs in the worker processes. ``snapshot`` is tier T1: each rank's state in node shared
memory, written at a step boundary (``snapshot_slot``: one slot's file; ``state_tree``: the
state split into skeleton and tensors). ``storage`` is tier T2: files on a filesystem or behind
an fsspec URL, committed atomically by a checksummed manifest (``manifest``) and verified before
they are loaded; a ``CheckpointRoot`` (``root``) is one root bound once to its ``StorageBackend``
(``backend``; ``local_backend``, ``url_backend``);
``dcp_format`` lays the shared shard out as a torch.distributed.checkpoint directory;
``persister`` moves T1 snapshots to T2 on a background thread.
"""

from undying.checkpoint.storage import (
    CHECKSUM_ALGO,
    MANIFEST_NAME,
    CheckpointRoot,
    CommittedCheckpoint,
    CorruptCheckpoint,
    FileRecord,
    Location,
    Manifest,
    checkpoint_dirname,
    commit,
    is_url,
    latest_verified,
    list_committed,
    load_object,
    make_root,
    prune,
    record_file,
    remove_stale_partials,
    root_location,
    save_object,
    staging_dir,
    verify,
    verify_files,
)

__all__ = [
    "CHECKSUM_ALGO",
    "MANIFEST_NAME",
    "CheckpointRoot",
    "CommittedCheckpoint",
    "CorruptCheckpoint",
    "FileRecord",
    "Location",
    "Manifest",
    "checkpoint_dirname",
    "commit",
    "is_url",
    "latest_verified",
    "list_committed",
    "load_object",
    "make_root",
    "prune",
    "record_file",
    "remove_stale_partials",
    "root_location",
    "save_object",
    "staging_dir",
    "verify",
    "verify_files",
]
