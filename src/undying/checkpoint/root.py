"""A checkpoint root bound to its storage backend: T2's commit protocol on one root.

Runs in the worker processes. A ``CheckpointRoot`` is built once per root (the worker's is built in
runtime/snapshots.py, ``checkpoint_root``), and that is when its ``StorageBackend`` is chosen from
the location (backends.py): ``LocalBackend`` for a path, ``UrlBackend`` for an fsspec URL. Every
operation of the commit protocol (staging, writing, committing, pruning, listing, verifying) is a
method that asks the backend it holds; the checkpoints it lists carry that backend to their
readers (committed.py). The manifest format is manifest.py; the guarantees are storage.py's.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from undying.checkpoint.backend import Location, PathLike, StorageBackend, member_location, root_location
from undying.checkpoint.backends import backend_for
from undying.checkpoint.committed import CommittedCheckpoint, manifest_of, verify
from undying.checkpoint.manifest import (
    MANIFEST_NAME,
    CorruptCheckpoint,
    FileRecord,
    Manifest,
    check_file_name,
    check_unique,
    checksum_bytes,
    json_normalized,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointRoot:
    """One checkpoint root (``location``: a local ``Path`` or an fsspec URL) and the backend that
    serves it and every directory under it, chosen once when the root is built (``at``)."""

    location: Location
    backend: StorageBackend = field(repr=False, compare=False)

    @classmethod
    def at(cls, location: PathLike) -> CheckpointRoot:
        """The root at ``location`` (a URL as given, anything else as a local ``Path``), bound to
        the backend for it."""
        bound = root_location(os.fspath(location))
        return cls(bound, backend_for(bound))

    @classmethod
    def of(cls, root: PathLike | CheckpointRoot) -> CheckpointRoot:
        """``root`` itself if it is bound already, else the root at that location."""
        return root if isinstance(root, CheckpointRoot) else cls.at(root)

    def __str__(self) -> str:
        return str(self.location)

    # -------------------------------------------------------------------- writing

    def make(self) -> None:
        """Create the root if it does not exist yet (on an object store: nothing to do)."""
        self.backend.make_root(self.location)

    def staging_dir(self, step: int, generation: int) -> Location:
        """Create (if needed) and return the directory where ``generation`` writes ``step``.

        Under a local root: the staging directory ``step_<step>.g<generation>.partial`` that the
        commit renames. Under a URL root: the final directory ``step_<step>.g<generation>`` (its
        URL), which the commit's manifest turns into a checkpoint in place.

        Every rank may call this concurrently. Staging directories are never listed as
        checkpoints; a generation's leftovers are removed by ``remove_stale_partials``.
        """
        return self.backend.staging_dir(self.location, step, generation)

    def save_object(self, staging: Location, name: str, obj: Any) -> FileRecord:
        """``torch.save`` ``obj`` to ``staging/name`` atomically (local: fsynced; URL: one object
        write) and return its record. The checksum is taken over the exact bytes written, before
        they reach the storage."""
        check_file_name(name)
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getbuffer()
        record = FileRecord(name=name, size=data.nbytes, checksum=checksum_bytes(data))
        self.backend.write_file(staging, name, data)
        return record

    def record_file(self, staging: Location, name: str) -> FileRecord:
        """The record of a file another writer (e.g. torch.distributed.checkpoint) put in ``staging``:
        synced to disk (local), its size and CRC-32 read back from what the file now holds."""
        self.backend.check_member(staging, name)
        self.backend.sync_file(staging, name)
        size, checksum = self.backend.file_checksum(staging, name)
        return FileRecord(name=name, size=size, checksum=checksum)

    def record_written(self, staging: Location, name: str, size: int, checksum: str) -> FileRecord:
        """The record of a file written into ``staging`` by a writer that checksummed its bytes on the
        way out (checkpoint/dcp_writer.py): synced to disk (local), its size checked against what the
        file now holds; nothing is read back. ``CorruptCheckpoint`` if the size differs."""
        self.backend.check_member(staging, name)
        self.backend.sync_file(staging, name)
        stored = self.backend.file_size(staging, name)
        if stored != size:
            raise CorruptCheckpoint(f"{member_location(staging, name)}: size {stored} != {size} bytes written")
        return FileRecord(name=name, size=size, checksum=checksum)

    def commit(self, staging: Location, *, step: int, generation: int, world_size: int,
               files: list[FileRecord], meta: dict[str, Any] | None = None,
               keep: int | None = None) -> CommittedCheckpoint:
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
        backend = self.backend
        backend.check_staging(self.location, staging, step, generation)
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
        final = backend.publish(self.location, staging, step, generation)
        logger.info("committed checkpoint step %d (generation %d) at %s", step, generation, final)
        # This generation's checkpoints that failed before this one (a full disk) leave their partial
        # files behind: nobody will finish them, and they hold the space the next ones need.
        backend.remove_abandoned(self.location, generation, step)
        if keep is not None:
            self.prune(keep)
        return CommittedCheckpoint(final, manifest, backend)

    # ------------------------------------------------------------------- cleaning

    def prune(self, keep: int) -> list[Location]:
        """Delete committed checkpoints beyond the ``keep`` newest; return what was removed.

        Staging (``.partial``, or under a URL root manifest-less) directories are never touched, so
        a write in progress is safe. Directories with a committed name but a bad manifest are left
        for inspection. Under a URL root each manifest is deleted before its files.
        """
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        removed: list[Location] = []
        for ckpt in self.list_committed()[keep:]:
            self.backend.remove_checkpoint(ckpt.path)
            removed.append(ckpt.path)
            logger.info("pruned checkpoint step %d at %s", ckpt.step, ckpt.path)
        return removed

    def remove_stale_partials(self, current_generation: int) -> list[Location]:
        """Delete staging directories of other generations and ``.replaced`` leftovers (under a URL
        root: manifest-less directories of other generations, and committed ones replaced by a
        newer generation's commit of the same step).

        Call only while no commit is running (e.g. at job start or after a regroup).
        """
        return self.backend.remove_stale(self.location, current_generation)

    # -------------------------------------------------------------------- reading

    def list_committed(self) -> list[CommittedCheckpoint]:
        """Committed checkpoints whose manifest parses, newest (highest step) first.

        Files are not verified here; a directory with a missing or bad manifest is left out.
        """
        return [ckpt for _, _, ckpt, _ in self._scan() if ckpt is not None]

    def latest_verified(self, on_corrupt: Callable[[Location, str], None] | None = None,
                        older_than: int | None = None) -> CommittedCheckpoint | None:
        """The newest checkpoint that passes ``verify`` (with ``older_than``: the newest of a step
        below it), or None if there is none.

        Every skipped directory (bad or missing manifest, or a file that fails verification)
        is reported to ``on_corrupt(path, reason)``, or logged as a warning without one; under a
        URL root a directory without a manifest is not a checkpoint and is not reported.
        Reads every file of each checkpoint it tries.
        """
        for location, step, ckpt, reason in self._scan():
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

    def _scan(self) -> Iterator[tuple[Location, int, CommittedCheckpoint | None, str]]:
        """Every committed-looking directory, newest first: (location, step, checkpoint or None, reason)."""
        for stored in self.backend.scan(self.location):
            try:
                ckpt: CommittedCheckpoint | None = CommittedCheckpoint(stored.location, manifest_of(stored),
                                                                       self.backend)
                reason = ""
            except CorruptCheckpoint as exc:
                ckpt, reason = None, str(exc)
            yield stored.location, stored.step, ckpt, reason
