"""T2 checkpoint storage: per-rank files committed by one atomic, checksummed manifest.

Runs in the worker processes: every rank writes its own files into a staging
directory, rank 0 commits them, and at restart every rank finds and loads the newest
checkpoint that verifies. Local filesystem only; every filesystem call sits in a small
private helper so the module can move to fsspec without changing its API.

Layout under ``root``::

    step_000000120/                 committed: MANIFEST.json + the files it lists
    step_000000130.g3.partial/      staging of step 130 by generation 3 (not a checkpoint)
    step_000000120.g4.replaced/     an old directory on its way out (not a checkpoint)

Guarantees:

* A directory is a checkpoint only once its name is ``step_<step>`` and it holds a
  parseable manifest. Both come from one ``rename`` of a fully written, fsynced staging
  directory, so a crash at any point leaves either the old state or the new one.
* Nothing is handed to ``torch.load`` before its size and CRC-32 match the manifest, and
  the manifest carries a checksum of its own, so a flipped byte anywhere is detected.

Not guaranteed: CRC-32 detects accidental corruption (bit rot, truncation, torn writes),
not deliberate tampering; on a shared filesystem, durability is only as good as the
filesystem's ``fsync``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import torch

logger = logging.getLogger(__name__)

PathLike: TypeAlias = str | os.PathLike[str]

CHECKSUM_ALGO = "crc32"
MANIFEST_NAME = "MANIFEST.json"
FORMAT_VERSION = 1

PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
_TMP_SUFFIX = ".tmp"
_READ_CHUNK = 4 << 20

_COMMITTED_RE = re.compile(r"step_(\d{9,})")
_PARTIAL_RE = re.compile(r"step_(\d{9,})\.g(\d+)\.partial")
_CHECKSUM_RE = re.compile(r"crc32:[0-9a-f]{8}")
# The manifest's own checksum: CRC-32 over the canonical JSON of every other field.
_MANIFEST_CHECKSUM_KEY = "manifest_checksum"


class CorruptCheckpoint(Exception):
    """A checkpoint (or one of its files) failed verification and must not be trusted.

    The message names the file and the reason: missing, size, checksum, bad manifest.
    """


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint: its plain name inside the directory, size and checksum."""

    name: str
    size: int
    checksum: str


