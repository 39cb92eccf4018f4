"""One T1 snapshot slot: a file in node shared memory (or anonymous memory), its header and commit word.

Runs in the worker, for snapshot.py (RankSnapshots), which chooses the slot each snapshot goes to.
The slot files live in the node's shared-memory directory (undying/shm.py): they outlive the
worker's SIGKILL, and the node's agent removes them when the job ends.

File of one slot (``rank<R>.slot<K>``)::

    [0, 4096)        header: magic, format, sequence number, step, generation, world size,
                     data/meta extents, CRC-32 of the meta block, of the data region and of the
                     header fields; a separate ``state`` word: EMPTY, WRITING or COMMITTED
    [4096, ...)      tensor data, each tensor 64-byte aligned, in the order of flatten_state
    [meta_offset...) meta block: pickle of the state's skeleton (everything but tensors) and
                     the tensor layout (offset, dtype, shape)
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from undying._torch_compat.tensors import pin_host_range, unpin_host_range
from undying.checkpoint.crc import crc32

MAGIC = b"UNDYSNAP"
FORMAT_VERSION = 2  # 2: the data region's CRC-32 in the header
HEADER_BYTES = 4096
ALIGN = 64
META_SLACK = 1 << 20  # room for the meta block to grow (loader positions, user state) without a remap

STATE_EMPTY = 0
STATE_WRITING = 1
STATE_COMMITTED = 2

# magic, format, seq, step, generation, world_size, data_bytes, meta_offset, meta_bytes, meta_crc, data_crc
_HEADER = struct.Struct("<8sIQqqqQQQII")
_STATE_OFFSET = 128  # the commit word, apart from the fields it vouches for
_HEADER_CRC_OFFSET = 132
_WORD = struct.Struct("<I")


class SnapshotUnavailable(RuntimeError):
    """Node shared memory could not hold the snapshot (e.g. /dev/shm is full)."""


class CorruptSnapshot(KeyError):
    """A committed slot whose data no longer matches its CRC-32 (memory corrupted since it was
    written): it holds no snapshot. A KeyError, as for a step the slot does not hold: every reader
    then takes the next source (another T1 step, a live replica, T2)."""


@dataclass(frozen=True)
class SnapshotInfo:
    """A complete snapshot in one slot: the step it holds and where it was taken."""

    slot: int
    seq: int
    step: int
    generation: int
    world_size: int
    nbytes: int


def tensor_layout(tensors: Sequence[torch.Tensor]) -> tuple[list[tuple[int, torch.dtype, tuple[int, ...]]], int]:
    """Where each tensor goes in a slot's data region (64-byte aligned) and the region's size."""
    layout, offset = [], 0
    for tensor in tensors:
        layout.append((offset, tensor.dtype, tuple(tensor.shape)))
        offset = _align(offset + tensor.numel() * tensor.element_size())
    return layout, offset


def _align(value: int) -> int:
    return (value + ALIGN - 1) // ALIGN * ALIGN


class Slot:
    """One slot file (or, without a directory, anonymous memory) and the views laid over it.

    The writer marks the slot WRITING, copies into ``lay_out``'s views, then
    ``write_meta_and_commit`` writes the meta block and header and, last, the COMMITTED word; a
    slot opened from its file holds a snapshot (``info``) only if that word and both CRC-32s
    check. Which slot a snapshot goes to, and who may read it, is RankSnapshots' (snapshot.py).
    """

    def __init__(self, path: Path | None, index: int, populate: bool = True) -> None:
        self.path = path
        self.index = index
        self._populate = _POPULATE if populate else 0  # map every page at once (a writer), or on first touch
        self.size = 0
        self._mm: mmap.mmap | None = None
        self.layout: list[tuple[int, torch.dtype, tuple[int, ...]]] | None = None
        self.views: list[torch.Tensor] = []
        self.info: SnapshotInfo | None = None  # set while the slot holds a complete snapshot
        self._page_locked: int | None = None  # the address registered with CUDA (page-locked), if any
        size = path.stat().st_size if path is not None and path.exists() else 0
        if size >= HEADER_BYTES:
            try:
                self._map(size)
            except SnapshotUnavailable:
                return  # cannot be mapped: it holds nothing a reader may take (a writer grows it anew)
            self.info = self._read_info()
        # Smaller (an allocation that failed on a full node memory left it empty): it holds nothing.

    # -- memory

    def reserve(self, size: int) -> None:
        """Make the slot at least ``size`` bytes, every page allocated and mapped now, not during a copy."""
        if size <= self.size:
            return
        self._unlock_pages()
        self.views, self.layout, self._mm = [], None, None
        self._map(size)

    def _map(self, size: int) -> None:
        if self.path is None:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | self._populate)
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                # Allocated up front: a write into a hole of a full tmpfs is a SIGBUS, this is an error.
                os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | self._populate)
            except OSError as error:
                raise SnapshotUnavailable(f"{self.path}: cannot hold {size} bytes ({error})") from error
            finally:
                os.close(fd)
        self._mm = mm
        self.size = size

    def lock_pages(self) -> None:
        """Page-lock the mapping for CUDA (as torch.distributed.checkpoint's stager does with its
        shared memory), so that device-to-host copies into it run at full speed and asynchronously;
        once per mapping. Raises RuntimeError if CUDA refuses."""
        if self._page_locked is not None or self._mm is None:
            return
        address = torch.frombuffer(self._mm, dtype=torch.uint8, count=1).data_ptr()
        pin_host_range(address, self.size)
        self._page_locked = address

    def _unlock_pages(self) -> None:
        address, self._page_locked = self._page_locked, None
        if address is not None:
            unpin_host_range(address)

    def lay_out(self, layout: list[tuple[int, torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
        """Views of the data region laid out as ``layout``; built once per layout, then reused."""
        if self.layout != layout:
            assert self._mm is not None
            views = []
            for offset, dtype, shape in layout:
                numel = _numel(shape)
                # Each view owns a storage of exactly its bytes (not a slice of one big storage), so that
                # torch.save and DCP write the tensor, not the slot, and DCP needs no copy of it first.
                views.append(torch.frombuffer(self._mm, dtype=dtype, count=numel, offset=HEADER_BYTES + offset)
                             .view(shape) if numel else torch.empty(shape, dtype=dtype))
            self.views, self.layout = views, layout
        return self.views

    def close(self) -> None:
        self._unlock_pages()
        self.views, self.layout = [], None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a caller still holds a view: the mapping goes when that view does

    # -- header

    def begin_write(self, data_bytes: int, meta_bytes: int) -> None:
        """Mark the slot WRITING (its snapshot, if any, is gone from now on) and make it hold ``data_bytes``
        of data and a meta block of ``meta_bytes``, with META_SLACK to spare for the meta block to grow."""
        if self.size:
            self.set_state(STATE_WRITING)
        needed = HEADER_BYTES + data_bytes + meta_bytes
        if needed > self.size:
            self.reserve(needed + max(META_SLACK, meta_bytes))
            self.set_state(STATE_WRITING)

    def set_state(self, state: int) -> None:
        assert self._mm is not None
        _WORD.pack_into(self._mm, _STATE_OFFSET, state)

    def write_meta_and_commit(self, meta: bytes, data_bytes: int, seq: int, step: int, generation: int,
                              world_size: int) -> None:
        assert self._mm is not None
        meta_offset = HEADER_BYTES + data_bytes
        self._mm[meta_offset:meta_offset + len(meta)] = meta
        # On the committing thread: the copy's helper thread when the copy overlaps training (GPU state by
        # default), else the training thread, where it adds a pass over the data to the snapshot's stall.
        fields = _HEADER.pack(MAGIC, FORMAT_VERSION, seq, step, generation, world_size, data_bytes,
                              meta_offset, len(meta), crc32(meta), self._data_crc(data_bytes))
        self._mm[:_HEADER.size] = fields
        _WORD.pack_into(self._mm, _HEADER_CRC_OFFSET, crc32(fields))
        # Written last: until this word says COMMITTED, no reader takes the slot (a torn copy stays invisible).
        self.set_state(STATE_COMMITTED)
        self.info = SnapshotInfo(self.index, seq, step, generation, world_size, data_bytes)

    def _read_info(self) -> SnapshotInfo | None:
        """The slot's snapshot if it is complete and intact, else None."""
        mm = self._mm
        if mm is None or self.size < HEADER_BYTES:
            return None
        if _WORD.unpack_from(mm, _STATE_OFFSET)[0] != STATE_COMMITTED:
            return None
        fields = bytes(mm[:_HEADER.size])
        if crc32(fields) != _WORD.unpack_from(mm, _HEADER_CRC_OFFSET)[0]:
            return None
        magic, version, seq, step, generation, world_size, data_bytes, meta_offset, meta_bytes, meta_crc, data_crc \
            = _HEADER.unpack(fields)
        if magic != MAGIC or version != FORMAT_VERSION or meta_offset + meta_bytes > self.size \
                or HEADER_BYTES + data_bytes > meta_offset:
            return None
        if crc32(mm[meta_offset:meta_offset + meta_bytes]) != meta_crc:
            return None
        # Opened from its file (another process: a restart, a replacement, a node's other rank): the data
        # is checked here, once, before anyone is told the slot holds a snapshot.
        if self._data_crc(data_bytes) != data_crc:
            return None
        return SnapshotInfo(self.index, seq, step, generation, world_size, data_bytes)

    def _data_crc(self, data_bytes: int) -> int:
        assert self._mm is not None
        with memoryview(self._mm) as whole, whole[HEADER_BYTES:HEADER_BYTES + data_bytes] as data:
            return crc32(data)

    def verify_data(self) -> None:
        """Raise CorruptSnapshot (and forget the snapshot) when the data region no longer matches the
        CRC-32 written at its commit; a reader in the writer's own process calls it before it reads."""
        assert self._mm is not None and self.info is not None
        fields = _HEADER.unpack_from(self._mm, 0)
        if self._data_crc(fields[6]) != fields[10]:
            self.info = None
            raise CorruptSnapshot(f"{self.path or 'private memory'}: the snapshot's data does not match its CRC-32")

    def data_region(self, data_bytes: int) -> memoryview:
        """The first ``data_bytes`` of the data region as writable bytes: a copy received from another
        node is written here before ``write_meta_and_commit`` (runtime/peer_copy.py). Release it
        (``with``) before the slot is remapped or closed."""
        assert self._mm is not None and HEADER_BYTES + data_bytes <= self.size
        return memoryview(self._mm)[HEADER_BYTES:HEADER_BYTES + data_bytes]

    def raw_parts(self) -> tuple[SnapshotInfo, memoryview, bytes]:
        """A complete snapshot as bytes that travel: its info, its data region (a view: release it with
        ``with``) and its meta block (a copy)."""
        assert self._mm is not None and self.info is not None
        fields = _HEADER.unpack_from(self._mm, 0)
        data_bytes, meta_offset, meta_bytes = fields[6], fields[7], fields[8]
        return self.info, self.data_region(data_bytes), bytes(self._mm[meta_offset:meta_offset + meta_bytes])

    def read_meta(self) -> tuple[Any, list[tuple[int, torch.dtype, tuple[int, ...]]]]:
        assert self._mm is not None and self.info is not None
        fields = _HEADER.unpack_from(self._mm, 0)
        meta_offset, meta_bytes = fields[7], fields[8]
        # Only bytes this job's own worker wrote into its node's private (0700) directory, or a peer
        # copy committed there after its HMAC under the job's secret checked (runtime/peer_copy.py).
        meta = pickle.loads(self._mm[meta_offset:meta_offset + meta_bytes])  # noqa: S301
        return meta["skeleton"], meta["layout"]


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
