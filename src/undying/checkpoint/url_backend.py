"""T2 storage behind an fsspec URL (``s3://``, ``gs://``, ``file://``, ``memory://``, ...): written in
place, committed by the manifest.

Runs in the worker processes (the persister thread, the dying-checkpoint writer and the
restore), as the ``StorageBackend`` that a ``CheckpointRoot`` (root.py) given as a URL is bound to.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from undying.checkpoint.backend import Location, PathLike, StoredManifest, is_url, member_location
from undying.checkpoint.manifest import (
    MANIFEST_NAME,
    check_member_name,
    checksum_stream,
    generation_dir_id,
    generation_dirname,
)


@dataclass(frozen=True)
class UrlDir:
    """A directory behind an fsspec URL: its filesystem, its path on it, and the URL users see."""

    fs: Any  # fsspec.AbstractFileSystem
    path: str
    url: str

    @classmethod
    def open(cls, url: PathLike) -> UrlDir:
        # Imported here: only URL roots need fsspec (a dependency of torch, so always installed).
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(str(url))
        return cls(fs, path, str(url))

    def child(self, name: str) -> UrlDir:
        return UrlDir(self.fs, member_location(self.path, name), member_location(self.url, name))

    def member(self, name: str) -> str:
        """The path on ``fs`` of the object ``name`` in this directory."""
        return member_location(self.path, name)

    def children(self) -> list[str]:
        """Names directly under this directory (none if it does not exist), listed afresh."""
        self.fs.invalidate_cache(self.path)  # s3fs and others cache listings
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]


class UrlBackend:
    """A checkpoint root behind an fsspec URL. Object stores have no atomic rename, so nothing is
    renamed::

        step_000000120.g3/      written in place by generation 3; a checkpoint once its
                                MANIFEST.json exists and parses (the last object written)

    Guarantees:

    * Each file is one object write (``pipe_file``): on an object store it appears whole or not
      at all.
    * A directory is a checkpoint only once its manifest, written in one object write after
      every file it lists, exists; a writer killed earlier leaves files without a manifest,
      which are never listed and are removed by ``remove_stale``. Of one step, the newest
      generation with a manifest counts.
    * Each generation writes its own directory, so a late writer of an old generation never
      touches a newer generation's files.
    * Deletions remove the manifest first, so a half-deleted checkpoint is no longer one.
    * Listings are refreshed on each call (fsspec filesystems cache them).

    Not guaranteed: durability is the store's (a ``file://`` URL is not fsynced), and a store
    whose listings lag its writes may not show the newest checkpoint yet.
    """

    kernel_writeback = False

    def dcp_writer(self, directory: Location, thread_count: int) -> Any:
        """DCP's fsspec writer, without ``sync_files``: an fsspec file without a descriptor makes DCP
        fall back to ``os.sync()`` of the whole machine; the store makes a closed file durable."""
        from undying._torch_compat.dcp import FsspecWriter

        return FsspecWriter(directory, sync_files=False, single_file_per_rank=True, thread_count=thread_count)

    def dcp_reader(self, directory: Location) -> Any:
        from undying.checkpoint.dcp_reader import ParallelFsspecReader

        return ParallelFsspecReader(directory)

    def make_root(self, root: PathLike) -> None:
        _makedirs(UrlDir.open(root))

    def staging_dir(self, root: PathLike, step: int, generation: int) -> str:
        """The final directory ``step_<step>.g<generation>``, which the manifest commits in place."""
        directory = UrlDir.open(root).child(generation_dirname(step, generation))
        _makedirs(directory)
        return directory.url

    def check_staging(self, root: PathLike, staging: Location, step: int, generation: int) -> None:
        if not (is_url(root) and is_url(staging)):
            raise ValueError(f"{staging} is not inside {root}")
        directory = UrlDir.open(root).child(generation_dirname(step, generation))
        if staging.rstrip("/") != directory.url:
            raise ValueError(f"{staging} is not the directory of step {step}, generation {generation} in {root}")

    def check_member(self, directory: Location, name: str) -> None:
        check_member_name(directory, name)  # an object name cannot resolve elsewhere: no links

    def write_file(self, directory: Location, name: str, data: bytes | memoryview) -> None:
        url_dir = UrlDir.open(directory)
        url_dir.fs.pipe_file(url_dir.member(name), bytes(data))

    def sync_file(self, directory: Location, name: str) -> None:
        """Nothing to do: an fsspec file is as durable as the store makes it once it is closed."""

    def file_size(self, directory: Location, name: str) -> int:
        url_dir = UrlDir.open(directory)
        return int(url_dir.fs.size(url_dir.member(name)))

    def file_checksum(self, directory: Location, name: str) -> tuple[int, str]:
        url_dir = UrlDir.open(directory)
        with url_dir.fs.open(url_dir.member(name), "rb") as f:
            return checksum_stream(f)

    def read_file(self, directory: Location, name: str) -> bytes:
        return _read(UrlDir.open(directory), name)

    def publish(self, root: PathLike, staging: Location, step: int, generation: int) -> str:
        """The manifest written made the directory a checkpoint already; this deletes the copies of
        the same step committed (or begun) by older generations."""
        root_dir = UrlDir.open(root)
        for name in root_dir.children():
            ident = generation_dir_id(name)
            if ident is not None and ident[0] == step and ident[1] < generation:
                _remove(root_dir.child(name))
        return root_dir.child(generation_dirname(step, generation)).url

    def scan(self, root: PathLike) -> Iterator[StoredManifest]:
        """Of each step, the newest generation's directory that has a manifest; a directory without
        one is still being written (or was abandoned) and is not a checkpoint."""
        root_dir = UrlDir.open(root)
        generations: dict[int, list[int]] = {}
        for name in root_dir.children():
            ident = generation_dir_id(name)
            if ident is not None:
                generations.setdefault(ident[0], []).append(ident[1])
        for step in sorted(generations, reverse=True):
            for generation in sorted(generations[step], reverse=True):
                directory = root_dir.child(generation_dirname(step, generation))
                manifest_location = member_location(directory.url, MANIFEST_NAME)
                try:
                    text = _read(directory, MANIFEST_NAME)
                except FileNotFoundError:
                    continue  # being written, or abandoned mid-write: not a checkpoint
                except OSError as exc:
                    yield StoredManifest(directory.url, step, generation, manifest_location, None,
                                         f"manifest unreadable ({exc})")
                else:
                    yield StoredManifest(directory.url, step, generation, manifest_location, text)
                break

    def remove_checkpoint(self, location: Location) -> None:
        _remove(UrlDir.open(location))

    def remove_stale(self, root: PathLike, current_generation: int) -> list[Location]:
        """Manifest-less directories of other generations, and committed ones replaced by a newer
        generation's commit of the same step."""
        root_dir = UrlDir.open(root)
        idents = sorted((ident for name in root_dir.children() if (ident := generation_dir_id(name))),
                        reverse=True)
        committed_steps: set[int] = set()
        stale: list[UrlDir] = []
        for step, generation in idents:  # each step's newest generation first
            directory = root_dir.child(generation_dirname(step, generation))
            if directory.fs.exists(directory.member(MANIFEST_NAME)):
                if step in committed_steps:
                    stale.append(directory)  # replaced by a newer generation's commit of the same step
                committed_steps.add(step)
            elif generation != current_generation:
                stale.append(directory)  # a writer killed mid-write, or a deletion cut short
        for directory in stale:
            _remove(directory)
        return sorted(directory.url for directory in stale)


    def remove_abandoned(self, root: PathLike, generation: int, before_step: int) -> list[Location]:
        root_dir = UrlDir.open(root)
        abandoned = []
        for name in root_dir.children():
            ident = generation_dir_id(name)
            if ident is None or ident[1] != generation or ident[0] >= before_step:
                continue
            directory = root_dir.child(name)
            if not directory.fs.exists(directory.member(MANIFEST_NAME)):
                abandoned.append(directory)
        for directory in abandoned:
            _remove(directory)
        return sorted(directory.url for directory in abandoned)


def _makedirs(directory: UrlDir) -> None:
    """Needed by filesystems with real directories (``file://``); a no-op on object stores."""
    directory.fs.makedirs(directory.path, exist_ok=True)


def _read(directory: UrlDir, name: str) -> bytes:
    data: bytes = directory.fs.cat_file(directory.member(name))
    return data


def _remove(directory: UrlDir) -> None:
    """Delete a checkpoint directory, manifest first: from that first delete on it is no longer a
    checkpoint, and whatever a crash leaves is removed by ``remove_stale``."""
    for delete, path in ((directory.fs.rm_file, directory.member(MANIFEST_NAME)),
                         (partial(directory.fs.rm, recursive=True), directory.path)):
        try:
            delete(path)
        except FileNotFoundError:
            pass  # already gone (an object store drops a prefix with its last object)
