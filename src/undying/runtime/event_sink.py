"""What a worker part that only reports needs of the heartbeat client: an event, sent at once.

Runs in the worker. The reporter (runtime/reporter.py) is the one implementation; the parts that
report what they did (bad steps, the RNG mirror, peer copies, the dying checkpoint, the snapshot
cadence, injections) receive it as an ``EventSink``, not as the heartbeat client with its
generation, progress and check-ins.
"""

from __future__ import annotations

from typing import Any, Protocol


class EventSink(Protocol):
    def emit(self, kind: str, step: int | None = None, **details: Any) -> None:
        """Send one event (``undying.events``) from the calling thread; ``step``: the reporter's if None."""
        ...
