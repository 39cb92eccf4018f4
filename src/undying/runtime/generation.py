"""This worker's generation and what the controller said of it: the one place that truth lives.

Runs in the worker. Two parts write it: the heartbeat client (runtime/reporter.py) records, from
each heartbeat reply and on whichever thread sent the beat, the newest generation the controller
aborted and the newest it ends at a step boundary; the membership (runtime/membership.py) moves
to a recovery plan's generation. The rest read it through the membership (``generation``,
``aborted``, ``ending``; a collective's wait, the RNG mirror's and the step transaction's fence
poll ``aborted``, and a collective that waits long ``ask``s for the controller's word) and the
reporter (the generation its heartbeats and events carry).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Generation:
    """The generation this worker is in, and the newest generations the controller aborted and ends.

    Guarantees: the abort and end generations only grow (a late reply cannot undo an abort);
    ``aborted`` and ``ending`` compare them with the current generation at the time of the call,
    so entering a newer generation makes an older abort no longer apply. Reads take no lock (one
    attribute each, written whole), so a collective's abort poll costs nothing."""

    def __init__(self, generation: int) -> None:
        self._current = generation
        self._abort_generation = 0  # the newest generation the controller told us to abandon
        self._end_generation = 0  # the newest generation the controller ends at a step boundary
        # Replies are heard on two threads (the heartbeat thread, the training thread's fence).
        self._written = threading.Lock()
        self._ask: Callable[[], None] = lambda: None  # wakes the heartbeat thread (``asked_by``)

    # ------------------------------------------------------------- read by anyone

    @property
    def current(self) -> int:
        """The generation this worker is in."""
        return self._current

    @property
    def abort_generation(self) -> int:
        """The newest generation the controller told this worker to abandon (0: none)."""
        return self._abort_generation

    @property
    def end_generation(self) -> int:
        """The newest generation the controller ends at a step boundary (0: none)."""
        return self._end_generation

    def aborted(self) -> bool:
        """Has the controller told this generation to stop now (a fault elsewhere)?"""
        return self._abort_generation >= self._current

    def ending(self) -> bool:
        """Does the controller end this generation at the next step boundary (an elastic grow), or abort it?"""
        return self._end_generation >= self._current or self.aborted()

    def ask(self) -> None:
        """Have the controller's word on this generation soon: a heartbeat now (spaced as progress
        beats are) instead of at the next interval. A collective that waits long asks, so that an
        abort for a peer that is gone reaches it at once."""
        self._ask()

    # ------------------------------------------------------------- written by the reporter and the membership

    def asked_by(self, beat_now: Callable[[], None]) -> None:
        """``ask`` calls ``beat_now`` from now on (the reporter's: it sends the heartbeats)."""
        self._ask = beat_now

    def heard(self, abort_generation: int, end_generation: int) -> None:
        """A heartbeat reply's word: the newest generation the controller aborted, and ends."""
        with self._written:
            self._abort_generation = max(self._abort_generation, abort_generation)
            self._end_generation = max(self._end_generation, end_generation)

    def enter(self, generation: int) -> None:
        """This worker is now in ``generation`` (a recovery's plan)."""
        self._current = generation  # one writer: the training thread, in a recovery
