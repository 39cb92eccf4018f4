"""The RNG mirror (runtime/rng_mirror.py) against a real TCPStore: a write started before the vote
holds the RNG state of the moment it was started, is in the store once ``wait`` returns, keeps only the
last few changes, writes nothing for a step whose state did not change (a reader finds that step's
state under the last change), and an unreachable store becomes an event sent from the training thread."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from undying import events as ev
from undying.runtime.bounded_store import BoundedStore
from undying.runtime.rng import capture_rng, same_rng
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
        torch.rand(1)  # each step draws: each one's state is a change
        mirror.write_rng(step)
    assert not server.check([mirror.key(11)]) and not server.check([mirror.key(12)])
    assert server.check([mirror.key(12 + KEEP)])
    assert reporter.events == []


class CountingStore:
    """A real TCPStore client that counts the calls made on it."""

    def __init__(self, port: int) -> None:
        self.client = dist.TCPStore("127.0.0.1", port, is_master=False)
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        return getattr(self.client, name)


def test_a_step_whose_state_did_not_change_costs_no_store_call_and_reads_as_the_last_change() -> None:
    server = store_server()
    counting: list[CountingStore] = []

    def connect() -> CountingStore:
        counting.append(CountingStore(server.port))
        return counting[-1]

    mirror = RngMirror(BoundedStore(connect, timeout=5.0), "job", rank=0, reporter=Reporter())  # type: ignore[arg-type]
    torch.manual_seed(1)
    at_5 = capture_rng()
    mirror.write_rng(5)
    calls = len(counting[0].calls)
    for step in range(6, 20):  # steps that draw no random number
        mirror.write_rng(step)
    assert len(counting[0].calls) == calls, counting[0].calls[calls:]
    assert not server.check([mirror.key(19)])
    torch.manual_seed(99)
    assert torch.equal(mirror.read(19)["torch"], at_5["torch"])  # from the change at step 5
    torch.rand(1)
    at_20 = capture_rng()
    mirror.write_rng(20)
    assert torch.equal(mirror.read(20)["torch"], at_20["torch"])
    assert torch.equal(mirror.read(19)["torch"], at_5["torch"])  # steps before the change keep theirs
    assert mirror.read(4) == {}  # before any mirrored change: not mirrored


def test_a_step_given_up_and_begun_again_drops_the_later_change_and_a_new_writer_keeps_the_older_ones() -> None:
    server = store_server()

    def client() -> BoundedStore:
        return BoundedStore(lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False), timeout=5.0)

    mirror = RngMirror(client(), "job", rank=1, reporter=Reporter())  # type: ignore[arg-type]
    torch.manual_seed(3)
    at_3 = capture_rng()
    mirror.write_rng(3)
    torch.rand(1)
    mirror.write_rng(4)  # step 4's state, written before its vote; the step is then given up
    torch.set_rng_state(at_3["torch"])  # rolled back to the commit of step 3
    mirror.write_rng(3)
    assert not server.check([mirror.key(4)])
    # A replacement process mirrors the same rank from step 6 on: step 5 still reads as step 3's change.
    replacement = RngMirror(client(), "job", rank=1, reporter=Reporter())  # type: ignore[arg-type]
    torch.manual_seed(6)
    replacement.write_rng(6)
    assert torch.equal(replacement.read(5)["torch"], at_3["torch"])
    assert replacement.read(6)["torch"].equal(capture_rng()["torch"])


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
        torch.rand(1, generator=None)
        slot_2, slot_3 = capture_rng(), {**slot_3, "python": (3, tuple(range(625)) + (step,), None)}
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

    def check(self, keys: list[str]) -> bool:
        self.release.wait()
        return False


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
    torch.rand(1)
    mirror.write_rng(10)
    assert server.check([mirror.key(10)]) and reporter.events == []


def test_after_a_recovery_a_rank_lists_the_changes_another_process_wrote_under_its_key_meanwhile() -> None:
    """Rank 1 mirrored steps 10-12; while the job was shrunk, rank 0 covered its slot and mirrored its
    stream at steps 20 and 25. Back to its own slot after the grow (step 30), rank 1 lists those too."""
    server = store_server()

    def client() -> BoundedStore:
        return BoundedStore(lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False), timeout=5.0)

    own = RngMirror(client(), "job", rank=1, reporter=Reporter())  # type: ignore[arg-type]
    coverer = RngMirror(client(), "job", rank=0, reporter=Reporter())  # type: ignore[arg-type]
    for step in (10, 11, 12):
        torch.manual_seed(step)
        own.write_rng(step)
    covered = {}
    for step in (20, 25):
        torch.manual_seed(step)
        covered[step] = capture_rng()
        coverer.write_rng(step, {1: covered[step]})
    own.forget_written()
    torch.manual_seed(30)
    own.write_rng(30)
    assert torch.equal(own.read(27)["torch"], covered[25]["torch"])
    assert torch.equal(own.read(22)["torch"], covered[20]["torch"])


def test_same_rng_sees_a_draw_from_every_generator_and_numpys_cached_gaussian() -> None:
    """The mirror re-sends the last encoding while ``same_rng`` says nothing moved: a draw from any
    generator must count as a move, NumPy's second gaussian too (it comes from a cache and leaves the
    Mersenne Twister's key and position as they were)."""
    import random

    import numpy

    numpy.random.seed(5)
    numpy.random.standard_normal()  # draws two gaussians, caches the second
    before = capture_rng()
    assert same_rng(before, capture_rng())
    draws = [lambda: torch.rand(1), lambda: random.random(), lambda: numpy.random.rand(),
             lambda: numpy.random.standard_normal()]
    for draw in draws:
        state = capture_rng()
        draw()
        after = capture_rng()
        assert not same_rng(state, after), draw
        if draw is draws[-1]:  # the cached one: only has_gauss changed
            assert numpy.array_equal(state["numpy"][1], after["numpy"][1]) and state["numpy"][2] == after["numpy"][2]


def test_a_state_drawn_from_since_the_last_write_is_encoded_anew() -> None:
    server = store_server()
    client = BoundedStore(lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False), timeout=5.0)
    mirror = RngMirror(client, "job", rank=0, reporter=Reporter())  # type: ignore[arg-type]
    torch.manual_seed(1)
    mirror.write_rng(1)
    torch.rand(3)
    expected = capture_rng()
    mirror.write_rng(2)
    torch.manual_seed(99)
    assert torch.equal(mirror.read(2)["torch"], expected["torch"])
