"""T1 snapshots: one rank's training state copied into preallocated node shared memory at a step boundary.

Runs in the worker. The training thread writes a snapshot (the training stall is that
copy), the persister thread reads a pinned one to write it to T2 (checkpoint/persister.py),
and after a restart the new worker on the same node reads the newest complete one. The
slot files live in the node's shared-memory directory (undying/shm.py): they outlive the
worker's SIGKILL, and the node's agent removes them when the job ends.

File of one slot (``rank<R>.slot<K>``)::

    [0, 4096)        header: magic, format, sequence number, step, generation, world size,
                     data/meta extents, CRC-32 of the meta block and of the header fields;
                     a separate ``state`` word: EMPTY, WRITING or COMMITTED
    [4096, ...)      tensor data, each tensor 64-byte aligned, in the order of flatten_state
    [meta_offset...) meta block: pickle of the state's skeleton (everything but tensors) and
                     the tensor layout (offset, dtype, shape)
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from undying.checkpoint.copy import BackgroundCopy, copy_now

MAGIC = b"UNDYSNAP"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
ALIGN = 64
META_SLACK = 1 << 20  # room for the meta block to grow (loader positions, user state) without a remap

STATE_EMPTY = 0
STATE_WRITING = 1
STATE_COMMITTED = 2

# magic, format, seq, step, generation, world_size, data_bytes, meta_offset, meta_bytes, meta_crc
_HEADER = struct.Struct("<8sIQqqqQQQI")
_STATE_OFFSET = 128  # the commit word, apart from the fields it vouches for
_HEADER_CRC_OFFSET = 132
_WORD = struct.Struct("<I")


class SnapshotUnavailable(RuntimeError):
    """Node shared memory could not hold the snapshot (e.g. /dev/shm is full)."""


@dataclass(frozen=True)
class TensorRef:
    """Stands for the tensor at ``index`` of a flattened state."""

    index: int


@dataclass(frozen=True)
class SnapshotInfo:
    """A complete snapshot in one slot: the step it holds and where it was taken."""

    slot: int
    seq: int
    step: int
    generation: int
    world_size: int
    nbytes: int


# ----------------------------------------------------------------- flatten / unflatten


def flatten_state(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split ``state`` into a picklable skeleton (tensors replaced by ``TensorRef``) and its tensors.

    Dicts (their type and ``_metadata``, which ``load_state_dict`` reads, kept), lists and
    tuples are walked; every other value stays in the skeleton as is.
    """
    tensors: list[torch.Tensor] = []

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach())
            return TensorRef(len(tensors) - 1)
        return value

    return _map_leaves(state, leaf), tensors


