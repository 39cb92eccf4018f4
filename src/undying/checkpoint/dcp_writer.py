"""The DCP storage writer of T2: plain DCP files, each checksummed on its way out, so nothing is read back.

Runs in the worker: the persister thread (the shared shard, checkpoint/dcp_format.py, and a sharded
job's part, checkpoint/dcp_sharded.py) and the dying-checkpoint writer. DCP's own writer lays out the
files (one per writer thread, each tensor a ``torch.save`` record, the ``.metadata`` pickle), so
plain ``torch.distributed.checkpoint.load`` reads them; this module only puts a filesystem in front of
it whose write streams feed every byte to ``zlib.crc32`` as it passes, which gives the manifest's
size and CRC-32 of each file without a second pass over it. While a thread writes into such a
stream, ``torch.save`` on that thread leaves out its own CRC-32 of each record: the file's checksum
covers those bytes already, and a load verifies it before ``torch.load`` sees them.
"""

from __future__ import annotations

import ctypes
import io
import os
import sys
import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from undying.checkpoint.backend import Location, StorageBackend
from undying.checkpoint.crc import crc32
from undying.checkpoint.manifest import FileRecord, crc32_checksum
from undying.checkpoint.root import CheckpointRoot

# Writer threads (and data files) per rank for a large state: two let one thread serialize and
# checksum while the other waits in the kernel (page-cache throttling, fsync).
WRITE_THREADS = 2
PARALLEL_WRITE_BYTES = 256 << 20  # below this a second file costs more than it saves
WRITEBACK_BYTES = 64 << 20  # how much a file may hold dirty before its writeback is started
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range, do not wait for it
_writing = threading.local()  # .streams: checksummed streams this thread has open for writing


class _ChecksummingStream(io.RawIOBase):
    """A write-only stream that passes every byte to ``raw`` and folds it into a running CRC-32.

    Sequential only: no ``seek``, so the checksum is over the file's bytes in order. With ``kick``,
    the kernel is asked every ``WRITEBACK_BYTES`` to start writing the file's dirty pages to disk.
    """

    def __init__(self, raw: Any, kick: Callable[[int, int, int], None] | None) -> None:
        super().__init__()
        self._raw = raw
        self._kick = kick
        self._kicked = 0  # bytes already handed to the kernel's writeback
        self.size = 0
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        if written is not None and written != view.nbytes:
            # A buffered file writes all or raises; anything else would leave the CRC wrong.
            raise OSError(f"short write: {written} of {view.nbytes} bytes")
        self.crc = crc32(view, self.crc)  # releases the GIL, as the write did
        self.size += view.nbytes
        if self._kick is not None and self.size - self._kicked >= WRITEBACK_BYTES:
            self._kick(self._raw.fileno(), self._kicked, self.size - self._kicked)
            self._kicked = self.size
        return view.nbytes

    def tell(self) -> int:
        return int(self._raw.tell())

    def fileno(self) -> int:
        return int(self._raw.fileno())  # DCP fsyncs through it; AttributeError where there is none

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()  # flushes first
        finally:
            self._raw.close()


class ChecksummingFileSystem:
    """Wraps a DCP ``FileSystem`` (local or fsspec): every file opened for writing is checksummed as it
    is written, and its size and CRC-32 are kept under its name (and moved along when DCP renames it).

    Guarantees: a file's record exists only once its stream closed without an error, and covers every
    byte written through it; a write that failed is remembered, and ``records_of`` refuses to give
    records after one (DCP's extra writer threads die without telling the caller). Not guaranteed:
    that the storage kept the bytes; ``record_written`` compares the size, and a load verifies the
    checksum before it trusts them.
    """

    def __init__(self, inner: Any, writeback: bool = False) -> None:
        self._inner = inner
        self._kick = _writeback_starter() if writeback else None
        self._lock = threading.Lock()
        self._written: dict[str, tuple[int, int]] = {}  # file name -> (size, crc32)
        self.failed: list[str] = []  # "name: error" of each file whose writing raised

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        if mode == "rb":
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        if mode != "wb":  # appending or updating would start the checksum mid-file
            raise ValueError(f"checksummed DCP stream mode must be 'rb' or 'wb', got {mode!r}")
        _writing.streams = getattr(_writing, "streams", 0) + 1
        try:
            with self._inner.create_stream(path, mode) as raw:
                stream = _ChecksummingStream(raw, self._kick)
                yield stream
        except BaseException as error:
            with self._lock:
                self.failed.append(f"{_name(path)}: {error!r}")
            raise
        finally:
            _writing.streams -= 1
        with self._lock:
            self._written[_name(path)] = (stream.size, stream.crc)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self._inner.rename(path, new_path)
        with self._lock:
            written = self._written.pop(_name(path), None)
            if written is not None:
                self._written[_name(new_path)] = written

    def written(self, name: str) -> tuple[int, str] | None:
        """Size and checksum of the file ``name`` written through this filesystem, or None."""
        with self._lock:
            entry = self._written.get(name)
        return None if entry is None else (entry[0], crc32_checksum(entry[1]))


