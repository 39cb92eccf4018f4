"""ResumableLoader: deterministic order, exactly-once consumption, resume, reshard, errors."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from undying.data import ResumableLoader


class RangeDataset:
    """Item i is the tensor [i], so a batch shows which indices it holds."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index])


def make_world(dataset, batch_size: int, world_size: int, seed: int = 7) -> list[ResumableLoader]:
    return [ResumableLoader(dataset, batch_size, seed, rank, world_size) for rank in range(world_size)]


def global_step(loaders: list[ResumableLoader]) -> list[int]:
    """One training step on every rank; the indices in rank order (the global batch)."""
    consumed = []
    for loader in loaders:
        batch = next(loader)
        assert batch.flatten().tolist() == loader.last_indices
        consumed.extend(loader.last_indices)
    return consumed


def epoch_order(length: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(length, generator=generator).tolist()


def test_order_is_deterministic_and_follows_the_documented_permutation():
    dataset = RangeDataset(50)
    first, again = make_world(dataset, 3, 2), make_world(dataset, 3, 2)
    assert [global_step(first) for _ in range(20)] == [global_step(again) for _ in range(20)]

    loaders = make_world(dataset, 3, 2)
    consumed = [index for _ in range(8) for index in global_step(loaders)]
    assert consumed == epoch_order(50, seed=7, epoch=0)[:48]


def test_different_seeds_give_different_orders():
    dataset = RangeDataset(64)
    a = ResumableLoader(dataset, 8, seed=1, rank=0, world_size=1)
    b = ResumableLoader(dataset, 8, seed=2, rank=0, world_size=1)
    next(a), next(b)
    assert a.last_indices != b.last_indices


def test_all_ranks_consume_each_index_once_per_epoch():
    length, batch_size, world_size = 103, 4, 3  # 8 global batches of 12, remainder 7 dropped
    loaders = make_world(RangeDataset(length), batch_size, world_size)
    consumed = []
    while loaders[0].epoch == 0:
        consumed.extend(global_step(loaders))
    counts = Counter(consumed)
    assert len(consumed) == 96
    assert max(counts.values()) == 1
    dropped = set(range(length)) - set(counts)
    assert dropped == set(epoch_order(length, seed=7, epoch=0)[96:])


def test_epoch_rollover_drops_the_remainder_and_reshuffles():
    loader = ResumableLoader(RangeDataset(10), batch_size=3, seed=0, rank=0, world_size=1)
    for expected_position in (3, 6, 0):
        next(loader)
        assert loader.position == expected_position
    assert loader.epoch == 1  # 1 sample left, fewer than a batch: epoch 0 ended
    next(loader)
    assert loader.last_indices == epoch_order(10, seed=0, epoch=1)[:3]
    assert epoch_order(10, seed=0, epoch=1) != epoch_order(10, seed=0, epoch=0)


def test_resume_mid_epoch_matches_uninterrupted_run():
    dataset = RangeDataset(40)
    reference = make_world(dataset, 2, 4)
    expected = [global_step(reference) for _ in range(12)]  # crosses into epoch 2

    first = make_world(dataset, 2, 4)
    got = [global_step(first) for _ in range(3)]
    states = [loader.state_dict() for loader in first]
    assert states[0] == {"epoch": 0, "position": 24, "seed": 7, "dataset_len": 40}
    assert all(type(value) is int for value in states[0].values())

    resumed = make_world(dataset, 2, 4)
    for loader, state in zip(resumed, states, strict=True):
        loader.load_state_dict(state)
    got += [global_step(resumed) for _ in range(9)]
    assert got == expected


def test_reshard_4_to_2_to_4_keeps_global_order_exactly_once():
    length, seed = 96, 3
    dataset = RangeDataset(length)
    loaders = make_world(dataset, 2, 4, seed=seed)  # global batch 8
    consumed = [i for _ in range(3) for i in global_step(loaders)]

    # Two ranks survive; each doubles its batch so the global batch stays 8.
    survivors = loaders[:2]
    for rank, loader in enumerate(survivors):
        loader.reshard(rank, 2, batch_size=4)
    consumed += [i for _ in range(4) for i in global_step(survivors)]

    # Capacity returns: two newcomers restore the data position from a survivor.
    newcomers = [ResumableLoader(dataset, 2, seed, rank, 4) for rank in (2, 3)]
    for loader in newcomers:
        loader.load_state_dict(survivors[0].state_dict())
    for rank, loader in enumerate(survivors):
        loader.reshard(rank, 4, batch_size=2)
    grown = survivors + newcomers
    while grown[0].epoch == 0:
        consumed += global_step(grown)

    assert consumed == epoch_order(length, seed, epoch=0)
    assert all(loader.position == 0 and loader.epoch == 1 for loader in grown)


def test_reshard_to_a_smaller_global_batch_keeps_position():
    dataset = RangeDataset(30)
    loaders = make_world(dataset, 3, 2)  # global batch 6
    consumed = global_step(loaders)
    single = loaders[0]
    single.reshard(0, 1)  # global batch 3
    assert single.position == 6
    consumed += global_step([single])
    assert consumed == epoch_order(30, seed=7, epoch=0)[:9]


def test_collate_fn_is_used():
    loader = ResumableLoader(RangeDataset(8), 2, seed=0, rank=1, world_size=2, collate_fn=list)
    batch = next(loader)
    assert isinstance(batch, list) and [item.item() for item in batch] == loader.last_indices


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"rank": 4}, "rank must be in"),
        ({"rank": -1}, "rank must be in"),
        ({"world_size": 0, "rank": 0}, "world_size must be >= 1"),
        ({"batch_size": 5}, "fewer than one global batch of 20"),
    ],
)
def test_invalid_arguments_raise(kwargs, message):
    arguments = {"batch_size": 4, "seed": 0, "rank": 0, "world_size": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        ResumableLoader(RangeDataset(16), **arguments)


def test_reshard_validates():
    loader = ResumableLoader(RangeDataset(16), 4, seed=0, rank=0, world_size=2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        loader.reshard(0, 8)
    with pytest.raises(ValueError, match="rank must be in"):
        loader.reshard(2, 2)
    assert (loader.rank, loader.world_size, loader.batch_size) == (0, 2, 4)


@pytest.mark.parametrize(("field", "value"), [("seed", 1), ("dataset_len", 17)])
def test_load_state_dict_rejects_other_seed_or_dataset(field, value):
    loader = ResumableLoader(RangeDataset(16), 4, seed=0, rank=0, world_size=1)
    state = loader.state_dict() | {field: value}
    with pytest.raises(ValueError, match=field):
        loader.load_state_dict(state)


def test_load_state_dict_rejects_missing_fields():
    loader = ResumableLoader(RangeDataset(16), 4, seed=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match="position"):
        loader.load_state_dict({"epoch": 0, "seed": 0, "dataset_len": 16})


def elastic_step(loaders: list[ResumableLoader]) -> list[int]:
    """One step of a shrunk world: every replica takes all its batches of the step."""
    consumed = []
    for loader in loaders:
        taken = [index for batch in loader.step_batches() for index in batch.flatten().tolist()]
        assert taken == loader.step_indices
        consumed.extend(taken)
    return consumed


@pytest.mark.parametrize("mode", ["accumulate", "grow"])
def test_an_elastic_shrink_and_grow_keeps_every_steps_samples(mode):
    """4 replicas -> 2 (after a node loss) -> 3 (uneven) -> 4: each step uses exactly the samples
    a fixed 4-replica job uses in that step, and each epoch's samples exactly once."""
    dataset = RangeDataset(100)  # 6 steps of 16 per epoch, 4 left over (dropped)
    reference = make_world(dataset, 4, 4)
    fixed = [sorted(global_step(reference)) for _ in range(14)]

    elastic = make_world(dataset, 4, 4)
    seen = [sorted(global_step(elastic)) for _ in range(3)]
    survivors = [elastic[0], elastic[1]]
    for replica, loader in enumerate(survivors):
        loader.set_replicas(replica, 2, mode)
    assert [(loader.first_slot, loader.slot_count, loader.micro_batches) for loader in survivors] == \
        [(0, 2, 2 if mode == "accumulate" else 1), (2, 2, 2 if mode == "accumulate" else 1)]
    seen += [sorted(elastic_step(survivors)) for _ in range(5)]
    three = survivors + [ResumableLoader(dataset, 4, 7, 2, 4)]
    three[2].load_state_dict(survivors[0].state_dict())
    for replica, loader in enumerate(three):
        loader.set_replicas(replica, 3, mode)
    assert [(loader.first_slot, loader.slot_count) for loader in three] == [(0, 2), (2, 1), (3, 1)]
    seen += [sorted(elastic_step(three)) for _ in range(3)]
    for replica, loader in enumerate(three + [elastic[3]]):
        loader.reshard(replica, 4)
    elastic[3].load_state_dict(three[0].state_dict())
    seen += [sorted(global_step(three + [elastic[3]])) for _ in range(3)]
    assert seen == fixed
    for epoch in range(2):
        used = Counter(index for step in seen[epoch * 6:(epoch + 1) * 6] for index in step)
        assert len(used) == 96 and set(used.values()) == {1}


def test_a_shrunk_step_not_finished_is_detected_and_begin_step_forgets_it():
    loader = ResumableLoader(RangeDataset(64), 4, 0, 0, 4)
    loader.set_replicas(0, 2, "accumulate")
    next(loader)
    assert loader.step_incomplete()
    assert loader.position == 0
    loader.begin_step()
    assert not loader.step_incomplete()
    assert len(list(loader.step_batches())) == 2
    assert loader.position == 16 and not loader.step_incomplete()


def test_set_replicas_rejects_bad_values_with_one_line():
    loader = ResumableLoader(RangeDataset(64), 4, 0, 0, 4)
    with pytest.raises(ValueError, match="elastic_batch must be one of accumulate, grow, got 'half'"):
        loader.set_replicas(0, 2, "half")
    with pytest.raises(ValueError, match="replica 2 of 2 does not fit a world of 4 slots"):
        loader.set_replicas(2, 2)


def test_with_the_default_elastic_batch_one_next_per_step_takes_the_whole_share():
    """A loop that calls next() once per step (most loops) runs on through a shrink unchanged."""
    from undying.config import JobSpec

    loader = ResumableLoader(RangeDataset(64), 4, 0, 0, 4)
    loader.set_replicas(0, 2, JobSpec().elastic_batch)
    batch = next(loader)
    assert not loader.step_incomplete()
    assert batch.flatten().tolist() == epoch_order(64, seed=0, epoch=0)[:8]
    assert loader.position == 16