def unflatten_state(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of ``flatten_state``: the skeleton with each ``TensorRef`` replaced by its tensor."""
    return _map_leaves(skeleton, lambda value: tensors[value.index] if isinstance(value, TensorRef) else value)


def _map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """A copy of the nested dicts (type and ``_metadata`` kept), lists and tuples (named ones too) in
    ``value``, with ``leaf`` applied to every other value."""
    if isinstance(value, dict):
        copied = OrderedDict() if isinstance(value, OrderedDict) else {}
        for key, item in value.items():
            copied[key] = _map_leaves(item, leaf)
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            copied._metadata = metadata  # type: ignore[attr-defined]
        return copied
    if isinstance(value, list):
        return [_map_leaves(item, leaf) for item in value]
    if isinstance(value, tuple):
        items = [_map_leaves(item, leaf) for item in value]
        return type(value)._make(items) if hasattr(value, "_fields") else tuple(items)
    return leaf(value)


def copy_into(source: Any, live: Any) -> Any:
    """A private copy of ``source`` (e.g. a snapshot's views) that reuses ``live`` memory: each tensor
    is copied into the tensor at the same place of ``live`` when that one has the same dtype and
    shape (on any device: host-to-device for a GPU job), and cloned otherwise. Restoring into a
    process that already holds its state (or its model's parameters) then allocates nothing for
    those tensors."""
    if isinstance(source, torch.Tensor):
        if (isinstance(live, torch.Tensor) and live.dtype == source.dtype and live.shape == source.shape
                and not live.requires_grad):
            return live.copy_(source)
        return source.clone()
    if isinstance(source, dict):
        copied = OrderedDict() if isinstance(source, OrderedDict) else {}
        for key, item in source.items():
            copied[key] = copy_into(item, live.get(key) if isinstance(live, dict) else None)
        metadata = getattr(source, "_metadata", None)
        if metadata is not None:
            copied._metadata = metadata  # type: ignore[attr-defined]
        return copied
    if isinstance(source, (list, tuple)):
        same_shape = isinstance(live, (list, tuple)) and len(live) == len(source)
        items = [copy_into(item, live[index] if same_shape else None) for index, item in enumerate(source)]
        if isinstance(source, list):
            return items
        return type(source)._make(items) if hasattr(source, "_fields") else tuple(items)
    return source


def tensor_layout(tensors: Sequence[torch.Tensor]) -> tuple[list[tuple[int, torch.dtype, tuple[int, ...]]], int]:
    """Where each tensor goes in a slot's data region (64-byte aligned) and the region's size."""
    layout, offset = [], 0
    for tensor in tensors:
        layout.append((offset, tensor.dtype, tuple(tensor.shape)))
        offset = _align(offset + tensor.numel() * tensor.element_size())
    return layout, offset


def _align(value: int) -> int:
    return (value + ALIGN - 1) // ALIGN * ALIGN


# ------------------------------------------------------------------------------ slots


class _Slot:
    """One slot file (or, without a directory, anonymous memory) and the views laid over it."""

    def __init__(self, path: Path | None, index: int) -> None:
        self.path = path
        self.index = index
        self.size = 0
        self._mm: mmap.mmap | None = None
        self.layout: list[tuple[int, torch.dtype, tuple[int, ...]]] | None = None
        self.views: list[torch.Tensor] = []
        self.info: SnapshotInfo | None = None  # set while the slot holds a complete snapshot
        self._page_locked: int | None = None  # the address registered with CUDA (page-locked), if any
        if path is not None and path.exists():
            self._map(path.stat().st_size)
            self.info = self._read_info()

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
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                # Allocated up front: a write into a hole of a full tmpfs is a SIGBUS, this is an error.
                os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
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
        from torch.cuda import _pin_memory_utils

        address = torch.frombuffer(self._mm, dtype=torch.uint8, count=1).data_ptr()
        _pin_memory_utils.pin_memory(address, self.size)
        self._page_locked = address

    def _unlock_pages(self) -> None:
        address, self._page_locked = self._page_locked, None
        if address is not None:
            from torch.cuda import _pin_memory_utils

            _pin_memory_utils.unpin_memory(address)

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

    def set_state(self, state: int) -> None:
        assert self._mm is not None
        _WORD.pack_into(self._mm, _STATE_OFFSET, state)

    def write_meta_and_commit(self, meta: bytes, data_bytes: int, seq: int, step: int, generation: int,
                              world_size: int) -> None:
        assert self._mm is not None
        meta_offset = HEADER_BYTES + data_bytes
        self._mm[meta_offset:meta_offset + len(meta)] = meta
        fields = _HEADER.pack(MAGIC, FORMAT_VERSION, seq, step, generation, world_size, data_bytes,
                              meta_offset, len(meta), zlib.crc32(meta))
        self._mm[:_HEADER.size] = fields
        _WORD.pack_into(self._mm, _HEADER_CRC_OFFSET, zlib.crc32(fields))
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
        if zlib.crc32(fields) != _WORD.unpack_from(mm, _HEADER_CRC_OFFSET)[0]:
            return None
        magic, version, seq, step, generation, world_size, data_bytes, meta_offset, meta_bytes, meta_crc = \
            _HEADER.unpack(fields)
        if magic != MAGIC or version != FORMAT_VERSION or meta_offset + meta_bytes > self.size:
            return None
        if zlib.crc32(mm[meta_offset:meta_offset + meta_bytes]) != meta_crc:
            return None
        return SnapshotInfo(self.index, seq, step, generation, world_size, data_bytes)

    def read_meta(self) -> tuple[Any, list[tuple[int, torch.dtype, tuple[int, ...]]]]:
        assert self._mm is not None and self.info is not None
        fields = _HEADER.unpack_from(self._mm, 0)
        meta_offset, meta_bytes = fields[7], fields[8]
        # Only bytes this job's own worker wrote into its node's private (0700) directory.
        meta = pickle.loads(self._mm[meta_offset:meta_offset + meta_bytes])  # noqa: S301
        return meta["skeleton"], meta["layout"]


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


# ----------------------------------------------------------------------- one rank's T1


class RankSnapshots:
    """The T1 snapshots of one rank: ``slots`` (>= 2) preallocated slots written in turn.

    Guarantees:

    - A snapshot is visible (``committed``, ``read``, ``pin``) only once it is complete: its
      slot's commit word is written after every byte of data and metadata, and a reader
      checks that word and the CRC-32 of header and metadata. A writer killed mid-copy
      leaves that slot EMPTY-or-WRITING, and the other slots still hold older snapshots.
    - ``write`` never overwrites a pinned snapshot (the persister's), nor the newest one unless
      a pinned snapshot remains to fall back on; when no slot qualifies it skips the snapshot
      and returns None.
    - Buffers are allocated when a slot first needs more room (the first snapshot, and the
      optimizer's state appearing after the first step) and reused for every later
      snapshot: a steady-state snapshot allocates nothing but the small skeleton, and its
      cost is the copy. The first snapshot allocates its slot on the calling thread; the
      other slots are grown on a helper thread meanwhile (skipped until ready).
    - With ``defer`` (overlapped snapshots), the tensors it selects are copied on a helper
      thread after ``write`` returns, and the slot is committed when they are: until then it
      is invisible as any torn write is, ``pin`` of its step waits in ``read_slot``, and the
      next ``write`` (or ``wait``) first waits for it. The caller must not change those
      tensors before ``wait``.

    Not guaranteed: durability beyond the node (T1 dies with the node: that is T2's job),
    nor checksums of the tensor data (the copy is in memory and checksummed on the way to T2).
    """

    def __init__(self, directory: Path | None, rank: int, slots: int = 2) -> None:
        if slots < 2:
            raise ValueError(f"slots must be >= 2 (one may be torn while another is intact), got {slots}")
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.directory = directory
        self.rank = rank
        self._slots = [_Slot(None if directory is None else directory / f"rank{rank:05d}.slot{k}", k)
                       for k in range(slots)]
        self._lock = threading.Lock()  # slot choice and pins: the training thread writes, the persister pins
        self._pins = [0] * slots
        self._writing: int | None = None
        self._reserving: set[int] = set()  # slots being grown on a helper thread
        self._reservers: list[threading.Thread] = []
        self._seq = max((slot.info.seq for slot in self._slots if slot.info), default=0)
        self._background: tuple[int, int, BackgroundCopy] | None = None  # (slot, step, copy) of a deferred write
        self.skipped = 0
        self.last_copy_seconds = 0.0  # the training thread's part of the last write
        # Slots that receive device (CUDA) tensors are page-locked, until CUDA refuses once (why, here).
        self.page_lock_error: str | None = None

    # -- writing (training thread)

    def write(self, state: Any, *, step: int, generation: int, world_size: int,
              defer: Callable[[torch.Tensor], bool] | None = None) -> SnapshotInfo | None:
        """Copy ``state`` into a free slot; the snapshot is complete when this returns (or None: skipped).

        With ``defer``, the tensors for which it is true are copied in the background and the
        snapshot is complete when ``wait`` returns; the returned info is what it will hold.
        """
        self.wait()
        started = time.perf_counter()
        skeleton, tensors = flatten_state(state)
        layout, data_bytes = tensor_layout(tensors)
        meta = pickle.dumps({"skeleton": skeleton, "layout": layout}, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            slot = self._free_slot()
            if slot is None:
                self.skipped += 1
                return None
            self._writing = slot.index
        deferred = False
        try:
            slot.info = None
            if slot.size:
                slot.set_state(STATE_WRITING)
            needed = HEADER_BYTES + data_bytes + len(meta)
            if needed > slot.size:
                slot.reserve(needed + max(META_SLACK, len(meta)))
                slot.set_state(STATE_WRITING)
            if self.page_lock_error is None and any(tensor.device.type == "cuda" for tensor in tensors):
                try:
                    slot.lock_pages()
                except RuntimeError as error:  # pageable memory: the copies are right, only slower
                    self.page_lock_error = str(error)
            now: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (views, tensors)
            later: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
            for view, tensor in zip(slot.lay_out(layout), tensors, strict=True):
                part = later if defer is not None and defer(tensor) else now
                part[0].append(view)
                part[1].append(tensor)
            copy_now(*now)
            self._seq += 1
            seq = self._seq

            def commit() -> None:
                slot.write_meta_and_commit(meta, data_bytes, seq, step, generation, world_size)

            if later[0]:
                self._background = (slot.index, step, BackgroundCopy(
                    *later, then=lambda: self._committed_in_background(commit)))
                deferred = True
                info = SnapshotInfo(slot.index, seq, step, generation, world_size, data_bytes)
            else:
                commit()
                info = slot.info
            self.last_copy_seconds = time.perf_counter() - started
        finally:
            if not deferred:
                with self._lock:
                    self._writing = None
        self._reserve_others(slot.size, slot)
        return info

    def _committed_in_background(self, commit: Callable[[], None]) -> None:
        try:
            commit()
        finally:
            with self._lock:
                self._writing = None

    def wait(self) -> float:
        """Until a deferred write is complete (committed); returns the seconds this call blocked."""
        background = self._background
        if background is None:
            return 0.0
        try:
            return background[2].wait()
        finally:
            # Cleared only once the copy is over: the persister's read_slot of a pinned deferred write
            # waits while it is set.
            self._background = None
            with self._lock:
                self._writing = None  # a failed copy leaves its slot WRITING (invisible) and free

    def _reserve_others(self, size: int, written: _Slot) -> None:
        """Grow the other slots to ``size`` on a helper thread: allocating and mapping gigabytes takes
        seconds (in syscalls that release the GIL), and the next snapshots should not stall on it;
        until a slot is ready, a write skips it as it skips a pinned one."""
        with self._lock:
            slots = [slot for slot in self._slots if slot is not written and slot.size < size
                     and self._pins[slot.index] == 0 and slot.index not in self._reserving]
            for slot in slots:
                self._reserving.add(slot.index)
                if slot.info is not None:
                    slot.set_state(STATE_EMPTY)  # an older snapshot; its slot is about to be remapped
                    slot.info = None
        for slot in slots:
            thread = threading.Thread(target=self._reserve, args=(slot, size), daemon=True,
                                      name="undying-snapshot-reserve")
            self._reservers.append(thread)
            thread.start()

    def _reserve(self, slot: _Slot, size: int) -> None:
        try:
            slot.reserve(size)
        except SnapshotUnavailable:
            pass  # the slot stays small; the write that needs it grows it, and reports the error there
        finally:
            with self._lock:
                self._reserving.discard(slot.index)

    def wait_reserved(self) -> None:
        """Until every slot being grown in the background is ready (benchmarks, tests)."""
        for thread in self._reservers:
            thread.join()
        self._reservers = []

    def _free_slot(self) -> _Slot | None:
        newest = self._newest()
        # The newest snapshot may be overwritten only while a pinned one (complete, being persisted)
        # remains: a torn write then falls back to it, and T1 keeps up with training meanwhile.
        pinned_complete = any(self._pins[slot.index] and slot.info is not None for slot in self._slots)
        candidates = [slot for slot in self._slots
                      if self._pins[slot.index] == 0 and slot.index not in self._reserving
                      and (slot is not newest or pinned_complete)]
        if not candidates:
            return None
        # An empty slot first, else the one holding the oldest snapshot.
        return min(candidates, key=lambda slot: -1 if slot.info is None else slot.info.seq)

    def _newest(self) -> _Slot | None:
        held = [slot for slot in self._slots if slot.info is not None]
        return max(held, key=lambda slot: slot.info.seq) if held else None  # type: ignore[union-attr]

    def invalidate(self, keep_step: int | None = None) -> None:
        """Forget every snapshot but the one of ``keep_step``: after a restore to another point of the
        history, an older run's later steps must never be taken for this run's."""
        self.wait()
        with self._lock:
            for slot in self._slots:
                if slot.info is not None and slot.info.step != keep_step and self._pins[slot.index] == 0:
                    slot.set_state(STATE_EMPTY)
                    slot.info = None

    # -- reading (persister thread, or a restarted worker)

    def committed(self) -> list[SnapshotInfo]:
        """Complete snapshots, newest first."""
        with self._lock:
            held = [slot.info for slot in self._slots if slot.info is not None and slot.index != self._writing]
        return sorted(held, key=lambda info: info.seq, reverse=True)

    def pin(self, step: int) -> int:
        """Keep the snapshot of ``step`` from being overwritten until ``unpin``; returns its slot. A
        deferred write of ``step`` still being copied is pinned too (``read_slot`` waits for it)."""
        with self._lock:
            background = self._background
            if background is not None and background[1] == step and self._writing == background[0]:
                self._pins[background[0]] += 1
                return background[0]
            for slot in sorted(self._slots, key=lambda s: -(s.info.seq if s.info else -1)):
                if slot.info is not None and slot.info.step == step and slot.index != self._writing:
                    self._pins[slot.index] += 1
                    return slot.index
        raise KeyError(f"rank {self.rank} holds no snapshot of step {step}")

    def unpin(self, slot_index: int) -> None:
        with self._lock:
            self._pins[slot_index] -= 1

    def read_slot(self, slot_index: int, clone: bool) -> Any:
        """The state in a pinned (or otherwise quiet) slot: views into shared memory, or copies."""
        background = self._background
        if background is not None and background[0] == slot_index:
            background[2].done.wait()  # the pinned deferred write; a failed one holds no snapshot
        slot = self._slots[slot_index]
        if slot.info is None:
            raise KeyError(f"slot {slot_index} of rank {self.rank} holds no snapshot")
        skeleton, layout = slot.read_meta()
        views = slot.lay_out(layout)
        tensors = [view.clone() for view in views] if clone else list(views)
        return unflatten_state(skeleton, tensors)

    def read(self, step: int, live: Any = None) -> Any:
        """A private copy of the snapshot of ``step`` (safe to keep after the slot is rewritten); with
        ``live`` (a state of the same structure, e.g. the running model's and optimizer's), tensors
        are copied into its matching tensors instead of newly allocated (``copy_into``)."""
        slot_index = self.pin(step)
        try:
            if live is None:
                return self.read_slot(slot_index, clone=True)
            return copy_into(self.read_slot(slot_index, clone=False), live)
        finally:
            self.unpin(slot_index)

    def nbytes_reserved(self) -> int:
        return sum(slot.size for slot in self._slots)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.wait_reserved()
        for slot in self._slots:
            slot.close()