@dataclass
class Manifest:
    """What a committed checkpoint holds; written last, and its presence is the commit.

    ``meta`` must be JSON-serialisable with string keys (the runtime's step metadata).
    """

    step: int
    generation: int
    world_size: int
    files: list[FileRecord]
    meta: dict[str, Any]
    created: float
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        """Serialise, adding a checksum over the other fields so any altered byte is caught."""
        # Round-trip first so the checksum covers exactly what a reader will parse
        # (int keys become strings and would otherwise sort differently).
        body = json.loads(json.dumps(asdict(self), allow_nan=False))
        result = dict(body)
        result[_MANIFEST_CHECKSUM_KEY] = _checksum_bytes(_canonical_json(body).encode())
        return json.dumps(result, indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate a manifest; raises ``ValueError`` saying what is wrong."""
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        # Checked first so a newer writer's manifest reads as unsupported, not corrupt.
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unsupported format_version {raw.get('format_version')!r}")
        stored_checksum = raw.pop(_MANIFEST_CHECKSUM_KEY, None)
        if stored_checksum is None:
            raise ValueError(f"no {_MANIFEST_CHECKSUM_KEY}")
        actual_checksum = _checksum_bytes(_canonical_json(raw).encode())
        if stored_checksum != actual_checksum:
            raise ValueError(
                f"manifest checksum mismatch: stored {stored_checksum}, actual {actual_checksum}"
            )

        expected_keys = {"step", "generation", "world_size", "files", "meta", "created", "format_version"}
        if set(raw) != expected_keys:
            raise ValueError(f"fields {sorted(raw)} != {sorted(expected_keys)}")
        for key, minimum in (("step", 0), ("generation", 0), ("world_size", 1)):
            if not _is_int(raw[key]) or raw[key] < minimum:
                raise ValueError(f"{key} must be an integer >= {minimum}, got {raw[key]!r}")
        if not isinstance(raw["created"], (int, float)) or isinstance(raw["created"], bool):
            raise ValueError(f"created must be a number, got {raw['created']!r}")
        if not isinstance(raw["meta"], dict):
            raise ValueError("meta must be an object")
        if not isinstance(raw["files"], list):
            raise ValueError("files must be a list")

        files: list[FileRecord] = []
        for entry in raw["files"]:
            if not isinstance(entry, dict) or set(entry) != {"name", "size", "checksum"}:
                raise ValueError(f"bad file entry {entry!r}")
            if not isinstance(entry["name"], str) or not _is_int(entry["size"]) or entry["size"] < 0:
                raise ValueError(f"bad file entry {entry!r}")
            if not isinstance(entry["checksum"], str) or not _CHECKSUM_RE.fullmatch(entry["checksum"]):
                raise ValueError(f"bad checksum in file entry {entry!r}")
            _check_file_name(entry["name"])
            files.append(FileRecord(entry["name"], entry["size"], entry["checksum"]))
        _check_unique(files)

        return cls(
            step=raw["step"],
            generation=raw["generation"],
            world_size=raw["world_size"],
            files=files,
            meta=raw["meta"],
            created=float(raw["created"]),
            format_version=raw["format_version"],
        )

    def record(self, name: str) -> FileRecord:
        """The record of ``name``; ``KeyError`` if this checkpoint has no such file."""
        for record in self.files:
            if record.name == name:
                return record
        raise KeyError(f"checkpoint of step {self.step} has no file {name!r}")


@dataclass
class CommittedCheckpoint:
    """A directory whose manifest parsed. Not yet verified: call ``verify`` or use
    ``latest_verified``; ``load_object`` checks each file it reads either way."""

    path: Path
    manifest: Manifest = field(repr=False)

    @property
    def step(self) -> int:
        return self.manifest.step


# ---------------------------------------------------------------------------- names


def checkpoint_dirname(step: int) -> str:
    """Name of the committed directory of ``step``: ``step_`` and at least nine digits."""
    if not _is_int(step) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    return f"step_{step:09d}"


def _staging_dirname(step: int, generation: int) -> str:
    if not _is_int(generation) or generation < 0:
        raise ValueError(f"generation must be an integer >= 0, got {generation!r}")
    return f"{checkpoint_dirname(step)}.g{generation}{PARTIAL_SUFFIX}"


def _committed_step(name: str) -> int | None:
    """The step a committed directory name stands for, or None if it is not one.

    Only the canonical spelling counts, so ``step_0000000007`` is not step 7.
    """
    match = _COMMITTED_RE.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if checkpoint_dirname(step) == name else None


def _check_file_name(name: str) -> None:
    """Files are plain names inside the checkpoint directory: nothing can point outside it."""
    if (
        not name
        or name in (".", "..", MANIFEST_NAME)
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name.endswith(_TMP_SUFFIX)
    ):
        raise ValueError(f"invalid checkpoint file name {name!r}")


def _check_unique(files: list[FileRecord]) -> None:
    names = [record.name for record in files]
    if len(names) != len(set(names)):
        raise ValueError(f"duplicate file names in {names}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------ checksums and JSON


def _checksum_bytes(data: bytes | memoryview) -> str:
    return f"{CHECKSUM_ALGO}:{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def _json_normalized(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` as a reader will see it; raises here, before anything is committed."""
    normalized: dict[str, Any] = json.loads(json.dumps(meta, allow_nan=False))
    return normalized


def _canonical_json(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)


# ------------------------------------------------------- filesystem (fsspec seam)


def _fsync_dir(path: Path) -> None:
    """Make renames and creations inside ``path`` durable (on a file: its contents)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    """Write to ``path.tmp``, fsync, rename over ``path``: readers see all or nothing."""
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _file_checksum(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{CHECKSUM_ALGO}:{crc & 0xFFFFFFFF:08x}"


def _remove_dir(path: Path) -> None:
    """Delete a directory so that a crash midway never leaves a half-deleted checkpoint
    under a committed name: rename it to a ``.replaced`` name first, then delete."""
    aside = path.with_name(path.name + REPLACED_SUFFIX)
    if aside.exists():
        shutil.rmtree(aside)
    os.rename(path, aside)
    shutil.rmtree(aside)


def _member_path(directory: Path, name: str) -> Path:
    """``directory / name`` after checking it cannot resolve outside ``directory``."""
    try:
        _check_file_name(name)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{directory}: {exc}") from exc
    path = directory / name
    if not path.resolve().is_relative_to(directory.resolve()):
        raise CorruptCheckpoint(f"{path}: resolves outside the checkpoint directory")
    return path


def _read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_NAME
    try:
        text = path.read_bytes()
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"{path}: manifest missing") from exc
    except OSError as exc:
        raise CorruptCheckpoint(f"{path}: manifest unreadable ({exc})") from exc
    try:
        manifest = Manifest.from_json(text)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{path}: bad manifest: {exc}") from exc
    expected_name = checkpoint_dirname(manifest.step)
    if directory.name != expected_name:
        raise CorruptCheckpoint(
            f"{path}: bad manifest: step {manifest.step} does not match directory {directory.name}"
        )
    return manifest


def _scan(root: Path) -> Iterator[tuple[Path, CommittedCheckpoint | None, str]]:
    """Every committed-looking directory, newest first: (path, checkpoint or None, reason)."""
    if not root.is_dir():
        return
    candidates: list[tuple[int, Path]] = []
    for entry in root.iterdir():
        step = _committed_step(entry.name)
        if step is not None and entry.is_dir():
            candidates.append((step, entry))
    for _, path in sorted(candidates, reverse=True):
        try:
            yield path, CommittedCheckpoint(path, _read_manifest(path)), ""
        except CorruptCheckpoint as exc:
            yield path, None, str(exc)


# ------------------------------------------------------------------------ writing


def staging_dir(root: PathLike, step: int, generation: int) -> Path:
    """Create (if needed) and return the staging directory of ``step`` in ``generation``.

    Every rank may call this concurrently. Staging directories are never listed as
    checkpoints; a generation's leftovers are removed by ``remove_stale_partials``.
    """
    path = Path(root) / _staging_dirname(step, generation)
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_object(staging: Path, name: str, obj: Any) -> FileRecord:
    """``torch.save`` ``obj`` to ``staging/name`` atomically and durably; return its record.

    The checksum is taken over the exact bytes written, before they reach the disk.
    """
    _check_file_name(name)
    staging = Path(staging)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getbuffer()
    record = FileRecord(name=name, size=data.nbytes, checksum=_checksum_bytes(data))
    _write_atomic(staging / name, data)
    # On a shared filesystem rank 0 cannot make another client's directory entry
    # durable, so each writer syncs its own.
    _fsync_dir(staging)
    return record


def record_file(staging: Path, name: str) -> FileRecord:
    """The record of a file another writer (e.g. torch.distributed.checkpoint) put in ``staging``:
    synced to disk, its size and CRC-32 read back from what the file now holds."""
    path = _member_path(Path(staging), name)
    _fsync_dir(path)
    _fsync_dir(Path(staging))
    return FileRecord(name=name, size=path.stat().st_size, checksum=_file_checksum(path))


def verify_files(ckpt: CommittedCheckpoint, names: list[str]) -> None:
    """``verify`` restricted to ``names`` (which must be listed in the manifest)."""
    for name in names:
        _verify_record(ckpt.path, ckpt.manifest.record(name))


def commit(
    root: PathLike,
    staging: Path,
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
    is raised and nothing is committed. The manifest is written and synced inside the
    staging directory, which is then renamed to ``step_<step>`` in one step. An existing
    checkpoint of the same step (committed again after a restart) is moved aside, replaced
    and deleted. With ``keep``, older checkpoints beyond the ``keep`` newest are pruned.
    """
    root = Path(root)
    staging = Path(staging)
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if staging.name != _staging_dirname(step, generation):
        raise ValueError(f"{staging} is not the staging directory of step {step}, generation {generation}")
    if staging.parent.resolve() != root.resolve():
        raise ValueError(f"{staging} is not inside {root}")
    for record in files:
        _check_file_name(record.name)
    _check_unique(files)

    for record in files:
        path = staging / record.name
        try:
            size = path.stat().st_size
        except FileNotFoundError as exc:
            raise CorruptCheckpoint(f"{path}: missing at commit") from exc
        if size != record.size:
            raise CorruptCheckpoint(f"{path}: size {size} != recorded {record.size} at commit")

    manifest = Manifest(
        step=step,
        generation=generation,
        world_size=world_size,
        files=list(files),
        meta=_json_normalized(meta or {}),
        created=time.time(),
    )
    _write_atomic(staging / MANIFEST_NAME, manifest.to_json().encode())
    _fsync_dir(staging)

    final = root / checkpoint_dirname(step)
    aside: Path | None = None
    if final.exists():
        aside = root / f"{final.name}.g{generation}{REPLACED_SUFFIX}"
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.rename(staging, final)
    _fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside)
    logger.info("committed checkpoint step %d (generation %d) at %s", step, generation, final)

    if keep is not None:
        prune(root, keep)
    return CommittedCheckpoint(final, manifest)


