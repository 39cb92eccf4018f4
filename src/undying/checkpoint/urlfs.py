"""Filesystem calls behind an fsspec URL checkpoint root, one small function each.

Runs in the worker processes (the persister thread and the restore), for storage.py
when ``checkpoint.dir`` is a URL (``s3://``, ``gs://``, ``file://``, ...). Nothing here
knows about manifests: it writes, reads, lists and deletes objects. Each write is one
object write (``pipe_file``), so on an object store an object appears whole or not at
all; listings are refreshed on each call (fsspec filesystems cache them).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import partial
from typing import Any

READ_CHUNK = 4 << 20


@dataclass(frozen=True)
class UrlDir:
    """A directory behind an fsspec URL: its filesystem, its path on it, and the URL users see."""

    fs: Any  # fsspec.AbstractFileSystem
    path: str
    url: str

    def child(self, name: str) -> UrlDir:
        return UrlDir(self.fs, join(self.path, name), join(self.url, name))


def join(base: str, name: str) -> str:
    return base + name if base.endswith("/") else f"{base}/{name}"


def open_dir(url: str) -> UrlDir:
    # Imported here: only URL roots need fsspec (a dependency of torch, so always installed).
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    return UrlDir(fs, path, url)


def makedirs(directory: UrlDir) -> None:
    """Needed by filesystems with real directories (``file://``); a no-op on object stores."""
    directory.fs.makedirs(directory.path, exist_ok=True)


def write(directory: UrlDir, name: str, data: bytes | memoryview) -> None:
    """One object write: on an object store the object appears whole or not at all."""
    directory.fs.pipe_file(join(directory.path, name), bytes(data))


def read(directory: UrlDir, name: str) -> bytes:
    data: bytes = directory.fs.cat_file(join(directory.path, name))
    return data


def size(directory: UrlDir, name: str) -> int:
    return int(directory.fs.size(join(directory.path, name)))


def exists(directory: UrlDir, name: str) -> bool:
    return bool(directory.fs.exists(join(directory.path, name)))


def checksum(directory: UrlDir, name: str) -> tuple[int, str]:
    """Size and CRC-32 of what the object holds now, streamed in chunks."""
    crc = size = 0
    with directory.fs.open(join(directory.path, name), "rb") as f:
        while chunk := f.read(READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"crc32:{crc & 0xFFFFFFFF:08x}"


def children(directory: UrlDir) -> list[str]:
    """Names directly under ``directory`` (none if it does not exist), listed afresh."""
    directory.fs.invalidate_cache(directory.path)  # s3fs and others cache listings
    try:
        entries = directory.fs.ls(directory.path, detail=False)
    except FileNotFoundError:
        return []
    return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]


def remove(directory: UrlDir, manifest_name: str) -> None:
    """Delete a checkpoint directory, manifest first: from that first delete on it is no longer
    a checkpoint, and whatever a crash leaves is removed by ``remove_stale_partials``."""
    for delete, path in ((directory.fs.rm_file, join(directory.path, manifest_name)),
                         (partial(directory.fs.rm, recursive=True), directory.path)):
        try:
            delete(path)
        except FileNotFoundError:
            pass  # already gone (an object store drops a prefix with its last object)
