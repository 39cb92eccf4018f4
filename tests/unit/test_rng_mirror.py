"""The RNG mirror (runtime/rng_mirror.py) against a real TCPStore: a write started before the vote
holds the RNG state of the moment it was started, is in the store once ``wait`` returns, keeps only the
last few steps, and an unreachable store becomes an event sent from the training thread."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from undying import events as ev
from undying.runtime.bounded_store import BoundedStore
from undying.runtime.rng import capture_rng
from undying.runtime.rng_mirror import KEEP, RngMirror


class Reporter:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any], int]] = []

    def emit(self, kind: str, step: int | None = None, **details: Any) -> None:
        self.events.append((kind, {"step": step, **details}, threading.get_ident()))


def store_server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_a_started_write_holds_the_state_of_its_start_and_is_stored_after_wait() -> None:
    server = store_server()
    client = BoundedStore(lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False), timeout=5.0)
    reporter = Reporter()
    mirror = RngMirror(client, "job", rank=3, reporter=reporter)  # type: ignore[arg-type]
    torch.manual_seed(7)
    expected = capture_rng()
    mirror.start_write_rng(11)
    torch.rand(1000)  # the step goes on drawing numbers while the write is in flight
    mirror.wait()
    assert server.check([mirror.key(11)])
    torch.manual_seed(123)
    restored = mirror.read(11)
    assert torch.equal(restored["torch"], expected["torch"]) and restored["python"] == expected["python"]
    for step in range(12, 12 + KEEP + 1):
        mirror.write_rng(step)
    assert not server.check([mirror.key(11)]) and not server.check([mirror.key(12)])
    assert server.check([mirror.key(12 + KEEP)])
    assert reporter.events == []


def test_an_unreachable_store_is_an_event_sent_by_the_thread_that_waits() -> None:
    def refuse() -> dist.Store:
        raise RuntimeError("connection refused")

    reporter = Reporter()
    mirror = RngMirror(BoundedStore(refuse, timeout=1.0), "job", rank=0, reporter=reporter)  # type: ignore[arg-type]
    mirror.start_write_rng(5)
    mirror.wait()
    [(kind, details, thread)] = reporter.events
    assert kind == ev.RNG_NOT_MIRRORED and details["step"] == 5 and details["reason"] == "store unreachable"
    assert thread == threading.get_ident()
    mirror.write_rng(6)  # the store is taken for lost until the next plan names one: no second event
    assert len(reporter.events) == 1


def test_the_streams_of_other_slots_are_mirrored_under_their_ranks_keys_and_pruned_alike() -> None:
    """While shrunk, rank 1 covers slots 2 and 3 and not its own: it writes keys 2 and 3, never 1."""
    server = store_server()
    client = BoundedStore(lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False), timeout=5.0)
    mirror = RngMirror(client, "job", rank=1, reporter=Reporter())  # type: ignore[arg-type]
    torch.manual_seed(2)
    slot_2 = capture_rng()
    torch.manual_seed(3)
    slot_3 = capture_rng()
    mirror.write_rng(7, {2: slot_2, 3: slot_3})
    assert not server.check([mirror.key(7)])
    assert torch.equal(mirror.read(7, 2)["torch"], slot_2["torch"])
    assert torch.equal(mirror.read(7, 3)["torch"], slot_3["torch"])
    for step in range(8, 8 + KEEP):
        mirror.write_rng(step, {2: slot_2, 3: slot_3})
    assert not server.check([mirror.key(7, 2)]) and not server.check([mirror.key(7, 3)])
    assert server.check([mirror.key(7 + KEEP, 2), mirror.key(7 + KEEP, 3)])


class FrozenStore:
    """A store whose host froze: every call blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def set(self, key: str, value: bytes) -> None:
        self.release.wait()

    def delete_key(self, key: str) -> bool:
        self.release.wait()
        return True


def test_a_write_stuck_on_a_frozen_store_is_given_up_when_the_generation_is_aborted_and_left_behind() -> None:
    """The store froze with the controller's node: the training thread stops waiting once the
    controller aborted the generation, and after the store moved (``use_store``) the new store gets
    the writes, whatever the stuck write's bounded end says later."""
    frozen = FrozenStore()
    reporter = Reporter()
    mirror = RngMirror(BoundedStore(lambda: frozen, timeout=30.0), "job", rank=1, reporter=reporter)  # type: ignore[arg-type]
    mirror.start_write_rng(8)
    mirror.start_write_rng(9)  # queued behind the stuck write, not waited for here
    aborted = threading.Event()
    threading.Timer(0.2, aborted.set).start()
    assert mirror.wait(abandon=aborted.is_set) is False  # given up, long before the store's 30 s bound
    server = store_server()
    mirror.use_store(BoundedStore(lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False), timeout=5.0))
    mirror.write_rng(9)
    assert server.check([mirror.key(9)])
    frozen.release.set()  # the old store's write ends (here: succeeds) after the move: it changes nothing
    mirror.write_rng(10)
    assert server.check([mirror.key(10)]) and reporter.events == []
