"""A collective that waits long asks for the controller's word (runtime/pg.py ``ask_controller``,
runtime/generation.py ``ask``, the reporter's heartbeat thread): a survivor blocked on a peer that
will never come (a frozen host keeps its connections open) hears the controller's abort within a
fraction of a second, not at its heartbeat thread's next beat a whole ``heartbeat_interval`` later.

Two gloo ranks as threads of the test process; rank 1 never joins rank 0's all-reduce. Rank 0 has a
real ``Reporter`` heartbeat thread (interval 5 s) whose beat is answered by a stand-in for the
controller: from ``ABORT_AT`` on, the reply says the generation is aborted.
"""

from __future__ import annotations

import threading
import time
from itertools import pairwise
from typing import Any

import pytest
import torch

from tests.unit.gloo_ranks import run_ranks
from undying.runtime import reporter as reporter_module
from undying.runtime.generation import Generation
from undying.runtime.pg import ASK_AGAIN_S, ASK_CONTROLLER_AFTER_S, CollectiveError, GenerationGroup
from undying.runtime.reporter import Reporter

INTERVAL = 5.0  # the heartbeat thread's own cadence: an abort heard only at its beats comes seconds late
ABORT_AT = 0.6  # seconds after the all-reduce began, the controller gives the generation up


class _NoClient:
    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _group(store: torch.distributed.Store, rank: int, generation: Generation | None) -> GenerationGroup:
    if generation is None:
        return GenerationGroup(store, "ask", 1, rank, 2, "gloo", 20.0, torch.device("cpu"))
    return GenerationGroup(store, "ask", 1, rank, 2, "gloo", 20.0, torch.device("cpu"),
                           should_abort=generation.aborted, ask_controller=generation.ask)


def test_a_collective_stuck_on_a_silent_peer_hears_the_abort_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reporter_module, "ControllerClient", _NoClient)
    generation = Generation(1)
    reporter = Reporter(None, "", rank=0, node=0, generation=generation, interval=INTERVAL)
    reporter._address = "127.0.0.1:1"  # a heartbeat thread of its own, as with a controller
    began = [float("inf")]
    beats: list[float] = []

    def beat(_client: object) -> None:  # the controller's reply to one heartbeat
        now = time.monotonic()
        beats.append(now)
        aborted = now - began[0] >= ABORT_AT
        generation.heard(abort_generation=1 if aborted else 0, end_generation=0)

    monkeypatch.setattr(reporter, "_beat", beat)
    store = torch.distributed.HashStore()
    peer_built, done = threading.Event(), threading.Event()

    def silent_peer() -> None:
        group = _group(store, 1, None)
        peer_built.set()
        done.wait(30)  # never joins the all-reduce
        del group

    peer = threading.Thread(target=silent_peer, daemon=True)
    peer.start()
    group = _group(store, 0, generation)
    assert peer_built.wait(30)
    thread = threading.Thread(target=reporter._beat_forever, daemon=True)
    thread.start()
    time.sleep(0.2)  # the thread's first beat has gone: the next is due INTERVAL later
    began[0] = time.monotonic()
    try:
        with pytest.raises(CollectiveError, match="aborted"):
            group.allreduce_sum(torch.ones(4))
        heard_after = time.monotonic() - began[0]
    finally:
        done.set()
        reporter._closing.set()
        reporter.beat_now()
        thread.join(timeout=5)
    assert heard_after < ABORT_AT + 1.0, heard_after  # not at the 5 s beat
    asked = [at - began[0] for at in beats if at > began[0]]
    assert len(asked) >= 3 and asked[0] >= ASK_CONTROLLER_AFTER_S - 0.01, asked  # after a long wait only
    # ... and then again every ASK_AGAIN_S, not every ASK_CONTROLLER_AFTER_S: the abort is heard soon.
    gaps = sorted(later - earlier for earlier, later in pairwise(asked))
    assert gaps[len(gaps) // 2] < (ASK_AGAIN_S + ASK_CONTROLLER_AFTER_S) / 2, asked


def test_a_collective_that_completes_at_once_asks_nothing() -> None:
    asked: list[int] = []

    def body(group: GenerationGroup) -> torch.Tensor:
        for _ in range(20):
            tensor = torch.full((4,), float(group.rank + 1))
            group.allreduce_sum(tensor)
        return tensor

    results = run_ranks(2, body, prefix="quick", options=lambda rank: {"ask_controller": lambda: asked.append(rank)})
    assert all(torch.equal(tensor, torch.full((4,), 3.0)) for tensor in results)
    assert asked == []