# ------------------------------------------------------------------------ reading


def list_committed(root: PathLike) -> list[CommittedCheckpoint]:
    """Committed checkpoints whose manifest parses, newest (highest step) first.

    Files are not verified here; a directory with a missing or bad manifest is left out.
    """
    return [ckpt for _, ckpt, _ in _scan(Path(root)) if ckpt is not None]


def verify(ckpt: CommittedCheckpoint) -> None:
    """Check every listed file: inside the directory, present, right size, right checksum."""
    for record in ckpt.manifest.files:
        _verify_record(ckpt.path, record)


def _verify_record(directory: Path, record: FileRecord) -> None:
    path = _member_path(directory, record.name)
    try:
        if not path.is_file():
            raise CorruptCheckpoint(f"{path}: missing")
        size = path.stat().st_size
        if size != record.size:
            raise CorruptCheckpoint(f"{path}: size {size} != recorded {record.size}")
        checksum = _file_checksum(path)
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"{path}: missing") from exc
    except OSError as exc:
        raise CorruptCheckpoint(f"{path}: unreadable ({exc})") from exc
    if checksum != record.checksum:
        raise CorruptCheckpoint(f"{path}: checksum {checksum} != recorded {record.checksum}")


def load_object(ckpt: CommittedCheckpoint, name: str, map_location: str | torch.device = "cpu") -> Any:
    """Load one file of ``ckpt``, verifying its size and checksum before unpickling.

    Raises ``CorruptCheckpoint`` if the bytes do not match the manifest and ``KeyError``
    if the manifest lists no such file.
    """
    record = ckpt.manifest.record(name)
    path = _member_path(ckpt.path, name)
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"{path}: missing") from exc
    except OSError as exc:
        raise CorruptCheckpoint(f"{path}: unreadable ({exc})") from exc
    if len(data) != record.size:
        raise CorruptCheckpoint(f"{path}: size {len(data)} != recorded {record.size}")
    checksum = _checksum_bytes(data)
    if checksum != record.checksum:
        raise CorruptCheckpoint(f"{path}: checksum {checksum} != recorded {record.checksum}")
    # weights_only=False is acceptable only because these exact bytes were just matched
    # against the checksum in a manifest this job wrote; the files hold Python objects
    # (RNG states, data positions) that the weights-only unpickler rejects.
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)