def write_threads(tensors: list[Any]) -> int:
    """Writer threads for a state holding ``tensors``: ``WRITE_THREADS`` from ``PARALLEL_WRITE_BYTES`` on."""
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    return WRITE_THREADS if nbytes >= PARALLEL_WRITE_BYTES else 1


def checksummed_writer(staging: Location, backend: StorageBackend, thread_count: int = 1,
                       writeback: bool = True) -> tuple[Any, ChecksummingFileSystem]:
    """``backend``'s DCP storage writer into ``staging`` (StorageBackend.dcp_writer: a
    ``FileSystemWriter`` under a local root, an ``FsspecWriter`` under a URL root) whose files are
    checksummed as they are written, and the filesystem that holds their records. ``writeback``:
    start the kernel's writeback as the files grow, where the backend's files allow it."""
    if thread_count < 1:
        raise ValueError(f"thread_count must be >= 1, got {thread_count}")
    writer = backend.dcp_writer(staging, thread_count)
    files = ChecksummingFileSystem(writer.fs, writeback and backend.kernel_writeback)
    _leave_out_record_crcs_in_checksummed_streams()
    # Duck-typed: a FileSystemBase subclass would import DCP with this module, at every worker's start.
    writer.fs = files
    return writer, files


def check_complete(staging: Location, metadata: Any) -> None:
    """``OSError`` unless every item of DCP's ``metadata`` (after ``finish``) has a place in a written
    file: DCP's extra writer threads end on an error without raising it, dropping their items."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    planned = sum(len(item.chunks) if isinstance(item, TensorStorageMetadata) else 1
                  for item in metadata.state_dict_metadata.values())
    if len(metadata.storage_data) != planned:
        raise OSError(f"{staging}: DCP wrote {len(metadata.storage_data)} of {planned} items")


def records_of(root: CheckpointRoot, staging: Location, files: ChecksummingFileSystem,
               names: list[str]) -> list[FileRecord]:
    """The manifest records of ``names`` in ``staging``: from the checksums taken while writing, made
    durable (local) and their sizes checked; a file written some other way is read back instead.
    ``OSError`` if any file's writing failed (DCP's extra writer threads do not raise it)."""
    if files.failed:
        raise OSError(f"{staging}: writing failed: {'; '.join(files.failed)}")
    records = []
    for name in names:
        written = files.written(name)
        records.append(root.record_file(staging, name) if written is None
                       else root.record_written(staging, name, *written))
    return records


def _leave_out_record_crcs_in_checksummed_streams() -> None:
    """Make ``torch.save`` skip its per-record CRC-32 on a thread that is writing a checksummed stream.

    ``torch.save`` checksums every record it writes (in software, about 0.3 s of CPU per GB); DCP
    calls it once per tensor. ``torch.serialization.set_crc32_options`` would switch
    that off for the whole process, the training script's own saves included, so instead the getter
    it reads when it opens an archive is wrapped: it answers False on a thread with a checksummed
    stream open, and asks the original everywhere else. ``torch.load`` reads records either way.
    Where torch has no such getter, nothing changes (each record keeps its CRC).
    """
    from undying._torch_compat.tensors import skip_record_crcs_when

    skip_record_crcs_when(_writing_checksummed_stream)


def _writing_checksummed_stream() -> bool:
    return bool(getattr(_writing, "streams", 0))


def _name(path: str | os.PathLike[str]) -> str:
    return os.path.basename(os.fspath(path).rstrip("/"))


def _writeback_starter() -> Callable[[int, int, int], None] | None:
    """``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)`` where the C library has it (Linux):
    the disk writes what is already in the page cache while the rest is produced, so the final
    ``fsync`` waits for the tail only. A hint: a failing call changes nothing but speed."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    sync_file_range.restype = ctypes.c_int

    def start(fd: int, offset: int, nbytes: int) -> None:
        sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)

    return start
