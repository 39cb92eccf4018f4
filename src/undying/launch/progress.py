"""The job's progress as the console's live line shows it: step of total, steps/s, ETA, last loss,
and whether the job is recovering.

Runs in the ``undying run`` process whose controller leads, as a listener of the job's events
(``EventLog.add_listener``): the controller logs each rank's heartbeat (committed step, phase,
loss, and ``max_steps`` from ``ft.steps(n)``) at most every ``HEARTBEAT_LOG_EVERY`` seconds, and
that sampling is plenty for a line redrawn twice a second. ``on_event`` runs on the controller's
thread and only records; ``line`` composes the text on the console's thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from undying import events as ev
from undying.events import Event

RATE_WINDOW = 20.0  # seconds of step samples the steps/s figure is taken over


class Progress:
    """What the live line shows, kept up to date from the job's events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step = 0  # the job's committed steps: the furthest rank's, from heartbeats
        self.total: int | None = None  # ``ft.steps(n)``'s n, once a worker reported it
        self.loss: float | None = None
        self.faults = 0
        self.recovering_since_step: int | None = None  # the step a fault found; None: training
        self.outcome: str | None = None
        self._ranks: dict[int, int] = {}  # rank -> its newest reported step
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic time, job step)

    def on_event(self, event: Event, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if event.kind == ev.HEARTBEAT and event.rank is not None and event.step is not None:
                self._heartbeat(event, now)
            elif event.kind == ev.FAULT_DETECTED:
                self.faults += 1
                self.recovering_since_step = self.step
            elif event.kind == ev.FIRST_STEP:
                self.recovering_since_step = None
            elif event.kind == ev.RESTART_BEGIN:
                self._ranks.clear()  # every rank restarts, from a checkpoint: its steps start over
            elif event.kind == ev.JOB_END:
                self.outcome = str(event.details.get("outcome") or "ended")

    def _heartbeat(self, event: Event, now: float) -> None:
        assert event.rank is not None and event.step is not None
        details = event.details
        if details.get("max_steps"):
            self.total = int(details["max_steps"])
        if details.get("loss") is not None:
            self.loss = float(details["loss"])
        self._ranks[event.rank] = event.step
        step = max(self._ranks.values())
        if step < self.step:
            self._samples.clear()  # rolled back (a job restart from a checkpoint): a new rate
        self.step = step
        if self.recovering_since_step is not None and step > self.recovering_since_step:
            self.recovering_since_step = None
        self._samples.append((now, step))
        while self._samples and now - self._samples[0][0] > RATE_WINDOW:
            self._samples.popleft()

    def steps_per_second(self) -> float | None:
        with self._lock:
            if len(self._samples) < 2:
                return None
            (first_time, first_step), (last_time, last_step) = self._samples[0], self._samples[-1]
        if last_time <= first_time or last_step <= first_step:
            return None
        return (last_step - first_step) / (last_time - first_time)

    def line(self) -> str:
        """``[undying] step 42/200 (21%) | 3.10 steps/s | ETA 0:00:51 | loss 2.134``."""
        rate = self.steps_per_second()
        with self._lock:
            step, total, loss = self.step, self.total, self.loss
            recovering = self.recovering_since_step is not None
            faults, outcome = self.faults, self.outcome
            started = bool(self._ranks) or step > 0
        if not started:
            return "[undying] starting"
        parts = [f"step {step}/{total} ({100 * step // total}%)" if total else f"step {step}"]
        if rate is not None:
            parts.append(f"{rate:.2f} steps/s")
            if total and step < total:
                parts.append(f"ETA {format_duration((total - step) / rate)}")
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        if faults:
            parts.append(f"{faults} fault{'s' if faults > 1 else ''}")
        if outcome is not None:
            parts.append(outcome)
        elif recovering:
            parts.append("recovering")
        return "[undying] " + " | ".join(parts)


def format_duration(seconds: float) -> str:
    """``H:MM:SS``."""
    whole = max(0, int(round(seconds)))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"
