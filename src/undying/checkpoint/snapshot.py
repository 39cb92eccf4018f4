"""T1 snapshots: one rank's training state copied into preallocated node shared memory at a step boundary.

Runs in the worker. The training thread writes a snapshot (the training stall is that
copy), the persister thread reads a pinned one to write it to T2 (checkpoint/persister.py),
and after a restart the new worker on the same node reads the newest complete one. This module
chooses the slot each snapshot goes to and which ones readers may take; one slot's file and
header are snapshot_slot.py, the walk over the state's tree is state_tree.py.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from undying.checkpoint.copy import BackgroundCopy, copy_now
from undying.checkpoint.snapshot_slot import (
    STATE_EMPTY,
    STATE_WRITING,
    Slot,
    SnapshotInfo,
    SnapshotUnavailable,
    tensor_layout,
)
from undying.checkpoint.state_tree import copy_into, flatten_state, unflatten_state

__all__ = [
    "STATE_WRITING",
    "RankSnapshots",
    "SnapshotInfo",
    "SnapshotUnavailable",
    "copy_into",
    "flatten_state",
    "unflatten_state",
]



class RankSnapshots:
    """The T1 snapshots of one rank: ``slots`` (>= 2) preallocated slots written in turn.

    Guarantees:

    - A snapshot is visible (``committed``, ``read``, ``pin``) only once it is complete: its
      slot's commit word is written after every byte of data and metadata, and a reader
      checks that word and the CRC-32 of header and metadata. Its data is loaded only if it
      matches the CRC-32 of the data written at the commit (checked when a slot is opened from
      its file, and before each read in the writer's process): a byte changed in memory since
      makes the slot hold nothing (CorruptSnapshot, a KeyError), and readers take the next source. A writer killed mid-copy
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

    def __init__(self, directory: Path | None, rank: int, slots: int = 2, populate: bool = True) -> None:
        if slots < 2:
            raise ValueError(f"slots must be >= 2 (one may be torn while another is intact), got {slots}")
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.directory = directory
        self.rank = rank
        # ``populate=False``: another rank's slots opened to be read (the node's replica), whose pages
        # are touched only where a read copies them.
        self._slots = [Slot(None if directory is None else directory / f"rank{rank:05d}.slot{k}", k, populate)
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
            slot.begin_write(data_bytes, len(meta))
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
                info: SnapshotInfo | None = SnapshotInfo(slot.index, seq, step, generation, world_size, data_bytes)
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

    def _reserve_others(self, size: int, written: Slot) -> None:
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

    def _reserve(self, slot: Slot, size: int) -> None:
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

    def _free_slot(self) -> Slot | None:
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

    def _newest(self) -> Slot | None:
        held = [slot for slot in self._slots if slot.info is not None]
        return max(held, key=lambda slot: slot.info.seq) if held else None  # type: ignore[union-attr]

    def invalidate(self, keep_step: int | None = None) -> None:
        """Forget every snapshot but the one of ``keep_step``: after a restore to another point of the
        history, an older run's later steps must never be taken for this run's. A pinned one too: a
        reader that holds its views keeps them (the pin still keeps the slot from being rewritten),
        and no new reader finds it."""
        self.wait()
        with self._lock:
            for slot in self._slots:
                if slot.info is not None and slot.info.step != keep_step:
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
        slot.verify_data()  # memory corrupted since the commit: never loaded, the caller takes the next source
        skeleton, layout = slot.read_meta()
        views = slot.lay_out(layout)
        tensors = [view.clone() for view in views] if clone else list(views)
        return unflatten_state(skeleton, tensors)

    def raw_slot(self, slot_index: int) -> tuple[SnapshotInfo, memoryview, bytes]:
        """A pinned slot's snapshot as bytes (``Slot.raw_parts``), for a copy to another node."""
        background = self._background
        if background is not None and background[0] == slot_index:
            background[2].done.wait()
        slot = self._slots[slot_index]
        if slot.info is None:
            raise KeyError(f"slot {slot_index} of rank {self.rank} holds no snapshot")
        slot.verify_data()
        return slot.raw_parts()

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
