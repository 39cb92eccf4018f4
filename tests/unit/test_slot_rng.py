"""The RNG streams of a shrunk job's batch slots (runtime/slot_rng.py): each micro-batch of a slot draws
the numbers the slot's own rank would have drawn at full size, before the shrink, while shrunk and
after the grow back; a failed step rolls them back; a rank whose slot another covers does not mirror
its own stream, and takes it back when it covers its slot again."""

from __future__ import annotations

import torch

from undying.data import ACCUMULATE, ResumableLoader
from undying.runtime.rng import capture_rng, restore_rng
from undying.runtime.slot_rng import SlotStreams

WORLD = 2  # slots of every step; ranks of the full job


class Numbers:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


def step_of(loader: ResumableLoader) -> list[torch.Tensor]:
    """One step of a loop with dropout: a mask drawn for each batch it takes."""
    return [torch.rand(4) for _ in loader.step_batches()]


def full_size_masks(steps: int) -> list[list[torch.Tensor]]:
    """Rank by rank, each seeded on its own as nanoGPT seeds its ranks: the masks of every step."""
    masks = []
    for rank in range(WORLD):
        torch.manual_seed(100 + rank)
        loader = ResumableLoader(Numbers(), batch_size=2, seed=0, rank=rank, world_size=WORLD)
        masks.append([step_of(loader)[0] for _ in range(steps)])
    return masks


def test_a_shrunk_replica_draws_each_slots_masks_from_that_slots_rank_and_hands_them_back_at_the_grow() -> None:
    reference = full_size_masks(6)
    # Rank 1 trains 2 steps, mirrors its RNG as its boundary does, and is lost.
    torch.manual_seed(101)
    lost = ResumableLoader(Numbers(), batch_size=2, seed=0, rank=1, world_size=WORLD)
    for _ in range(2):
        step_of(lost)
    mirror = {1: capture_rng()}
    # Rank 0 alone covers both slots from step 2 on (accumulate: one micro-batch each).
    torch.manual_seed(100)
    loader = ResumableLoader(Numbers(), batch_size=2, seed=0, rank=0, world_size=WORLD)
    streams = SlotStreams(own_slot=0)
    loader.slot_draws = streams.drawing_for
    streams.set_layout(0, WORLD, per_slot=False)
    for step in range(2):
        assert torch.equal(step_of(loader)[0], reference[0][step])
    streams.set_layout(0, WORLD, per_slot=True)
    loader.set_replicas(0, 1, ACCUMULATE)
    assert streams.missing() == [1]
    streams.take(1, mirror[1])
    for step in range(2, 4):
        own, other = step_of(loader)
        assert torch.equal(own, reference[0][step]) and torch.equal(other, reference[1][step]), step
    streams.mark_commit_boundary()
    own = capture_rng()
    mirror = streams.mirrored(own, committed=True)
    assert sorted(mirror) == [0, 1]
    # Grown back: rank 1's replacement takes slot 1's stream from the mirror, where rank 0 wrote it.
    streams.set_layout(0, 1, per_slot=False)
    loader.reshard(0, WORLD)
    assert streams.missing() == []
    torch.manual_seed(999)
    back = SlotStreams(own_slot=1)
    back.set_layout(1, 1, per_slot=False)
    back.forget()
    assert back.missing() == [1]
    back.take(1, mirror[1])
    grown = ResumableLoader(Numbers(), batch_size=2, seed=0, rank=1, world_size=WORLD)
    for step in range(4, 6):
        assert torch.equal(step_of(grown)[0], reference[1][step])
    restore_rng(own)  # rank 0's process, from here on
    for step in range(4, 6):
        assert torch.equal(step_of(loader)[0], reference[0][step])


def test_a_rank_whose_slot_another_covers_mirrors_only_the_streams_it_draws_and_takes_its_own_back() -> None:
    streams = SlotStreams(own_slot=1)
    streams.set_layout(2, 2, per_slot=True)  # 4 slots over 2 replicas: rank 1 (the second) covers 2 and 3
    assert streams.missing() == [2, 3]
    streams.take(2, None)  # not mirrored: the process's RNG stands in
    streams.take(3, capture_rng())
    streams.mark_commit_boundary()
    assert sorted(streams.mirrored(capture_rng(), committed=True)) == [2, 3]
    streams.set_layout(1, 1, per_slot=False)  # grown back: its own slot again, its stream from the mirror
    assert streams.missing() == [1] and streams.streams == {}
    torch.manual_seed(5)
    slot_1 = capture_rng()
    torch.manual_seed(6)
    streams.take(1, slot_1)
    assert torch.equal(torch.get_rng_state(), slot_1["torch"])
    assert streams.missing() == [] and sorted(streams.mirrored(capture_rng(), committed=False)) == [1]


def test_a_failed_step_rolls_the_streams_back_and_a_late_closed_micro_batch_changes_nothing() -> None:
    streams = SlotStreams(own_slot=0)
    streams.set_layout(0, 2, per_slot=True)
    torch.manual_seed(1)
    streams.take(1, capture_rng())
    streams.mark_commit_boundary()
    first = None
    with streams.drawing_for(1):
        first = torch.rand(3)
    streams.roll_back()
    with streams.drawing_for(1):
        assert torch.equal(torch.rand(3), first)
    # A step fails inside slot 1's micro-batch; its scope is closed only after the rollback.
    streams.roll_back()
    torch.manual_seed(2)
    own = capture_rng()
    scope = streams.drawing_for(1)
    scope.__enter__()
    torch.rand(3)
    restore_rng(own)  # the recovery puts the committed RNG back ...
    streams.roll_back()  # ... and the committed streams
    scope.__exit__(None, None, None)
    assert torch.equal(torch.get_rng_state(), own["torch"])
    with streams.drawing_for(1):
        assert torch.equal(torch.rand(3), first)
    # In a snapshot and back.
    saved = streams.state_dict()
    again = SlotStreams(own_slot=0)
    again.set_layout(0, 2, per_slot=True)
    again.load_state_dict(saved)
    with again.drawing_for(1):
        assert torch.equal(torch.rand(3), first)


def test_a_slot_without_a_stream_starts_one_from_the_process_rng_and_keeps_it() -> None:
    """Restored at the shrunk size from a checkpoint written at full size (no streams of other slots):
    the first micro-batch of slot 1 starts its stream from the process's RNG; then it is kept."""
    streams = SlotStreams(own_slot=0)
    streams.set_layout(0, 2, per_slot=True)
    torch.manual_seed(4)
    expected = torch.rand(3)
    torch.manual_seed(4)
    with streams.drawing_for(1):
        assert torch.equal(torch.rand(3), expected)
    assert torch.equal(torch.rand(3), expected)  # the process's own stream did not move
    streams.mark_commit_boundary()
    assert sorted(streams.mirrored(capture_rng(), committed=True)) == [0, 1]