def latest_verified(
    root: PathLike, on_corrupt: Callable[[Path, str], None] | None = None, older_than: int | None = None
) -> CommittedCheckpoint | None:
    """The newest checkpoint that passes ``verify`` (with ``older_than``: the newest of a step below
    it), or None if there is none.

    Every skipped directory (bad or missing manifest, or a file that fails verification)
    is reported to ``on_corrupt(path, reason)``, or logged as a warning without one.
    Reads every file of each checkpoint it tries.
    """
    for path, ckpt, reason in _scan(Path(root)):
        if older_than is not None and (_committed_step(path.name) or 0) >= older_than:
            continue
        if ckpt is not None:
            try:
                verify(ckpt)
                return ckpt
            except CorruptCheckpoint as exc:
                reason = str(exc)
        if on_corrupt is not None:
            on_corrupt(path, reason)
        else:
            logger.warning("skipping corrupt checkpoint %s: %s", path, reason)
    return None


# ---------------------------------------------------------------------- cleaning


def prune(root: PathLike, keep: int) -> list[Path]:
    """Delete committed checkpoints beyond the ``keep`` newest; return what was removed.

    Staging (``.partial``) directories are never touched, so a write in progress is safe.
    Directories with a committed name but a bad manifest are left for inspection.
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    removed: list[Path] = []
    for ckpt in list_committed(root)[keep:]:
        _remove_dir(ckpt.path)
        removed.append(ckpt.path)
        logger.info("pruned checkpoint step %d at %s", ckpt.step, ckpt.path)
    return removed


def remove_stale_partials(root: PathLike, current_generation: int) -> list[Path]:
    """Delete staging directories of other generations and ``.replaced`` leftovers.

    Call only while no commit is running (e.g. at job start or after a regroup).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed: list[Path] = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        partial = _PARTIAL_RE.fullmatch(entry.name)
        stale_partial = partial is not None and int(partial.group(2)) != current_generation
        if stale_partial or entry.name.endswith(REPLACED_SUFFIX):
            shutil.rmtree(entry)
            removed.append(entry)
    return removed
