"""T2 checkpoint storage: per-rank files committed by one checksummed manifest.

Runs in the worker processes: every rank writes its own files into the checkpoint's
directory, rank 0 commits them, and at restart every rank finds and loads the newest
checkpoint that verifies. ``root`` is a local (or shared-filesystem) path, or any fsspec
URL (``s3://``, ``gs://``, ``file://``, ``memory://``, ...). This module is T2's API. The
commit protocol (write, commit, prune, list) is a ``CheckpointRoot`` (root.py), built once per
root and bound then to the ``StorageBackend`` (backend.py) that holds the filesystem calls and
the directory layout of that kind of root: ``LocalBackend`` (local_backend.py, staging
directories and one rename) or ``UrlBackend`` (url_backend.py, written in place, the manifest is
the commit), chosen by ``backend_for`` (backends.py). Verifying and loading a committed
checkpoint is committed.py; the checkpoint carries its root's backend. The functions here that
take a location build the root once per call and delegate to it, for callers that hold no root
(scripts, tests). The manifest format is manifest.py.

Guarantees:

* A directory is a checkpoint only once it holds a manifest that parses and whose checksum
  matches, written after every file it lists and only after each of them was found with its
  recorded size. Local: the manifest is fsynced inside a staging directory that one
  ``rename`` turns into ``step_<step>``, so a crash at any point leaves either the old state
  or the new one. URL: the manifest is one object write, the last; a writer killed earlier
  leaves files without a manifest, which are never listed and are removed by
  ``remove_stale_partials``. Each generation writes its own directory, so a late writer of
  an old generation never touches a newer generation's files. Deletions remove the manifest
  first (local: the directory is renamed away first), so a half-deleted checkpoint is no
  longer one.
* Nothing is handed to ``torch.load`` before its size and CRC-32 match the manifest, and
  the manifest carries a checksum of its own, so a flipped byte anywhere is detected. A file's
  CRC-32 is taken over its bytes on their way to the storage (``save_object``; DCP's files
  through checkpoint/dcp_writer.py, ``record_written``, which checks the stored size), or read
  back from a file another writer produced (``record_file``).

Not guaranteed: CRC-32 detects accidental corruption (bit rot, truncation, torn writes),
not deliberate tampering; on a shared filesystem, durability is only as good as the
filesystem's ``fsync``; behind a URL it is the store's (a ``file://`` URL is not fsynced),
and a store whose listings lag its writes may not show the newest checkpoint yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from undying.checkpoint.backend import (
    Location,
    PathLike,
    StorageBackend,
    is_url,
    root_location,
)
from undying.checkpoint.backends import backend_for
from undying.checkpoint.committed import (
    CommittedCheckpoint,
    load_object,
    verify,
    verify_files,
)
from undying.checkpoint.manifest import (
    CHECKSUM_ALGO,
    FORMAT_VERSION,
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    REPLACED_SUFFIX,
    CorruptCheckpoint,
    FileRecord,
    Manifest,
    checkpoint_dirname,
)
from undying.checkpoint.root import CheckpointRoot

__all__ = [
    "CHECKSUM_ALGO",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "PARTIAL_SUFFIX",
    "REPLACED_SUFFIX",
    "CheckpointRoot",
    "CommittedCheckpoint",
    "CorruptCheckpoint",
    "FileRecord",
    "Location",
    "Manifest",
    "PathLike",
    "StorageBackend",
    "backend_for",
    "checkpoint_dirname",
    "commit",
    "is_url",
    "latest_verified",
    "list_committed",
    "load_object",
    "make_root",
    "prune",
    "record_file",
    "record_written",
    "remove_stale_partials",
    "root_location",
    "save_object",
    "staging_dir",
    "verify",
    "verify_files",
]

# A staging directory is served by its root's backend, which its own location picks as well as
# the root's would: the functions that take one build a root there to reach that backend.


def make_root(root: PathLike) -> None:
    """``CheckpointRoot.make`` of the root at ``root``."""
    CheckpointRoot.at(root).make()


def staging_dir(root: PathLike, step: int, generation: int) -> Location:
    """``CheckpointRoot.staging_dir`` of the root at ``root``."""
    return CheckpointRoot.at(root).staging_dir(step, generation)


def save_object(staging: Location, name: str, obj: Any) -> FileRecord:
    """``CheckpointRoot.save_object`` into the staging directory ``staging``."""
    return CheckpointRoot.at(staging).save_object(staging, name, obj)


def record_file(staging: Location, name: str) -> FileRecord:
    """``CheckpointRoot.record_file`` of a file in the staging directory ``staging``."""
    return CheckpointRoot.at(staging).record_file(staging, name)


def record_written(staging: Location, name: str, size: int, checksum: str) -> FileRecord:
    """``CheckpointRoot.record_written`` of a file in the staging directory ``staging``."""
    return CheckpointRoot.at(staging).record_written(staging, name, size, checksum)


def commit(root: PathLike, staging: Location, *, step: int, generation: int, world_size: int,
           files: list[FileRecord], meta: dict[str, Any] | None = None,
           keep: int | None = None) -> CommittedCheckpoint:
    """``CheckpointRoot.commit`` of the root at ``root``; called by rank 0 only."""
    return CheckpointRoot.at(root).commit(staging, step=step, generation=generation, world_size=world_size,
                                          files=files, meta=meta, keep=keep)


def prune(root: PathLike, keep: int) -> list[Location]:
    """``CheckpointRoot.prune`` of the root at ``root``."""
    return CheckpointRoot.at(root).prune(keep)


def remove_stale_partials(root: PathLike, current_generation: int) -> list[Location]:
    """``CheckpointRoot.remove_stale_partials`` of the root at ``root``; only while no commit runs."""
    return CheckpointRoot.at(root).remove_stale_partials(current_generation)


def list_committed(root: PathLike) -> list[CommittedCheckpoint]:
    """``CheckpointRoot.list_committed`` of the root at ``root``: newest first, not verified."""
    return CheckpointRoot.at(root).list_committed()


def latest_verified(root: PathLike, on_corrupt: Callable[[Location, str], None] | None = None,
                    older_than: int | None = None) -> CommittedCheckpoint | None:
    """``CheckpointRoot.latest_verified`` of the root at ``root``."""
    return CheckpointRoot.at(root).latest_verified(on_corrupt, older_than)
