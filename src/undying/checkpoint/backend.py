"""The storage backend interface of T2: what the commit protocol asks of one kind of checkpoint root.

Runs in the worker processes. A ``CheckpointRoot`` (root.py) holds the protocol (manifests,
verification, which checkpoint is the newest) and the backend chosen once, when the root is built
(backends.py): ``LocalBackend`` (local_backend.py) for a path, ``UrlBackend`` (url_backend.py) for
an fsspec URL. A backend holds its root's layout, its filesystem calls and the DCP storage
writer and reader for it, and nothing about manifests beyond where the manifest file lives.
``is_url`` is asked only here, in backends.py and in the backends themselves.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeAlias, TypeGuard

PathLike: TypeAlias = str | os.PathLike[str]
# A checkpoint root or directory: a local ``Path``, or an fsspec URL (a ``str`` with ``://``).
Location: TypeAlias = Path | str


def is_url(location: object) -> TypeGuard[str]:
    """Whether ``location`` is an fsspec URL (a string with ``://``, ``file://`` included) rather
    than a local path. A ``Path`` is always local (``Path("s3://b")`` has lost a slash already)."""
    return isinstance(location, str) and "://" in location


def root_location(directory: str) -> Location:
    """``checkpoint.dir`` as storage takes it: a URL as given, anything else as a local ``Path``."""
    return directory if is_url(directory) else Path(directory)


def member_location(directory: PathLike, name: str) -> str:
    """Where the file ``name`` of ``directory`` is, as messages name it (a path or a URL)."""
    base = str(directory)
    return base + name if base.endswith("/") else f"{base}/{name}"


@dataclass(frozen=True)
class StoredManifest:
    """A directory that a backend's listing takes for a checkpoint, and its manifest file's bytes.

    ``generation`` is the one the directory's name carries, in a layout whose names carry one
    (URL roots), else None. ``text`` is None when the manifest could not be read; ``problem``
    then says why ("manifest missing", "manifest unreadable (...)").
    """

    location: Location
    step: int
    generation: int | None
    manifest_location: str
    text: bytes | None
    problem: str = ""


class StorageBackend(Protocol):
    """The operations of the T2 commit protocol on one kind of root.

    Directories are given as storage hands them out (``staging_dir``, ``publish``, ``scan``);
    a file ``name`` is a plain name inside one, already checked by the caller.
    Every method may raise ``OSError`` for a filesystem that fails.
    """

    # Whether written files have descriptors whose dirty pages the kernel can be asked to start
    # writing back early (checkpoint/dcp_writer.py): a local file has, an fsspec object has not.
    kernel_writeback: bool

    def dcp_writer(self, directory: Location, thread_count: int) -> Any:
        """DCP's storage writer into ``directory``: one file per rank and writer thread, durable
        as far as this kind of root makes files durable."""

    def dcp_reader(self, directory: Location) -> Any:
        """DCP's storage reader of the verified checkpoint ``directory``, its data files read on
        threads (checkpoint/dcp_reader.py)."""

    def make_root(self, root: PathLike) -> None:
        """Create the root if the filesystem needs it; a no-op where directories are implicit."""

    def staging_dir(self, root: PathLike, step: int, generation: int) -> Location:
        """Create (if needed) and return the directory ``generation`` writes ``step``'s files into.
        Safe to call from every rank at once."""

    def check_staging(self, root: PathLike, staging: Location, step: int, generation: int) -> None:
        """``ValueError`` unless ``staging`` is what ``staging_dir(root, step, generation)`` returns."""

    def check_member(self, directory: Location, name: str) -> None:
        """``CorruptCheckpoint`` if the file ``name`` (read from a manifest) is not a plain name, or
        would resolve outside ``directory``."""

    def write_file(self, directory: Location, name: str, data: bytes | memoryview) -> None:
        """Write ``data`` as ``name`` so that readers see all of it or none, durably where the
        filesystem allows (the file and its directory entry fsynced)."""

    def sync_file(self, directory: Location, name: str) -> None:
        """Make a file another writer put into ``directory`` durable, where the filesystem allows."""

    def file_size(self, directory: Location, name: str) -> int:
        """The size of ``name``; ``FileNotFoundError`` if it is missing."""

    def file_checksum(self, directory: Location, name: str) -> tuple[int, str]:
        """Size and CRC-32 of what ``name`` holds now, streamed; ``FileNotFoundError`` if missing."""

    def read_file(self, directory: Location, name: str) -> bytes:
        """All bytes of ``name``; ``FileNotFoundError`` if missing."""

    def publish(self, root: PathLike, staging: Location, step: int, generation: int) -> Location:
        """Make ``staging``, whose manifest is written and durable, the checkpoint of ``step`` in
        one atomic step, replace any older checkpoint of that step, and return its directory."""

    def scan(self, root: PathLike) -> Iterator[StoredManifest]:
        """The directories that may be checkpoints, newest step first, each with its manifest's
        bytes; a missing root has none."""

    def remove_checkpoint(self, location: Location) -> None:
        """Delete a checkpoint so that no crash midway leaves a partly deleted one that lists."""

    def remove_stale(self, root: PathLike, current_generation: int) -> list[Location]:
        """Delete other generations' unfinished directories and leftovers of replaced or cut-short
        deletions; return what was removed. Only while no commit runs."""

    def remove_abandoned(self, root: PathLike, generation: int, before_step: int) -> list[Location]:
        """Delete ``generation``'s unfinished directories of steps before ``before_step``, whose
        checkpoints failed (a full disk): once that generation committed ``before_step`` every
        member is done with them. Return what was removed."""
