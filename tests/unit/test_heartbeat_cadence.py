"""The heartbeat thread's cadence (runtime/reporter.py): a beat every ``heartbeat_interval`` at the
latest, whatever the steps do (the controller's silence timeouts count on it), progress beats,
however fast the steps go, no closer than ``PROGRESS_MIN_SPACING``, beats asked for (``beat_now``) no
closer than the shorter ``ASK_MIN_SPACING``; while a step is in flight, a beat at least every
``FENCE_FRESH_SHARE`` of the commit fence's lease; ``close`` does not wait out a pause.

The real thread loop, with the controller client replaced by a recorder of when each beat went.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from undying.protocol import Phase
from undying.runtime import reporter as reporter_module
from undying.runtime.reporter import Reporter

SPACING = 0.5
ASK_SPACING = 0.2
INTERVAL = 0.6  # beside a 0.5 s spacing: a loop that waited the interval after the spacing beats every 1.1 s


class _NoClient:
    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _beats(monkeypatch: pytest.MonkeyPatch, seconds: float, step_every: float | None,
           ask: bool = False, fence_lease: float | None = None, phase: Phase = Phase.STARTING) -> list[float]:
    """When the thread's beats began over ``seconds``, with the step moving every ``step_every`` s
    (and, with ``ask``, a beat asked for each time), the worker in ``phase``."""
    monkeypatch.setattr(reporter_module, "PROGRESS_MIN_SPACING", SPACING)
    monkeypatch.setattr(reporter_module, "ASK_MIN_SPACING", ASK_SPACING)
    monkeypatch.setattr(reporter_module, "ControllerClient", _NoClient)
    reporter = Reporter(None, "", rank=0, node=0, generation=1, interval=INTERVAL, fence_lease=fence_lease)
    reporter.phase = phase
    reporter._address = "127.0.0.1:1"  # a thread of its own, as with a controller
    sent: list[float] = []
    monkeypatch.setattr(reporter, "_beat", lambda _client: sent.append(time.monotonic()))
    thread = threading.Thread(target=reporter._beat_forever, daemon=True)
    thread.start()
    ends = time.monotonic() + seconds
    step = 0
    while time.monotonic() < ends:
        if step_every is None:
            time.sleep(0.05)
            continue
        step += 1
        reporter.update(step=step)
        if ask:
            reporter.beat_now()
        time.sleep(step_every)
    reporter._closing.set()
    reporter.beat_now()
    thread.join(timeout=5)
    return sent


def _gaps(sent: list[float]) -> list[float]:
    return [later - earlier for earlier, later in zip(sent, sent[1:], strict=False)]


def test_without_progress_a_beat_goes_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    gaps = _gaps(_beats(monkeypatch, 4.0, step_every=None))
    assert len(gaps) >= 4
    assert max(gaps) < INTERVAL + 0.3, gaps  # the spacing is not added to the interval
    assert min(gaps) >= INTERVAL - 0.01, gaps


def test_fast_steps_beat_at_the_spacing_and_never_later_than_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    gaps = _gaps(_beats(monkeypatch, 4.0, step_every=0.01))
    assert len(gaps) >= 4
    assert min(gaps) >= SPACING - 0.01, gaps  # progress does not beat faster than the spacing
    assert max(gaps) < INTERVAL + 0.3, gaps


def test_a_step_in_flight_beats_within_the_fence_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps longer than the lease (here no step moves at all): the thread does not wait the whole
    interval, so the fence finds an answered beat younger than its lease."""
    lease = 0.5  # FENCE_FRESH_SHARE of it: 0.3 s, under the 0.5 s progress spacing and the 0.6 s interval
    gaps = _gaps(_beats(monkeypatch, 3.0, step_every=None, fence_lease=lease, phase=Phase.COMPUTING))
    fresh = reporter_module.FENCE_FRESH_SHARE * lease
    assert len(gaps) >= 6
    assert min(gaps) >= fresh - 0.01, gaps
    assert sorted(gaps)[len(gaps) // 2] < fresh + 0.1, gaps


@pytest.mark.parametrize("phase", [Phase.RECOVERING, Phase.DONE])
def test_no_step_in_flight_beats_at_the_interval(monkeypatch: pytest.MonkeyPatch, phase: Phase) -> None:
    gaps = _gaps(_beats(monkeypatch, 2.5, step_every=None, fence_lease=0.5, phase=phase))
    assert len(gaps) >= 2
    assert min(gaps) >= INTERVAL - 0.01, gaps


def test_asked_beats_go_at_the_shorter_ask_spacing(monkeypatch: pytest.MonkeyPatch) -> None:
    gaps = _gaps(_beats(monkeypatch, 3.0, step_every=0.01, ask=True))
    assert len(gaps) >= 8
    assert min(gaps) >= ASK_SPACING - 0.01, gaps
    assert sorted(gaps)[len(gaps) // 2] < SPACING - 0.1, gaps  # not held for the progress spacing


def test_an_ask_cuts_a_progress_pause_short(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reporter_module, "PROGRESS_MIN_SPACING", 5.0)
    monkeypatch.setattr(reporter_module, "ASK_MIN_SPACING", 0.1)
    monkeypatch.setattr(reporter_module, "ControllerClient", _NoClient)
    reporter = Reporter(None, "", rank=0, node=0, generation=1, interval=10.0)
    reporter._address = "127.0.0.1:1"
    sent: list[float] = []
    monkeypatch.setattr(reporter, "_beat", lambda _client: sent.append(time.monotonic()))
    reporter._thread = threading.Thread(target=reporter._beat_forever, daemon=True)
    reporter._thread.start()
    time.sleep(0.3)
    reporter.update(step=1)  # a progress beat, held for the 5 s spacing
    time.sleep(0.3)
    assert len(sent) == 1, sent
    asked = time.monotonic()
    reporter.beat_now()
    deadline = time.monotonic() + 2.0
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    reporter.close()
    assert len(sent) >= 2 and sent[1] - asked < 1.0, (sent, asked)


def test_close_does_not_wait_out_a_progress_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reporter_module, "PROGRESS_MIN_SPACING", 5.0)
    monkeypatch.setattr(reporter_module, "ControllerClient", _NoClient)
    reporter = Reporter(None, "", rank=0, node=0, generation=1, interval=10.0)
    reporter._address = "127.0.0.1:1"
    monkeypatch.setattr(reporter, "_beat", lambda _client: None)
    reporter._thread = threading.Thread(target=reporter._beat_forever, daemon=True)
    reporter._thread.start()
    time.sleep(0.1)
    reporter.update(step=1)  # a progress beat, held for the 5 s spacing
    time.sleep(0.1)
    started = time.monotonic()
    reporter.close()
    assert not reporter._thread.is_alive() and time.monotonic() - started < 1.0
