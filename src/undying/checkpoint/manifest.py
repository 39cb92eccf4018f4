"""T2 checkpoint format: the manifest, its file records, CRC-32 checksums and the directory names.

Runs in the worker processes, for the commit protocol (root.py) and its backends. Pure data and
names: nothing here touches a filesystem, so the commit protocol and every backend agree on one spelling of
each name and one checksum.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import IO, Any

from undying.checkpoint.crc import crc32

CHECKSUM_ALGO = "crc32"
MANIFEST_NAME = "MANIFEST.json"
FORMAT_VERSION = 1

PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
TMP_SUFFIX = ".tmp"
_READ_CHUNK = 4 << 20

_COMMITTED_RE = re.compile(r"step_(\d{9,})")
_GENERATION_DIR_RE = re.compile(r"step_(\d{9,})\.g(\d+)")
PARTIAL_RE = re.compile(r"step_(\d{9,})\.g(\d+)\.partial")
_CHECKSUM_RE = re.compile(r"crc32:[0-9a-f]{8}")
# Key in ``meta`` of the numerics the committing rank ran under (runtime/devices.py ``numerics_record``):
# versions, device model, backend, deterministic mode and its variables. A restore under others is an event.
NUMERICS_KEY = "numerics"
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
        result[_MANIFEST_CHECKSUM_KEY] = checksum_bytes(_canonical_json(body).encode())
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
        actual_checksum = checksum_bytes(_canonical_json(raw).encode())
        if stored_checksum != actual_checksum:
            raise ValueError(
                f"manifest checksum mismatch: stored {stored_checksum}, actual {actual_checksum}"
            )

        expected_keys = {"step", "generation", "world_size", "files", "meta", "created", "format_version"}
        if set(raw) != expected_keys:
            raise ValueError(f"fields {sorted(raw)} != {sorted(expected_keys)}")
        for key, minimum in (("step", 0), ("generation", 0), ("world_size", 1)):
            if not is_int(raw[key]) or raw[key] < minimum:
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
            if not isinstance(entry["name"], str) or not is_int(entry["size"]) or entry["size"] < 0:
                raise ValueError(f"bad file entry {entry!r}")
            if not isinstance(entry["checksum"], str) or not _CHECKSUM_RE.fullmatch(entry["checksum"]):
                raise ValueError(f"bad checksum in file entry {entry!r}")
            check_file_name(entry["name"])
            files.append(FileRecord(entry["name"], entry["size"], entry["checksum"]))
        check_unique(files)

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


# ---------------------------------------------------------------------------- names


def checkpoint_dirname(step: int) -> str:
    """Name of the committed directory of ``step``: ``step_`` and at least nine digits."""
    if not is_int(step) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    return f"step_{step:09d}"


def generation_dirname(step: int, generation: int) -> str:
    """Name of the directory ``generation`` writes ``step`` into under a URL root (with
    ``.partial``: its staging directory under a local root)."""
    if not is_int(generation) or generation < 0:
        raise ValueError(f"generation must be an integer >= 0, got {generation!r}")
    return f"{checkpoint_dirname(step)}.g{generation}"


def rank_state_file(rank: int) -> str:
    """Name of the file that holds one rank's own state (RNG, registered objects, its shards) in a
    worker's checkpoint."""
    return f"rank_{rank:05d}.pt"


def staging_dirname(step: int, generation: int) -> str:
    return f"{generation_dirname(step, generation)}{PARTIAL_SUFFIX}"


def committed_step(name: str) -> int | None:
    """The step a committed directory name stands for, or None if it is not one.

    Only the canonical spelling counts, so ``step_0000000007`` is not step 7.
    """
    match = _COMMITTED_RE.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if checkpoint_dirname(step) == name else None


def generation_dir_id(name: str) -> tuple[int, int] | None:
    """(step, generation) of a ``step_<step>.g<generation>`` name, or None; canonical spelling only."""
    match = _GENERATION_DIR_RE.fullmatch(name)
    if match is None:
        return None
    step, generation = int(match.group(1)), int(match.group(2))
    return (step, generation) if generation_dirname(step, generation) == name else None


def check_file_name(name: str) -> None:
    """Files are plain names inside the checkpoint directory: nothing can point outside it."""
    if (
        not name
        or name in (".", "..", MANIFEST_NAME)
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name.endswith(TMP_SUFFIX)
    ):
        raise ValueError(f"invalid checkpoint file name {name!r}")


def check_member_name(directory: object, name: str) -> None:
    """``check_file_name`` for a name read from a manifest: a bad one makes the checkpoint corrupt."""
    try:
        check_file_name(name)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{directory}: {exc}") from exc


def check_unique(files: list[FileRecord]) -> None:
    names = [record.name for record in files]
    if len(names) != len(set(names)):
        raise ValueError(f"duplicate file names in {names}")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------ checksums and JSON


def crc32_checksum(crc: int) -> str:
    """A manifest's spelling of a CRC-32 (``zlib.crc32``'s value, computed by checkpoint/crc.py)."""
    return f"{CHECKSUM_ALGO}:{crc & 0xFFFFFFFF:08x}"


def checksum_bytes(data: bytes | memoryview) -> str:
    return crc32_checksum(crc32(data))


def checksum_stream(stream: IO[bytes]) -> tuple[int, str]:
    """Size and CRC-32 of what ``stream`` holds from here to its end, read in chunks."""
    crc = size = 0
    while chunk := stream.read(_READ_CHUNK):
        crc = crc32(chunk, crc)
        size += len(chunk)
    return size, crc32_checksum(crc)


def json_normalized(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` as a reader will see it; raises here, before anything is committed."""
    normalized: dict[str, Any] = json.loads(json.dumps(meta, allow_nan=False))
    return normalized


def _canonical_json(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
