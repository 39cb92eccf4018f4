"""``checkpoint.snapshot_interval: auto``: the interval chosen against the budget, the agreement that
makes every rank snapshot at the same steps, and the spec fields."""

from __future__ import annotations

import json
import random

import pytest
import torch.distributed as dist

from undying.config import load_job_spec
from undying.config.errors import SpecError
from undying.config.loading import spec_from_json, spec_to_dict
from undying.runtime.snapshot_cadence import (
    LOWER_MARGIN,
    START_INTERVAL,
    CadenceStore,
    SnapshotCadence,
    choose_interval,
    round_steps,
)

# ------------------------------------------------------------------ the decision


def test_the_chosen_interval_is_the_smallest_within_the_budget() -> None:
    # A 10 ms snapshot against 100 ms steps is 10 % at every step: 2 % needs every 5th step.
    assert choose_interval(1, 0.010, 0.100, 0.02, most=100) == 5
    assert choose_interval(1, 0.010, 0.100, 0.10, most=100) == 1
    assert choose_interval(1, 0.0, 0.100, 0.02, most=100) == 1


def test_the_interval_stays_within_one_and_the_checkpoint_interval() -> None:
    assert choose_interval(1, 5.0, 0.1, 0.02, most=10) == 10  # the budget cannot be met: the cap
    assert choose_interval(7, 0.0, 0.1, 0.02, most=10) == 1
    assert choose_interval(40, 0.05, 0.1, 0.02, most=10) == 10  # a smaller cap than the current interval
    assert choose_interval(3, 0.01, 0.0, 0.02, most=10) == 3  # no step time measured: unchanged


def test_random_inputs_meet_the_budget_unless_capped_and_a_second_decision_changes_nothing() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        current, most = rng.randint(1, 200), rng.randint(1, 200)
        stall, step, budget = rng.uniform(0, 2), rng.uniform(0.001, 2), rng.uniform(0.001, 0.5)
        chosen = choose_interval(current, stall, step, budget, most)
        assert 1 <= chosen <= most
        if chosen < most:
            assert stall / (chosen * step) <= budget * (1 + 1e-9)
        assert choose_interval(chosen, stall, step, budget, most) == chosen


def test_a_small_drift_does_not_flap_the_interval() -> None:
    # At interval 5 the cost is 2 %; a little cheaper (4 would cost 2.4 %) keeps 5, until 4 fits in 80 %.
    assert choose_interval(5, 0.0095, 0.100, 0.02, most=100) == 5
    cheap = 0.02 * LOWER_MARGIN * 4 * 0.100
    assert choose_interval(5, cheap, 0.100, 0.02, most=100) == 4


def test_rounds_follow_the_checkpoint_interval_up_to_a_bound() -> None:
    assert round_steps(1) == 1
    assert round_steps(10) == 10
    assert round_steps(1000) == round_steps(100) < 100


# ------------------------------------------------------------------ the agreement between ranks


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FailingStore:
    """A store whose host froze: every call fails as a bounded store's does."""

    def add(self, key: str, amount: int) -> int:
        raise RuntimeError("store did not answer within 5 s")

    def delete_key(self, key: str) -> bool:
        raise RuntimeError("store did not answer within 5 s")


class Job:
    """``ranks`` cadences over one store, committing in lockstep; rank r's steps take ``step_times[r]``
    seconds and its snapshots stall it ``stalls[r]`` seconds (None: it never measures one)."""

    def __init__(self, step_times: list[float], stalls: list[float | None], most: int = 10,
                 budget: float = 0.02) -> None:
        self.store = dist.HashStore()
        self.step_times, self.stalls = step_times, stalls
        self.clocks = [Clock() for _ in step_times]
        self.stores: list[CadenceStore] = [self.store for _ in step_times]
        self.cadences = [SnapshotCadence(budget, most, lambda rank=rank: self.stores[rank], "job", clock)
                         for rank, clock in enumerate(self.clocks)]
        self.snapshotted = [False for _ in step_times]
        self.generation = 1
        self.members = list(range(len(step_times)))

    def run(self, first: int, last: int) -> dict[int, list[int]]:
        """Commit steps first..last; step -> the interval in force on each member after it."""
        intervals: dict[int, list[int]] = {}
        for step in range(first, last + 1):
            for place, rank in enumerate(self.members):
                cadence, clock = self.cadences[rank], self.clocks[rank]
                stall = self.stalls[rank] if self.snapshotted[rank] else None
                clock.now += self.step_times[rank] + (stall or 0.0)
                cadence.committed(step, self.generation, place, len(self.members), stall)
                self.snapshotted[rank] = cadence.due(step) and self.stalls[rank] is not None
            intervals[step] = [self.cadences[rank].interval for rank in self.members]
        return intervals


def test_ranks_with_different_measurements_snapshot_at_the_same_steps() -> None:
    # Mean stall 10 ms, mean step 100 ms: 10 % at every step, 2 % at every 5th.
    job = Job(step_times=[0.090, 0.100, 0.110, 0.100], stalls=[0.006, 0.010, 0.014, 0.010])
    intervals = job.run(1, 60)
    assert all(len(set(each)) == 1 for each in intervals.values()), intervals
    rounds = job.cadences[0].round
    assert intervals[2 * rounds - 1] == [START_INTERVAL] * 4  # the first round's sums are read a round later
    assert intervals[2 * rounds] == [5] * 4
    assert intervals[60] == [5] * 4


