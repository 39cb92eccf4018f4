"""T2 checkpoint storage: per-rank files committed by one checksummed manifest.

Runs in the worker processes: every rank writes its own files into the checkpoint's
directory, rank 0 commits them, and at restart every rank finds and loads the newest
checkpoint that verifies. ``root`` is a local (or shared-filesystem) path, or any fsspec
URL (``s3://``, ``gs://``, ``file://``, ``memory://``, ...). This module is the commit
protocol; the filesystem calls and the directory layout of each kind of root are a
``StorageBackend`` (backend.py), chosen once per call by ``backend_for``: ``LocalBackend``
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

import functools
import io
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from undying.checkpoint.backend import (
    Location,
    PathLike,
    StorageBackend,
    StoredManifest,
    is_url,
    member_location,
    root_location,
)
from undying.checkpoint.local_backend import LocalBackend
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
    generation_dirname,
    json_normalized,
)
from undying.checkpoint.side_by_side import side_by_side
from undying.checkpoint.url_backend import UrlBackend

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
VERIFY_THREADS = 4  # files of one checkpoint checked at once

_LOCAL = LocalBackend()
_URL = UrlBackend()


def backend_for(location: PathLike) -> StorageBackend:
    """The backend of a root or checkpoint directory: ``UrlBackend`` for an fsspec URL (``is_url``),
    ``LocalBackend`` for anything else."""
    return _URL if is_url(location) else _LOCAL


@dataclass
class CommittedCheckpoint:
    """A directory whose manifest parsed. Not yet verified: call ``verify`` or use
    ``latest_verified``; ``load_object`` checks each file it reads either way."""

    path: Location  # a Path under a local root, the directory's URL under a URL root
    manifest: Manifest = field(repr=False)

    @property
    def step(self) -> int:
        return self.manifest.step


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


# ------------------------------------------------------------------------ reading


def list_committed(root: PathLike) -> list[CommittedCheckpoint]:
    """Committed checkpoints whose manifest parses, newest (highest step) first.

    Files are not verified here; a directory with a missing or bad manifest is left out.
    """
    return [ckpt for _, _, ckpt, _ in _scan(root) if ckpt is not None]


def verify(ckpt: CommittedCheckpoint) -> None:
    """Check every listed file: inside the directory, present, right size, right checksum. Up to
    ``VERIFY_THREADS`` files are read at once; a failure is that of the first bad file in manifest order."""
    _verify_records(ckpt.path, ckpt.manifest.files)


def verify_files(ckpt: CommittedCheckpoint, names: list[str]) -> None:
    """``verify`` restricted to ``names`` (which must be listed in the manifest)."""
    _verify_records(ckpt.path, [ckpt.manifest.record(name) for name in names])


def load_object(ckpt: CommittedCheckpoint, name: str, map_location: str | torch.device = "cpu") -> Any:
    """Load one file of ``ckpt``, verifying its size and checksum before unpickling.

    Raises ``CorruptCheckpoint`` if the bytes do not match the manifest and ``KeyError``
    if the manifest lists no such file.
    """
    record = ckpt.manifest.record(name)
    backend = backend_for(ckpt.path)
    backend.check_member(ckpt.path, name)
    where = member_location(ckpt.path, name)
    try:
        data = backend.read_file(ckpt.path, name)
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"{where}: missing") from exc
    except OSError as exc:
        raise CorruptCheckpoint(f"{where}: unreadable ({exc})") from exc
    if len(data) != record.size:
        raise CorruptCheckpoint(f"{where}: size {len(data)} != recorded {record.size}")
    checksum = checksum_bytes(data)
    if checksum != record.checksum:
        raise CorruptCheckpoint(f"{where}: checksum {checksum} != recorded {record.checksum}")
    # weights_only=False is acceptable only because these exact bytes were just matched
    # against the checksum in a manifest this job wrote; the files hold Python objects
    # (RNG states, data positions) that the weights-only unpickler rejects.
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)


def latest_verified(
    root: PathLike, on_corrupt: Callable[[Location, str], None] | None = None, older_than: int | None = None
) -> CommittedCheckpoint | None:
    """The newest checkpoint that passes ``verify`` (with ``older_than``: the newest of a step below
    it), or None if there is none.

    Every skipped directory (bad or missing manifest, or a file that fails verification)
    is reported to ``on_corrupt(path, reason)``, or logged as a warning without one; under a
    URL root a directory without a manifest is not a checkpoint and is not reported.
    Reads every file of each checkpoint it tries.
    """
    for location, step, ckpt, reason in _scan(root):
        if older_than is not None and step >= older_than:
            continue
        if ckpt is not None:
            try:
                verify(ckpt)
                return ckpt
            except CorruptCheckpoint as exc:
                reason = str(exc)
        if on_corrupt is not None:
            on_corrupt(location, reason)
        else:
            logger.warning("skipping corrupt checkpoint %s: %s", location, reason)
    return None


def _scan(root: PathLike) -> Iterator[tuple[Location, int, CommittedCheckpoint | None, str]]:
    """Every committed-looking directory, newest first: (location, step, checkpoint or None, reason)."""
    for stored in backend_for(root).scan(root):
        try:
            ckpt: CommittedCheckpoint | None = CommittedCheckpoint(stored.location, _manifest_of(stored))
            reason = ""
        except CorruptCheckpoint as exc:
            ckpt, reason = None, str(exc)
        yield stored.location, stored.step, ckpt, reason


def _manifest_of(stored: StoredManifest) -> Manifest:
    """The manifest a listed directory holds, if it parses and names that directory's step (and
    generation, where the name carries one); else ``CorruptCheckpoint``."""
    where = stored.manifest_location
    if stored.text is None:
        raise CorruptCheckpoint(f"{where}: {stored.problem}")
    try:
        manifest = Manifest.from_json(stored.text)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{where}: bad manifest: {exc}") from exc
    if stored.generation is None:
        if manifest.step != stored.step:
            raise CorruptCheckpoint(f"{where}: bad manifest: step {manifest.step} does not match "
                                    f"directory {checkpoint_dirname(stored.step)}")
    elif (manifest.step, manifest.generation) != (stored.step, stored.generation):
        raise CorruptCheckpoint(f"{where}: bad manifest: step {manifest.step}, generation {manifest.generation} "
                                f"do not match directory {generation_dirname(stored.step, stored.generation)}")
    return manifest


def _verify_records(directory: Location, records: list[FileRecord]) -> None:
    # The reads and the CRC-32 release the GIL: files of a cold checkpoint are read side by side.
    backend = backend_for(directory)
    side_by_side([functools.partial(_verify_record, backend, directory, record) for record in records],
                 VERIFY_THREADS, "undying-verify")


def _verify_record(backend: StorageBackend, directory: Location, record: FileRecord) -> None:
    backend.check_member(directory, record.name)
    where = member_location(directory, record.name)
    try:
        size = backend.file_size(directory, record.name)
        if size != record.size:
            raise CorruptCheckpoint(f"{where}: size {size} != recorded {record.size}")
        _, checksum = backend.file_checksum(directory, record.name)
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"{where}: missing") from exc
    except OSError as exc:
        raise CorruptCheckpoint(f"{where}: unreadable ({exc})") from exc
    if checksum != record.checksum:
        raise CorruptCheckpoint(f"{where}: checksum {checksum} != recorded {record.checksum}")


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
