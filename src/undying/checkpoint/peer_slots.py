"""Peer copies: the T1 snapshots of another node's rank that this node keeps in its shared memory.

Runs in the worker: the peer-copy server thread writes a copy as it arrives from the other node
(runtime/peer_copy.py), and the training thread reads one during a recovery, to send it to the
replacement of a rank whose node was lost. Each origin rank has two slots in the node's directory,
in the format of its own snapshots (checkpoint/snapshot_slot.py)::

    /dev/shm/undying-<job>/node<N>/peer/rank00003.slot0   a copy of rank 3's snapshot

Guarantees: a copy is visible (``committed``, ``read``) only once every byte arrived and checked
(the commit word is written last, as for the rank's own snapshots); a new copy never overwrites the
newest complete one nor a copy being read, so a torn or refused transfer leaves the previous copy.
Not guaranteed: that a copy exists at all (the transfer runs behind training, runtime/peer_copy.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from undying.checkpoint.snapshot_slot import STATE_EMPTY, Slot, SnapshotInfo
from undying.checkpoint.state_tree import unflatten_state

SLOTS_PER_ORIGIN = 2


class PeerSlots:
    """The copies of other nodes' ranks' snapshots kept in ``directory`` (``<node dir>/peer``)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.directory = directory
        self._lock = threading.Lock()  # slot choice, readers and the slots' infos
        self._origins: dict[int, list[Slot]] = {}
        self._busy: set[tuple[int, int]] = set()  # (origin, slot index) being written or read
        # (generation, step) of the latest recovery that went back in the history: a copy taken
        # before it (an older generation) of a later step belongs to the history given up.
        self._floor: tuple[int, int] | None = None

    def _slots(self, origin: int) -> list[Slot]:
        slots = self._origins.get(origin)
        if slots is None:
            slots = [Slot(self.directory / f"rank{origin:05d}.slot{k}", k) for k in range(SLOTS_PER_ORIGIN)]
            for slot in slots:  # files an earlier process of this node left: the floor holds for them too
                if slot.info is not None and self._given_up(slot.info.step, slot.info.generation):
                    slot.set_state(STATE_EMPTY)
                    slot.info = None
            self._origins[origin] = slots
        return slots

    def receive(self, origin: int, *, seq: int, step: int, generation: int, world_size: int, data_bytes: int,
                meta: bytes, fill: Callable[[memoryview], bool]) -> SnapshotInfo | None:
        """Write a copy of ``origin``'s snapshot: ``fill`` writes the data region (the bytes as they
        arrive) and says whether they checked; only then is the copy committed. None: refused (every
        slot was busy, or ``fill`` said no) and the previous copy stands."""
        with self._lock:
            slots = self._slots(origin)
            held = [slot for slot in slots if slot.info is not None]
            newest = max(held, key=lambda slot: slot.info.seq) if held else None  # type: ignore[union-attr]
            free = [slot for slot in slots if slot is not newest and (origin, slot.index) not in self._busy]
            if not free:
                return None
            slot = free[0]
            self._busy.add((origin, slot.index))
            slot.info = None
        try:
            slot.begin_write(data_bytes, len(meta))
            with slot.data_region(data_bytes) as region:
                checked = fill(region)
            if not checked:
                return None
            with self._lock:  # atomic with drop_after: a copy that arrives late is refused here
                if self._given_up(step, generation):
                    return None
                slot.write_meta_and_commit(meta, data_bytes, seq, step, generation, world_size)
                return slot.info
        finally:
            with self._lock:
                self._busy.discard((origin, slot.index))

    def committed(self, origin: int) -> list[SnapshotInfo]:
        """The complete copies of ``origin``'s snapshots, newest first."""
        with self._lock:
            held = [slot.info for slot in self._slots(origin)
                    if slot.info is not None and (origin, slot.index) not in self._busy]
        return sorted(held, key=lambda info: info.seq, reverse=True)

    def read(self, origin: int, step: int, use: Callable[[Any], None]) -> None:
        """Call ``use`` with the copy of ``origin``'s snapshot of ``step`` (views into shared memory,
        valid during the call; no transfer overwrites them meanwhile). KeyError if none is held."""
        with self._lock:
            slot = next((slot for slot in self._slots(origin) if slot.info is not None and slot.info.step == step
                         and (origin, slot.index) not in self._busy), None)
            if slot is None:
                raise KeyError(f"no copy of rank {origin}'s snapshot of step {step} in {self.directory}")
            self._busy.add((origin, slot.index))
        try:
            skeleton, layout = slot.read_meta()
            use(unflatten_state(skeleton, list(slot.lay_out(layout))))
        finally:
            with self._lock:
                self._busy.discard((origin, slot.index))

    def _given_up(self, step: int, generation: int) -> bool:
        return self._floor is not None and generation < self._floor[0] and step > self._floor[1]

    def drop_after(self, step: int, generation: int) -> None:
        """Generation ``generation`` continues from ``step``: forget every copy of a later step taken
        before it (a history given up), and refuse such copies that are still on their way."""
        with self._lock:
            self._floor = (generation, step)
            for origin, slots in self._origins.items():
                for slot in slots:
                    if slot.info is not None and self._given_up(slot.info.step, slot.info.generation) \
                            and (origin, slot.index) not in self._busy:
                        slot.set_state(STATE_EMPTY)
                        slot.info = None

    def close(self) -> None:
        with self._lock:
            for slots in self._origins.values():
                for slot in slots:
                    slot.close()
            self._origins.clear()
