"""A rank votes yes only once the RNG state its next step starts from is in the job's store: a rank
lost right after the vote (its peers apply the step) is replaced with exactly that state. The write
starts when the step's last forward ends, so the store's round trip overlaps the backward pass.

A real StepTransaction and RngMirror; the store is a stand-in whose writes land only when the test
lets them, and the group records when the vote's all-reduce comes."""

from __future__ import annotations

import threading
from typing import Any

import torch

from undying.config import JobSpec
from undying.runtime.rng_mirror import RngMirror
from undying.runtime.step_transaction import StepTransaction
from undying.runtime.training_state import TrainingState


class HeldStore:
    """A store whose writes wait for ``release``: a slow store, or a write still in flight."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.keys: list[str] = []

    def set(self, key: str, value: bytes) -> None:
        self.release.wait(10)
        self.keys.append(key)

    def delete_key(self, key: str) -> bool:
        return True

    def check(self, keys: list[str]) -> bool:
        return False  # an empty store: no index listed before


class Group:
    world_size = 1

    def __init__(self, store: HeldStore) -> None:
        self.store = store
        self.keys_at_vote: list[str] | None = None

    def allreduce_sum(self, tensor: torch.Tensor) -> None:
        self.keys_at_vote = list(self.store.keys)


class Membership:
    rank = 2

    def __init__(self, group: Group) -> None:
        self.group = group

    def current_group(self) -> Group:
        return self.group

    def aborted(self) -> bool:
        return False


class Reporter:
    def update(self, **fields: Any) -> None:
        pass

    def emit(self, kind: str, step: int | None = None, **details: Any) -> None:
        pass

    def confirm_generation(self, lease: float, since: float | None = None) -> bool:
        return False


class NoInjections:
    def at_step_start(self, step: int) -> None:
        pass

    def poisoned(self, step: int) -> bool:
        return False

    def slowdown(self, step: int) -> float:
        return 1.0

    def at_point(self, point: str, step: int) -> None:
        pass


def transaction(store: HeldStore) -> tuple[StepTransaction, Group]:
    state = TrainingState(holds_state=True, rank=2)
    state.committed_step = 7
    group = Group(store)
    mirror = RngMirror(store, "job", rank=2, reporter=Reporter())  # type: ignore[arg-type]
    step = StepTransaction(JobSpec(), state, Membership(group), Reporter(), mirror,  # type: ignore[arg-type]
                           NoInjections(), torch.device("cpu"))  # type: ignore[arg-type]
    step.begin(7)
    return step, group


def test_the_vote_waits_for_the_next_steps_rng_to_be_in_the_store() -> None:
    store = HeldStore()
    step, group = transaction(store)
    committed: list[bool] = []
    voting = threading.Thread(target=lambda: committed.append(step.commit()))
    voting.start()
    voting.join(0.5)
    assert voting.is_alive() and group.keys_at_vote is None, "voted before its RNG was mirrored"
    store.release.set()
    voting.join(10)
    assert committed == [True]
    assert group.keys_at_vote == ["job/rng/2/8", "job/rng/2/index"], group.keys_at_vote


def test_the_write_starts_when_the_last_forward_ends_and_is_not_repeated_at_the_commit() -> None:
    store = HeldStore()
    step, group = transaction(store)
    step.forward_done()  # the step's batches are taken (it has no loader): the write goes out now
    step.forward_done()  # once a step
    store.release.set()
    assert step.commit()
    assert store.keys == ["job/rng/2/8", "job/rng/2/index"], store.keys
    assert group.keys_at_vote == store.keys


def test_rng_drawn_after_the_forward_is_written_again_before_the_vote() -> None:
    store = HeldStore()
    store.release.set()
    step, group = transaction(store)
    step.forward_done()
    torch.rand(3)  # the step draws after its forward: the early write is not the state to mirror
    assert step.commit()
    assert store.keys == ["job/rng/2/8", "job/rng/2/index"] * 2, store.keys
    assert group.keys_at_vote == store.keys


def test_steps_that_draw_nothing_leave_the_write_to_the_commit_which_still_mirrors_a_draw() -> None:
    store = HeldStore()
    store.release.set()
    step, group = transaction(store)
    step.forward_done()
    assert step.commit()
    assert store.keys == ["job/rng/2/8", "job/rng/2/index"], store.keys

    step.state.committed_step = 8
    step.begin(8)
    step.forward_done()  # the state is the one mirrored: nothing to write, and the steps draw nothing
    assert step.commit()
    assert len(store.keys) == 2 and not step.rng_moves, store.keys

    step.state.committed_step = 9
    step.begin(9)
    torch.rand(3)  # this step's forward draws
    step.forward_done()
    step.rng_mirror.wait()
    assert len(store.keys) == 2, "an early write after a step that drew nothing"
    assert step.commit()
    assert group.keys_at_vote == store.keys == ["job/rng/2/8", "job/rng/2/index", "job/rng/2/10", "job/rng/2/index"]
    assert step.rng_moves  # the next step's forward starts its write early again

    step.state.committed_step = 10
    step.begin(10)
    torch.rand(3)
    step.forward_done()
    step.rng_mirror.wait()
    assert store.keys[-2:] == ["job/rng/2/11", "job/rng/2/index"], store.keys
