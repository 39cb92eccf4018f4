"""T2 checkpoint storage: per-rank files committed by one checksummed manifest.

Runs in the worker processes: every rank writes its own files into the checkpoint's
directory, rank 0 commits them, and at restart every rank finds and loads the newest
checkpoint that verifies. ``root`` is a local (or shared-filesystem) path, or any fsspec
URL (``s3://``, ``gs://``, ``file://``, ``memory://``, ...). This module is the commit
protocol (write, commit, prune) and T2's API: finding, verifying and loading committed
checkpoints is committed.py, re-exported here. The filesystem calls and the directory layout
of each kind of root are a ``StorageBackend`` (backend.py), chosen once per call by
``backend_for`` (backends.py): ``LocalBackend
(local_backend.py, staging directories and one rename) or ``UrlBackend`` (url_backend.py,
written in place, the manifest is the commit). The manifest format is manifest.py.

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

import io
import logging
import time
from typing import Any

import torch

from undying.checkpoint.backend import (
    Location,
    PathLike,
    StorageBackend,
    is_url,
    member_location,
    root_location,
)
from undying.checkpoint.backends import backend_for
from undying.checkpoint.committed import (
    CommittedCheckpoint,
    latest_verified,
    list_committed,
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
    check_file_name,
    check_unique,
    checkpoint_dirname,
    checksum_bytes,
    json_normalized,
)

__all__ = [
    "CHECKSUM_ALGO",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "PARTIAL_SUFFIX",
    "REPLACED_SUFFIX",
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

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------ writing


def make_root(root: PathLike) -> None:
    """Create the checkpoint root if it does not exist yet (on an object store: nothing to do)."""
    backend_for(root).make_root(root)


def staging_dir(root: PathLike, step: int, generation: int) -> Location:
    """Create (if needed) and return the directory where ``generation`` writes ``step``.

    Under a local root: the staging directory ``step_<step>.g<generation>.partial`` that the
    commit renames. Under a URL root: the final directory ``step_<step>.g<generation>`` (its
    URL), which the commit's manifest turns into a checkpoint in place.

    Every rank may call this concurrently. Staging directories are never listed as
    checkpoints; a generation's leftovers are removed by ``remove_stale_partials``.
    """
    return backend_for(root).staging_dir(root, step, generation)


def save_object(staging: Location, name: str, obj: Any) -> FileRecord:
    """``torch.save`` ``obj`` to ``staging/name`` atomically (local: fsynced; URL: one object
    write) and return its record.

    The checksum is taken over the exact bytes written, before they reach the storage.
    """
    check_file_name(name)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getbuffer()
    record = FileRecord(name=name, size=data.nbytes, checksum=checksum_bytes(data))
    backend_for(staging).write_file(staging, name, data)
    return record


def record_file(staging: Location, name: str) -> FileRecord:
    """The record of a file another writer (e.g. torch.distributed.checkpoint) put in ``staging``:
    synced to disk (local), its size and CRC-32 read back from what the file now holds."""
    backend = backend_for(staging)
    backend.check_member(staging, name)
    backend.sync_file(staging, name)
    size, checksum = backend.file_checksum(staging, name)
    return FileRecord(name=name, size=size, checksum=checksum)


def record_written(staging: Location, name: str, size: int, checksum: str) -> FileRecord:
    """The record of a file written into ``staging`` by a writer that checksummed its bytes on the way
    out (checkpoint/dcp_writer.py): synced to disk (local), its size checked against what the file
    now holds; nothing is read back. ``CorruptCheckpoint`` if the size differs."""
    backend = backend_for(staging)
    backend.check_member(staging, name)
    backend.sync_file(staging, name)
    stored = backend.file_size(staging, name)
    if stored != size:
        raise CorruptCheckpoint(f"{member_location(staging, name)}: size {stored} != {size} bytes written")
    return FileRecord(name=name, size=size, checksum=checksum)


def commit(
    root: PathLike,
    staging: Location,
    *,
    step: int,
    generation: int,
    world_size: int,
    files: list[FileRecord],
    meta: dict[str, Any] | None = None,
    keep: int | None = None,
) -> CommittedCheckpoint:
    """Turn ``staging`` into the committed checkpoint of ``step``; called by rank 0 only.

    Every listed file must be in ``staging`` with its listed size, or ``CorruptCheckpoint``
    is raised and nothing is committed. Then the manifest is written into ``staging``, the
    last file, and the backend publishes it. Local root: the staging directory is renamed to
    ``step_<step>`` in one step; an existing checkpoint of the same step (committed again after
    a restart) is moved aside, replaced and deleted. URL root: the manifest, one object, was
    the commit; older generations' directories of the same step are deleted. With ``keep``,
    older checkpoints beyond the ``keep`` newest are pruned, after the commit, and so are this
    generation's unfinished directories of earlier steps (checkpoints that failed).
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for record in files:
        check_file_name(record.name)
    check_unique(files)
    backend = backend_for(root)
    backend.check_staging(root, staging, step, generation)
    for record in files:
        where = member_location(staging, record.name)
        try:
            size = backend.file_size(staging, record.name)
        except FileNotFoundError as exc:
            raise CorruptCheckpoint(f"{where}: missing at commit") from exc
        if size != record.size:
            raise CorruptCheckpoint(f"{where}: size {size} != recorded {record.size} at commit")

    manifest = Manifest(step=step, generation=generation, world_size=world_size, files=list(files),
                        meta=json_normalized(meta or {}), created=time.time())
    backend.write_file(staging, MANIFEST_NAME, manifest.to_json().encode())
    final = backend.publish(root, staging, step, generation)
    logger.info("committed checkpoint step %d (generation %d) at %s", step, generation, final)
    # This generation's checkpoints that failed before this one (a full disk) leave their partial
    # files behind: nobody will finish them, and they hold the space the next ones need.
    backend.remove_abandoned(root, generation, step)
    if keep is not None:
        prune(root, keep)
    return CommittedCheckpoint(final, manifest)


# ---------------------------------------------------------------------- cleaning


def prune(root: PathLike, keep: int) -> list[Location]:
    """Delete committed checkpoints beyond the ``keep`` newest; return what was removed.

    Staging (``.partial``, or under a URL root manifest-less) directories are never touched, so
    a write in progress is safe. Directories with a committed name but a bad manifest are left
    for inspection. Under a URL root each manifest is deleted before its files.
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    backend = backend_for(root)
    removed: list[Location] = []
    for ckpt in list_committed(root)[keep:]:
        backend.remove_checkpoint(ckpt.path)
        removed.append(ckpt.path)
        logger.info("pruned checkpoint step %d at %s", ckpt.step, ckpt.path)
    return removed


def remove_stale_partials(root: PathLike, current_generation: int) -> list[Location]:
    """Delete staging directories of other generations and ``.replaced`` leftovers (under a URL
    root: manifest-less directories of other generations, and committed ones replaced by a
    newer generation's commit of the same step).

    Call only while no commit is running (e.g. at job start or after a regroup).
    """
    return backend_for(root).remove_stale(root, current_generation)
