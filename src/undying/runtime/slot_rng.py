"""The random streams of a step's batch slots while an elastic job is shrunk.

Runs in the worker, on the training thread. At full size, slot s of every step's global batch is
rank s's, and what its forward and backward draw (dropout masks) comes from rank s's RNG. After an
elastic shrink a replica covers several slots; with ``elastic_batch: accumulate`` it runs one
micro-batch per slot, and each micro-batch draws from the stream of the rank whose slot it is
(``drawing_for``, entered by the loader around each micro-batch), kept here beside the process's
own RNG: the lost ranks' masks are the ones they would have drawn. A replica whose own slot another
covers no longer owns its own stream: the coverer does. The streams are part of the step
transaction (kept at the commit boundary, rolled back with a failed step), of the rank's snapshot,
and mirrored into the job's store under their slot's rank (runtime/rng_mirror.py); after a recovery
that changed who covers a slot, the new coverer takes the slot's stream from there
(``missing``/``take``): at a shrink, the lost rank's own mirrored state; at a grow, the state the
shrunk replica advanced. With ``elastic_batch: grow`` one batch holds several slots and draws from
the process's own RNG: its masks are not the lost ranks'.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from undying.runtime.rng import capture_rng, restore_rng

RngState = dict[str, Any]  # what runtime/rng.py captures


class SlotStreams:
    """The RNG streams of the slots this rank covers besides its own (``streams``), and whether the
    process's own RNG is its own slot's stream (``own_current``)."""

    def __init__(self, own_slot: int) -> None:
        self.own_slot = own_slot
        self.tracked: list[int] = []  # the slots besides its own whose micro-batches draw from a stream here
        self.owns_own_slot = True  # it covers its own slot (or is not shrunk): its own stream is its RNG
        self.own_current = True  # the process's RNG is its own slot's stream as of the committed step
        self.streams: dict[int, RngState] = {}
        self.committed: dict[int, RngState] = {}  # as of the commit boundary
        # Bumped whenever the streams are set from elsewhere (rollback, a repair, a restore): a
        # micro-batch's scope that ends after that (its generator closed late) changes nothing.
        self._version = 0

    def set_layout(self, first_slot: int, slot_count: int, per_slot: bool) -> None:
        """This rank covers ``slot_count`` slots from ``first_slot`` on; ``per_slot``: one micro-batch
        each (a shrunk job in ``accumulate`` mode), else one batch for all (the own stream draws)."""
        self._version += 1
        covered = range(first_slot, first_slot + slot_count)
        self.tracked = [slot for slot in covered if slot != self.own_slot] if per_slot else []
        self.streams = {slot: state for slot, state in self.streams.items() if slot in self.tracked}
        self.committed = {slot: state for slot, state in self.committed.items() if slot in self.tracked}
        self.owns_own_slot = self.own_slot in covered or not per_slot
        # Another rank covers this one's slot: its stream moves on there, the process's RNG here is no
        # longer it (and is taken back from the mirror when this rank covers its slot again).
        self.own_current = self.own_current and self.owns_own_slot

    @contextmanager
    def drawing_for(self, slot: int) -> Iterator[None]:
        """Around one micro-batch of ``slot``: the random numbers drawn meanwhile come from its stream.
        A slot without one here (restored from a checkpoint of another size) starts it from the
        process's RNG as it is now."""
        if slot not in self.tracked:
            yield
            return
        own, version = capture_rng(), self._version
        restore_rng(self.streams.get(slot, own))
        try:
            yield
        finally:
            if version == self._version:
                self.streams[slot] = capture_rng()
                restore_rng(own)

    def missing(self) -> list[int]:
        """The slots whose stream this rank needs and does not hold (its own first): to ``take``."""
        own = [self.own_slot] if self.owns_own_slot and not self.own_current else []
        return own + [slot for slot in self.tracked if slot not in self.streams]

    def take(self, slot: int, state: RngState | None) -> None:
        """``slot``'s stream as of the committed step (None: not found; the process's RNG stands in)."""
        self._version += 1
        if slot == self.own_slot:
            if state:
                restore_rng(state)
            self.own_current = True
        else:
            self.streams[slot] = state or capture_rng()

    def forget(self) -> None:
        """This rank's streams are not of the step it is brought to (a receiver): take them all."""
        self._version += 1
        self.streams, self.committed = {}, {}
        self.own_current = False

    def mark_commit_boundary(self) -> None:
        self.committed = dict(self.streams)  # states are replaced, never changed in place

    def roll_back(self) -> None:
        self._version += 1
        self.streams = dict(self.committed)

    def mirrored(self, own: RngState, committed: bool) -> dict[int, RngState]:
        """What this rank mirrors, by slot: ``own`` (its RNG) if it covers its own slot, and the
        streams of the other slots it covers (as of the commit boundary, or now)."""
        streams = self.committed if committed else self.streams
        return {**({self.own_slot: own} if self.owns_own_slot else {}), **streams}

    def state_dict(self) -> dict[str, Any]:
        """For the rank's snapshot, as of the commit boundary."""
        return {"streams": dict(self.committed), "own_current": self.own_current}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._version += 1
        saved = state.get("streams", {})
        self.streams = {slot: stream for slot, stream in saved.items() if slot in self.tracked}
        self.committed = dict(self.streams)
        self.own_current = bool(state.get("own_current", True)) and self.owns_own_slot
