"""Checkpoint engine: saving and restoring training state across the state tiers.

Runs in the worker processes. ``storage`` is tier T2: per-rank files on a filesystem,
committed atomically by a checksummed manifest and verified before they are loaded.
"""

from undying.checkpoint.storage import (
    CHECKSUM_ALGO,
    MANIFEST_NAME,
    CommittedCheckpoint,
    CorruptCheckpoint,
    FileRecord,
    Manifest,
    checkpoint_dirname,
    commit,
    latest_verified,
    list_committed,
    load_object,
    prune,
    remove_stale_partials,
    save_object,
    staging_dir,
    verify,
)

__all__ = [
    "CHECKSUM_ALGO",
    "MANIFEST_NAME",
    "CommittedCheckpoint",
    "CorruptCheckpoint",
    "FileRecord",
    "Manifest",
    "checkpoint_dirname",
    "commit",
    "latest_verified",
    "list_committed",
    "load_object",
    "prune",
    "remove_stale_partials",
    "save_object",
    "staging_dir",
    "verify",
]