def test_a_rank_without_measurements_holds_every_rank_at_its_interval() -> None:
    job = Job(step_times=[0.1, 0.1], stalls=[0.05, None])
    intervals = job.run(1, 50)
    assert all(each == [START_INTERVAL, START_INTERVAL] for each in intervals.values())


def test_a_new_generation_starts_over_on_every_rank_and_agrees_again() -> None:
    job = Job(step_times=[0.1, 0.1, 0.1], stalls=[0.01, 0.01, 0.01])
    assert job.run(1, 30)[30] == [5, 5, 5]
    # Rank 2 is replaced (a fresh process) and the others recover into generation 2 at step 30.
    job.generation = 2
    job.cadences[2] = SnapshotCadence(0.02, 10, lambda: job.store, "job", job.clocks[2])
    intervals = job.run(31, 60)
    assert intervals[31] == [START_INTERVAL] * 3
    assert all(len(set(each)) == 1 for each in intervals.values()), intervals
    assert intervals[60] == [5, 5, 5]


def test_ranks_that_missed_a_round_come_back_to_the_agreed_interval() -> None:
    job = Job(step_times=[0.1, 0.1, 0.1], stalls=[0.01, 0.01, 0.01])
    rounds = job.cadences[0].round
    job.stores[1] = FailingStore()  # rank 1's store calls fail for a while: no error reaches training
    intervals = job.run(1, 3 * rounds)
    assert intervals[3 * rounds] == [START_INTERVAL] * 3  # its missing report holds everyone back
    job.stores[1] = job.store
    intervals = job.run(3 * rounds + 1, 6 * rounds)
    assert intervals[6 * rounds] == [5, 5, 5]
    assert all(len(set(each)) == 1 for each in intervals.values()), intervals


def test_the_store_holds_only_the_last_rounds() -> None:
    job = Job(step_times=[0.1, 0.1], stalls=[0.01, 0.01])
    job.run(1, 20 * job.cadences[0].round)
    assert job.store.num_keys() <= 3 * 4


def test_a_diverged_rank_is_brought_back_by_the_shared_sums() -> None:
    job = Job(step_times=[0.1, 0.1, 0.1], stalls=[0.01, 0.01, 0.01])
    job.run(1, 30)
    job.cadences[1].interval = 9  # as if it alone had applied another round's decision
    intervals = job.run(31, 60)
    assert intervals[60] == [5, 5, 5]


def test_a_checkpoint_interval_of_one_never_exchanges() -> None:
    job = Job(step_times=[0.1, 0.1], stalls=[0.05, 0.05], most=1)
    intervals = job.run(1, 40)
    assert all(each == [1, 1] for each in intervals.values())
    assert job.store.num_keys() == 0


# ------------------------------------------------------------------ the spec


def test_auto_is_a_snapshot_interval_and_travels_as_json() -> None:
    spec = load_job_spec(overrides={"checkpoint.snapshot_interval": "auto", "checkpoint.snapshot_budget": 0.05})
    assert (spec.checkpoint.snapshot_interval, spec.checkpoint.snapshot_budget) == ("auto", 0.05)
    assert spec_from_json(json.dumps(spec_to_dict(spec))) == spec
    assert load_job_spec().checkpoint.snapshot_budget == 0.01


def test_auto_is_the_default_and_a_fixed_interval_is_kept() -> None:
    """Out of the box the interval is chosen against the 2 % budget; a user's number is taken as is."""
    assert load_job_spec().checkpoint.snapshot_interval == "auto"
    assert load_job_spec(overrides={"checkpoint.snapshot_interval": 1}).checkpoint.snapshot_interval == 1


@pytest.mark.parametrize(("field", "value", "message"), [
    ("checkpoint.snapshot_interval", "often",
     "job spec: checkpoint.snapshot_interval: not an integer or auto; allowed: an integer >= 0, or auto (got 'often')"),
    ("checkpoint.snapshot_interval", True,
     "job spec: checkpoint.snapshot_interval: not an integer or auto; allowed: an integer >= 0, or auto (got True)"),
    ("checkpoint.snapshot_interval", 2.5,
     "job spec: checkpoint.snapshot_interval: not an integer or auto; allowed: an integer >= 0, or auto (got 2.5)"),
    ("checkpoint.snapshot_budget", 0, "job spec: checkpoint.snapshot_budget: out of range; allowed: > 0 and < 1 (got 0)"),
    ("checkpoint.snapshot_budget", 2, "job spec: checkpoint.snapshot_budget: out of range; allowed: > 0 and < 1 (got 2)"),
    ("checkpoint.snapshot_budget", "2%",
     "job spec: checkpoint.snapshot_budget: not a number; allowed: > 0 and < 1 (got '2%')"),
    ("checkpoint.snapshot_budget", True,
     "job spec: checkpoint.snapshot_budget: not a number; allowed: > 0 and < 1 (got True)"),
])
def test_bad_cadence_fields_are_one_line_naming_field_and_range(field: str, value: object, message: str) -> None:
    with pytest.raises(SpecError) as raised:
        load_job_spec(overrides={field: value})
    assert str(raised.value) == message

