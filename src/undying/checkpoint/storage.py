"""T2 checkpoint storage: per-rank files committed by one checksummed manifest.

Runs in the worker processes: every rank writes its own files into the checkpoint's
directory, rank 0 commits them, and at restart every rank finds and loads the newest
checkpoint that verifies. ``root`` is a local (or shared-filesystem) path, or any fsspec
URL (``s3://``, ``gs://``, ``file://``, ``memory://``, ...); every filesystem call sits in
a small private helper, one set for each.

A local path (``Path``, or a string without ``://``)::

    step_000000120/                 committed: MANIFEST.json + the files it lists
    step_000000130.g3.partial/      staging of step 130 by generation 3 (not a checkpoint)
    step_000000120.g4.replaced/     an old directory on its way out (not a checkpoint)

A URL (object stores have no atomic rename, so nothing is renamed)::

    step_000000120.g3/              written in place by generation 3; a checkpoint once its
                                    MANIFEST.json exists and parses (the last object written)

Guarantees:

* Local: a directory is a checkpoint only once its name is ``step_<step>`` and it holds a
  parseable manifest. Both come from one ``rename`` of a fully written, fsynced staging
  directory, so a crash at any point leaves either the old state or the new one.
* URL: a directory is a checkpoint only once its manifest, written in one object write
  after every file it lists, exists and its checksum matches; a writer killed earlier
  leaves files without a manifest, which are never listed and are removed by
  ``remove_stale_partials``. Each generation writes its own directory, so a late writer of
  an old generation never touches a newer generation's files. Deletions remove the
  manifest first, so a half-deleted checkpoint is no longer one.
* Nothing is handed to ``torch.load`` before its size and CRC-32 match the manifest, and
  the manifest carries a checksum of its own, so a flipped byte anywhere is detected.

Not guaranteed: CRC-32 detects accidental corruption (bit rot, truncation, torn writes),
not deliberate tampering; on a shared filesystem, durability is only as good as the
filesystem's ``fsync``; behind a URL it is the store's (a ``file://`` URL is not fsynced),
and a store whose listings lag its writes may not show the newest checkpoint yet.
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
from functools import partial
from pathlib import Path
from typing import Any, TypeAlias, TypeGuard

import torch

from undying.checkpoint import urlfs

logger = logging.getLogger(__name__)

PathLike: TypeAlias = str | os.PathLike[str]
# A checkpoint root or directory: a local ``Path``, or an fsspec URL (a ``str`` with ``://``).
Location: TypeAlias = Path | str

CHECKSUM_ALGO = "crc32"
MANIFEST_NAME = "MANIFEST.json"
FORMAT_VERSION = 1

PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
_TMP_SUFFIX = ".tmp"
_READ_CHUNK = 4 << 20

_COMMITTED_RE = re.compile(r"step_(\d{9,})")
_PARTIAL_RE = re.compile(r"step_(\d{9,})\.g(\d+)\.partial")
_URL_DIR_RE = re.compile(r"step_(\d{9,})\.g(\d+)")  # a URL root's checkpoint directory
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

    path: Location  # a Path under a local root, the directory's URL under a URL root
    manifest: Manifest = field(repr=False)

    @property
    def step(self) -> int:
        return self.manifest.step


# ---------------------------------------------------------------------------- names


def is_url(location: object) -> TypeGuard[str]:
    """Whether ``location`` is an fsspec URL (a string with ``://``, ``file://`` included) rather
    than a local path. A ``Path`` is always local (``Path("s3://b")`` has lost a slash already)."""
    return isinstance(location, str) and "://" in location


def root_location(directory: str) -> Location:
    """``checkpoint.dir`` as this module takes it: a URL as given, anything else as a local ``Path``."""
    return directory if is_url(directory) else Path(directory)


def checkpoint_dirname(step: int) -> str:
    """Name of the committed directory of ``step``: ``step_`` and at least nine digits."""
    if not _is_int(step) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    return f"step_{step:09d}"


def _staging_dirname(step: int, generation: int) -> str:
    return f"{_generation_dirname(step, generation)}{PARTIAL_SUFFIX}"


def _generation_dirname(step: int, generation: int) -> str:
    """Name of the directory ``generation`` writes ``step`` into under a URL root (with
    ``.partial``: its staging directory under a local root)."""
    if not _is_int(generation) or generation < 0:
        raise ValueError(f"generation must be an integer >= 0, got {generation!r}")
    return f"{checkpoint_dirname(step)}.g{generation}"


def _committed_step(name: str) -> int | None:
    """The step a committed directory name stands for, or None if it is not one.

    Only the canonical spelling counts, so ``step_0000000007`` is not step 7.
    """
    match = _COMMITTED_RE.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if checkpoint_dirname(step) == name else None


def _url_dir_id(name: str) -> tuple[int, int] | None:
    """(step, generation) of a directory name under a URL root, or None; canonical spelling only."""
    match = _URL_DIR_RE.fullmatch(name)
    if match is None:
        return None
    step, generation = int(match.group(1)), int(match.group(2))
    return (step, generation) if _generation_dirname(step, generation) == name else None


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


def _check_member_name(directory: Location, name: str) -> None:
    """``_check_file_name`` for a name read from a manifest: a bad one makes the checkpoint corrupt."""
    try:
        _check_file_name(name)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{directory}: {exc}") from exc


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


def _new_manifest(step: int, generation: int, world_size: int, files: list[FileRecord],
                  meta: dict[str, Any] | None) -> Manifest:
    return Manifest(step=step, generation=generation, world_size=world_size, files=list(files),
                    meta=_json_normalized(meta or {}), created=time.time())


# ------------------------------------------------------------ filesystem: local paths


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
    _check_member_name(directory, name)
    path = directory / name
    if not path.resolve().is_relative_to(directory.resolve()):
        raise CorruptCheckpoint(f"{path}: resolves outside the checkpoint directory")
    return path


def _parse_manifest(text: bytes, where: Location) -> Manifest:
    try:
        return Manifest.from_json(text)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{where}: bad manifest: {exc}") from exc


def _read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_NAME
    try:
        text = path.read_bytes()
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"{path}: manifest missing") from exc
    except OSError as exc:
        raise CorruptCheckpoint(f"{path}: manifest unreadable ({exc})") from exc
    manifest = _parse_manifest(text, path)
    expected_name = checkpoint_dirname(manifest.step)
    if directory.name != expected_name:
        raise CorruptCheckpoint(
            f"{path}: bad manifest: step {manifest.step} does not match directory {directory.name}"
        )
    return manifest


def _scan_local(root: Path) -> Iterator[tuple[Location, int, CommittedCheckpoint | None, str]]:
    if not root.is_dir():
        return
    candidates: list[tuple[int, Path]] = []
    for entry in root.iterdir():
        step = _committed_step(entry.name)
        if step is not None and entry.is_dir():
            candidates.append((step, entry))
    for step, path in sorted(candidates, reverse=True):
        try:
            yield path, step, CommittedCheckpoint(path, _read_manifest(path)), ""
        except CorruptCheckpoint as exc:
            yield path, step, None, str(exc)


# ------------------------------------------------------------ filesystem: URLs (fsspec)


def _read_url_manifest(directory: urlfs.UrlDir, step: int, generation: int) -> Manifest:
    """The manifest of ``step_<step>.g<generation>``; ``FileNotFoundError`` if it has none (not committed)."""
    where = urlfs.join(directory.url, MANIFEST_NAME)
    try:
        text = urlfs.read(directory, MANIFEST_NAME)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CorruptCheckpoint(f"{where}: manifest unreadable ({exc})") from exc
    manifest = _parse_manifest(text, where)
    if (manifest.step, manifest.generation) != (step, generation):
        raise CorruptCheckpoint(f"{where}: bad manifest: step {manifest.step}, generation "
                                f"{manifest.generation} do not match directory {_generation_dirname(step, generation)}")
    return manifest


def _scan_url(root: urlfs.UrlDir) -> Iterator[tuple[Location, int, CommittedCheckpoint | None, str]]:
    generations: dict[int, list[int]] = {}
    for name in urlfs.children(root):
        ident = _url_dir_id(name)
        if ident is not None:
            generations.setdefault(ident[0], []).append(ident[1])
    for step in sorted(generations, reverse=True):
        for generation in sorted(generations[step], reverse=True):
            directory = root.child(_generation_dirname(step, generation))
            try:
                manifest = _read_url_manifest(directory, step, generation)
            except FileNotFoundError:
                continue  # being written, or abandoned mid-write: not a checkpoint
            except CorruptCheckpoint as exc:
                yield directory.url, step, None, str(exc)
            else:
                yield directory.url, step, CommittedCheckpoint(directory.url, manifest), ""
            break  # a step's checkpoint is its newest generation with a manifest


def _remove_stale_url(root: urlfs.UrlDir, current_generation: int) -> list[Location]:
    idents = sorted((ident for name in urlfs.children(root) if (ident := _url_dir_id(name))), reverse=True)
    committed_steps: set[int] = set()
    stale: list[urlfs.UrlDir] = []
    for step, generation in idents:  # each step's newest generation first
        directory = root.child(_generation_dirname(step, generation))
        if urlfs.exists(directory, MANIFEST_NAME):
            if step in committed_steps:
                stale.append(directory)  # replaced by a newer generation's commit of the same step
            committed_steps.add(step)
        elif generation != current_generation:
            stale.append(directory)  # a writer killed mid-write, or a deletion cut short
    for directory in stale:
        urlfs.remove(directory, MANIFEST_NAME)
    return sorted(directory.url for directory in stale)


# ---------------------------------------------------------- filesystem: either kind


def _scan(root: PathLike) -> Iterator[tuple[Location, int, CommittedCheckpoint | None, str]]:
    """Every committed-looking directory, newest first: (location, step, checkpoint or None, reason).

    Under a URL root a directory without a manifest is still being written (or was
    abandoned) and is not yielded at all."""
    if is_url(root):
        return _scan_url(urlfs.open_dir(root))
    return _scan_local(Path(root))


def _member_size(directory: Location, name: str) -> int:
    """The size of the member ``name``; ``FileNotFoundError`` if it is missing."""
    if is_url(directory):
        return urlfs.size(urlfs.open_dir(directory), name)
    path = Path(directory) / name
    if not path.is_file():
        raise FileNotFoundError(path)
    return path.stat().st_size


def _member_checksum(directory: Location, name: str) -> str:
    if is_url(directory):
        return urlfs.checksum(urlfs.open_dir(directory), name)[1]
    return _file_checksum(Path(directory) / name)


def _member_bytes(directory: Location, name: str) -> tuple[str, bytes]:
    """Where the member ``name`` is and its bytes; ``CorruptCheckpoint`` if it cannot be read."""
    if is_url(directory):
        _check_member_name(directory, name)
        where, read = urlfs.join(directory, name), partial(urlfs.read, urlfs.open_dir(directory), name)
    else:
        path = _member_path(Path(directory), name)
        where, read = str(path), path.read_bytes
    try:
        return where, read()
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"{where}: missing") from exc
    except OSError as exc:
        raise CorruptCheckpoint(f"{where}: unreadable ({exc})") from exc


def _remove_checkpoint(location: Location) -> None:
    if is_url(location):
        urlfs.remove(urlfs.open_dir(location), MANIFEST_NAME)
    else:
        _remove_dir(Path(location))


# ------------------------------------------------------------------------ writing


def make_root(root: PathLike) -> None:
    """Create the checkpoint root if it does not exist yet (on an object store: nothing to do)."""
    if is_url(root):
        urlfs.makedirs(urlfs.open_dir(root))
    else:
        Path(root).mkdir(parents=True, exist_ok=True)


def staging_dir(root: PathLike, step: int, generation: int) -> Location:
    """Create (if needed) and return the directory where ``generation`` writes ``step``.

    Under a local root: the staging directory ``step_<step>.g<generation>.partial`` that the
    commit renames. Under a URL root: the final directory ``step_<step>.g<generation>`` (its
    URL), which the commit's manifest turns into a checkpoint in place.

    Every rank may call this concurrently. Staging directories are never listed as
    checkpoints; a generation's leftovers are removed by ``remove_stale_partials``.
    """
    if is_url(root):
        directory = urlfs.open_dir(root).child(_generation_dirname(step, generation))
        urlfs.makedirs(directory)
        return directory.url
    path = Path(root) / _staging_dirname(step, generation)
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_object(staging: Location, name: str, obj: Any) -> FileRecord:
    """``torch.save`` ``obj`` to ``staging/name`` atomically (local: fsynced; URL: one object
    write) and return its record.

    The checksum is taken over the exact bytes written, before they reach the storage.
    """
    _check_file_name(name)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getbuffer()
    record = FileRecord(name=name, size=data.nbytes, checksum=_checksum_bytes(data))
    if is_url(staging):
        urlfs.write(urlfs.open_dir(staging), name, data)
        return record
    staging = Path(staging)
    _write_atomic(staging / name, data)
    # On a shared filesystem rank 0 cannot make another client's directory entry
    # durable, so each writer syncs its own.
    _fsync_dir(staging)
    return record


def record_file(staging: Location, name: str) -> FileRecord:
    """The record of a file another writer (e.g. torch.distributed.checkpoint) put in ``staging``:
    synced to disk (local), its size and CRC-32 read back from what the file now holds."""
    if is_url(staging):
        _check_member_name(staging, name)
        size, checksum = urlfs.checksum(urlfs.open_dir(staging), name)
        return FileRecord(name=name, size=size, checksum=checksum)
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
    is raised and nothing is committed. Local root: the manifest is written and synced
    inside the staging directory, which is then renamed to ``step_<step>`` in one step; an
    existing checkpoint of the same step (committed again after a restart) is moved aside,
    replaced and deleted. URL root: the manifest is written into ``staging`` as one object,
    the last one; then older generations' directories of the same step are deleted. With
    ``keep``, older checkpoints beyond the ``keep`` newest are pruned, after the commit.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for record in files:
        _check_file_name(record.name)
    _check_unique(files)
    if is_url(root) or is_url(staging):
        committed = _commit_url(root, staging, step=step, generation=generation, world_size=world_size,
                                files=files, meta=meta)
    else:
        committed = _commit_local(Path(root), Path(staging), step=step, generation=generation,
                                  world_size=world_size, files=files, meta=meta)
    if keep is not None:
        prune(root, keep)
    return committed


def _commit_local(root: Path, staging: Path, *, step: int, generation: int, world_size: int,
                  files: list[FileRecord], meta: dict[str, Any] | None) -> CommittedCheckpoint:
    if staging.name != _staging_dirname(step, generation):
        raise ValueError(f"{staging} is not the staging directory of step {step}, generation {generation}")
    if staging.parent.resolve() != root.resolve():
        raise ValueError(f"{staging} is not inside {root}")
    for record in files:
        path = staging / record.name
        try:
            size = path.stat().st_size
        except FileNotFoundError as exc:
            raise CorruptCheckpoint(f"{path}: missing at commit") from exc
        if size != record.size:
            raise CorruptCheckpoint(f"{path}: size {size} != recorded {record.size} at commit")

    manifest = _new_manifest(step, generation, world_size, files, meta)
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
    return CommittedCheckpoint(final, manifest)


def _commit_url(root: PathLike, staging: Location, *, step: int, generation: int, world_size: int,
                files: list[FileRecord], meta: dict[str, Any] | None) -> CommittedCheckpoint:
    if not (is_url(root) and is_url(staging)):
        raise ValueError(f"{staging} is not inside {root}")
    root_dir = urlfs.open_dir(root)
    directory = root_dir.child(_generation_dirname(step, generation))
    if staging.rstrip("/") != directory.url:
        raise ValueError(f"{staging} is not the directory of step {step}, generation {generation} in {root}")
    for record in files:
        where = urlfs.join(directory.url, record.name)
        try:
            size = urlfs.size(directory, record.name)
        except FileNotFoundError as exc:
            raise CorruptCheckpoint(f"{where}: missing at commit") from exc
        if size != record.size:
            raise CorruptCheckpoint(f"{where}: size {size} != recorded {record.size} at commit")

    manifest = _new_manifest(step, generation, world_size, files, meta)
    urlfs.write(directory, MANIFEST_NAME, manifest.to_json().encode())  # the commit
    for name in urlfs.children(root_dir):
        ident = _url_dir_id(name)
        if ident is not None and ident[0] == step and ident[1] < generation:
            urlfs.remove(root_dir.child(name), MANIFEST_NAME)  # the same step committed (or begun) by an older generation
    logger.info("committed checkpoint step %d (generation %d) at %s", step, generation, directory.url)
    return CommittedCheckpoint(directory.url, manifest)


# ------------------------------------------------------------------------ reading


def list_committed(root: PathLike) -> list[CommittedCheckpoint]:
    """Committed checkpoints whose manifest parses, newest (highest step) first.

    Files are not verified here; a directory with a missing or bad manifest is left out.
    """
    return [ckpt for _, _, ckpt, _ in _scan(root) if ckpt is not None]


def verify(ckpt: CommittedCheckpoint) -> None:
    """Check every listed file: inside the directory, present, right size, right checksum."""
    for record in ckpt.manifest.files:
        _verify_record(ckpt.path, record)


def _verify_record(directory: Location, record: FileRecord) -> None:
    if is_url(directory):
        _check_member_name(directory, record.name)
    else:
        _member_path(Path(directory), record.name)
    where = urlfs.join(str(directory), record.name)
    try:
        size = _member_size(directory, record.name)
        if size != record.size:
            raise CorruptCheckpoint(f"{where}: size {size} != recorded {record.size}")
        checksum = _member_checksum(directory, record.name)
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"{where}: missing") from exc
    except OSError as exc:
        raise CorruptCheckpoint(f"{where}: unreadable ({exc})") from exc
    if checksum != record.checksum:
        raise CorruptCheckpoint(f"{where}: checksum {checksum} != recorded {record.checksum}")


def load_object(ckpt: CommittedCheckpoint, name: str, map_location: str | torch.device = "cpu") -> Any:
    """Load one file of ``ckpt``, verifying its size and checksum before unpickling.

    Raises ``CorruptCheckpoint`` if the bytes do not match the manifest and ``KeyError``
    if the manifest lists no such file.
    """
    record = ckpt.manifest.record(name)
    where, data = _member_bytes(ckpt.path, name)
    if len(data) != record.size:
        raise CorruptCheckpoint(f"{where}: size {len(data)} != recorded {record.size}")
    checksum = _checksum_bytes(data)
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


# ---------------------------------------------------------------------- cleaning


def prune(root: PathLike, keep: int) -> list[Location]:
    """Delete committed checkpoints beyond the ``keep`` newest; return what was removed.

    Staging (``.partial``, or under a URL root manifest-less) directories are never touched, so
    a write in progress is safe. Directories with a committed name but a bad manifest are left
    for inspection. Under a URL root each manifest is deleted before its files.
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    removed: list[Location] = []
    for ckpt in list_committed(root)[keep:]:
        _remove_checkpoint(ckpt.path)
        removed.append(ckpt.path)
        logger.info("pruned checkpoint step %d at %s", ckpt.step, ckpt.path)
    return removed


def remove_stale_partials(root: PathLike, current_generation: int) -> list[Location]:
    """Delete staging directories of other generations and ``.replaced`` leftovers (under a URL
    root: manifest-less directories of other generations, and committed ones replaced by a
    newer generation's commit of the same step).

    Call only while no commit is running (e.g. at job start or after a regroup).
    """
    if is_url(root):
        return _remove_stale_url(urlfs.open_dir(root), current_generation)
    root = Path(root)
    if not root.is_dir():
        return []
    removed: list[Location] = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        partial_match = _PARTIAL_RE.fullmatch(entry.name)
        stale_partial = partial_match is not None and int(partial_match.group(2)) != current_generation
        if stale_partial or entry.name.endswith(REPLACED_SUFFIX):
            shutil.rmtree(entry)
            removed.append(entry)
    return removed
