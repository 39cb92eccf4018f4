"""Committed T2 checkpoints read: verified and loaded file by file.

Runs in the worker processes (a restore, a repair from T2). A directory is a checkpoint once its
manifest parses (the commit writes it last); nothing is handed to ``torch.load`` before its size
and CRC-32 match the manifest. A ``CommittedCheckpoint`` is listed by its root (root.py) and
carries that root's ``StorageBackend``, which serves every read of it.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass, field
from typing import Any

import torch

from undying.checkpoint.backend import Location, StorageBackend, StoredManifest, member_location
from undying.checkpoint.manifest import (
    CorruptCheckpoint,
    FileRecord,
    Manifest,
    checkpoint_dirname,
    checksum_bytes,
    generation_dirname,
)
from undying.checkpoint.side_by_side import side_by_side

VERIFY_THREADS = 4  # files of one checkpoint checked at once


@dataclass
class CommittedCheckpoint:
    """A directory whose manifest parsed, and the backend of the root that listed it. Not yet
    verified: call ``verify`` or use ``latest_verified``; ``load_object`` checks each file it reads
    either way."""

    path: Location  # a Path under a local root, the directory's URL under a URL root
    manifest: Manifest = field(repr=False)
    backend: StorageBackend = field(repr=False, compare=False)

    @property
    def step(self) -> int:
        return self.manifest.step


def verify(ckpt: CommittedCheckpoint) -> None:
    """Check every listed file: inside the directory, present, right size, right checksum. Up to
    ``VERIFY_THREADS`` files are read at once; a failure is that of the first bad file in manifest order."""
    _verify_records(ckpt.backend, ckpt.path, ckpt.manifest.files)


def verify_files(ckpt: CommittedCheckpoint, names: list[str]) -> None:
    """``verify`` restricted to ``names`` (which must be listed in the manifest)."""
    _verify_records(ckpt.backend, ckpt.path, [ckpt.manifest.record(name) for name in names])


def load_object(ckpt: CommittedCheckpoint, name: str, map_location: str | torch.device = "cpu") -> Any:
    """Load one file of ``ckpt``, verifying its size and checksum before unpickling.

    Raises ``CorruptCheckpoint`` if the bytes do not match the manifest and ``KeyError``
    if the manifest lists no such file.
    """
    record = ckpt.manifest.record(name)
    backend = ckpt.backend
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


def manifest_of(stored: StoredManifest) -> Manifest:
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


def _verify_records(backend: StorageBackend, directory: Location, records: list[FileRecord]) -> None:
    # The reads and the CRC-32 release the GIL: files of a cold checkpoint are read side by side.
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
