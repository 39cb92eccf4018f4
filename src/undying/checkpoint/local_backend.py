"""T2 storage on a local (or shared) filesystem: staging directories committed by one rename.

Runs in the worker processes (the persister thread, the dying-checkpoint writer and the
restore), as the ``StorageBackend`` that a ``CheckpointRoot`` (root.py) given as a path is bound to.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from undying.checkpoint.backend import Location, PathLike, StoredManifest, is_url
from undying.checkpoint.manifest import (
    MANIFEST_NAME,
    PARTIAL_RE,
    REPLACED_SUFFIX,
    TMP_SUFFIX,
    CorruptCheckpoint,
    check_member_name,
    checkpoint_dirname,
    checksum_stream,
    committed_step,
    staging_dirname,
)


class LocalBackend:
    """A checkpoint root on a filesystem with atomic rename and ``fsync``::

        step_000000120/                 committed: MANIFEST.json + the files it lists
        step_000000130.g3.partial/      staging of step 130 by generation 3 (not a checkpoint)
        step_000000120.g4.replaced/     an old directory on its way out (not a checkpoint)

    Guarantees:

    * A directory is a checkpoint only once its name is ``step_<step>`` and it holds the
      manifest: both come from one ``rename`` of a fully written, fsynced staging directory,
      followed by an fsync of the root, so a crash at any point leaves either the old state or
      the new one.
    * Each file is written to a temporary name, fsynced and renamed, and its directory is
      fsynced by the writer itself (on a shared filesystem, rank 0 cannot make another client's
      directory entry durable).
    * A checkpoint is deleted by renaming it to a ``.replaced`` name first, so a crash midway
      never leaves a half-deleted directory under a committed name.

    Not guaranteed: on a shared filesystem, durability is only as good as its ``fsync``.
    """

    kernel_writeback = True

    def dcp_writer(self, directory: Location, thread_count: int) -> Any:
        """DCP's ``FileSystemWriter``: each data file fsynced once by DCP, ``.metadata`` before its rename."""
        # Imported here: torch.distributed.checkpoint costs every worker ~1.6 s of import.
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(directory, sync_files=True, single_file_per_rank=True, thread_count=thread_count)

    def dcp_reader(self, directory: Location) -> Any:
        from undying.checkpoint.dcp_reader import ParallelFileReader

        return ParallelFileReader(directory)

    def make_root(self, root: PathLike) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)

    def staging_dir(self, root: PathLike, step: int, generation: int) -> Path:
        path = Path(root) / staging_dirname(step, generation)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def check_staging(self, root: PathLike, staging: Location, step: int, generation: int) -> None:
        if is_url(staging):
            raise ValueError(f"{staging} is not inside {root}")
        staging = Path(staging)
        if staging.name != staging_dirname(step, generation):
            raise ValueError(f"{staging} is not the staging directory of step {step}, generation {generation}")
        if staging.parent.resolve() != Path(root).resolve():
            raise ValueError(f"{staging} is not inside {root}")

    def check_member(self, directory: Location, name: str) -> None:
        check_member_name(directory, name)
        path = Path(directory) / name
        if not path.resolve().is_relative_to(Path(directory).resolve()):
            raise CorruptCheckpoint(f"{path}: resolves outside the checkpoint directory")

    def write_file(self, directory: Location, name: str, data: bytes | memoryview) -> None:
        _write_atomic(Path(directory) / name, data)
        _fsync(Path(directory))

    def sync_file(self, directory: Location, name: str) -> None:
        _fsync(Path(directory) / name)
        _fsync(Path(directory))

    def file_size(self, directory: Location, name: str) -> int:
        path = Path(directory) / name
        if not path.is_file():
            raise FileNotFoundError(path)
        return path.stat().st_size

    def file_checksum(self, directory: Location, name: str) -> tuple[int, str]:
        with open(Path(directory) / name, "rb") as f:
            return checksum_stream(f)

    def read_file(self, directory: Location, name: str) -> bytes:
        return (Path(directory) / name).read_bytes()

    def publish(self, root: PathLike, staging: Location, step: int, generation: int) -> Path:
        """Rename ``staging`` to ``step_<step>``; a checkpoint of the same step (committed again
        after a restart) is moved aside first and deleted once the new one is in place."""
        root = Path(root)
        final = root / checkpoint_dirname(step)
        aside: Path | None = None
        if final.exists():
            aside = root / f"{final.name}.g{generation}{REPLACED_SUFFIX}"
            if aside.exists():
                shutil.rmtree(aside)
            os.rename(final, aside)
        os.rename(staging, final)
        _fsync(root)
        if aside is not None:
            shutil.rmtree(aside)
        return final

    def scan(self, root: PathLike) -> Iterator[StoredManifest]:
        root = Path(root)
        if not root.is_dir():
            return
        candidates: list[tuple[int, Path]] = []
        for entry in root.iterdir():
            step = committed_step(entry.name)
            if step is not None and entry.is_dir():
                candidates.append((step, entry))
        for step, path in sorted(candidates, reverse=True):
            manifest_path = path / MANIFEST_NAME
            text, problem = None, ""
            try:
                text = manifest_path.read_bytes()
            except FileNotFoundError:
                problem = "manifest missing"
            except OSError as exc:
                problem = f"manifest unreadable ({exc})"
            yield StoredManifest(path, step, None, str(manifest_path), text, problem)

    def remove_checkpoint(self, location: Location) -> None:
        path = Path(location)
        aside = path.with_name(path.name + REPLACED_SUFFIX)
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(path, aside)
        shutil.rmtree(aside)

    def remove_stale(self, root: PathLike, current_generation: int) -> list[Location]:
        """Staging directories of other generations, and ``.replaced`` leftovers."""
        root = Path(root)
        if not root.is_dir():
            return []
        removed: list[Location] = []
        for entry in sorted(root.iterdir()):
            if not entry.is_dir():
                continue
            partial_match = PARTIAL_RE.fullmatch(entry.name)
            stale_partial = partial_match is not None and int(partial_match.group(2)) != current_generation
            if stale_partial or entry.name.endswith(REPLACED_SUFFIX):
                shutil.rmtree(entry)
                removed.append(entry)
        return removed


    def remove_abandoned(self, root: PathLike, generation: int, before_step: int) -> list[Location]:
        removed: list[Location] = []
        for entry in sorted(Path(root).iterdir()):
            match = PARTIAL_RE.fullmatch(entry.name)
            if match is not None and int(match.group(2)) == generation and int(match.group(1)) < before_step:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
        return removed


def _fsync(path: Path) -> None:
    """Make renames and creations inside the directory ``path`` durable (on a file: its contents)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    """Write to ``path.tmp``, fsync, rename over ``path``: readers see all or nothing."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
