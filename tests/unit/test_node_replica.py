"""A data-parallel replica kept once per node in T1 (checkpoint/node_replica.py): the deal of the
replica's bytes to local ranks (a tensor split where a boundary falls in it), a node snapshot put back
together bitwise, a step that a local rank lacks (never written,
or torn) not offered, and the T2 writer's whole snapshot used as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_snapshot import assert_same, training_state
from undying.checkpoint.node_replica import PART, REPLICA, NodeReplica, deal, replica_part
from undying.checkpoint.snapshot import RankSnapshots
from undying.checkpoint.state_tree import flatten_state

LOCAL_RANKS = [2, 3]  # node 1 of a job with 2 ranks per node


def part_bytes(pieces: list[tuple[int, int, int]], element_sizes: list[int]) -> int:
    return sum((stop - first) * element_sizes[index] for index, first, stop in pieces)


def test_the_deal_splits_bytes_evenly_and_is_the_same_for_every_rank() -> None:
    # An embedding of 4000 bytes beside small tensors: dealt whole, one rank would copy most of it.
    tensors = [(1000, 4, True), (25, 4, True), (25, 4, True), (100, 2, True), (50, 1, True)]
    sizes = [element_size for _, element_size, _ in tensors]
    total = sum(numel * element_size for numel, element_size, _ in tensors)
    for parts in (1, 2, 3, 4, 8):
        dealt = deal(tensors, parts)
        assert dealt == deal(list(tensors), parts)
        loads = [part_bytes(pieces, sizes) for pieces in dealt]
        assert sum(loads) == total
        assert max(loads) - min(loads) <= 2 * max(sizes), (parts, loads)  # equal to an element either way
        for index, (numel, _, _) in enumerate(tensors):  # every element of every tensor in exactly one piece
            spans = sorted((first, stop) for pieces in dealt for i, first, stop in pieces if i == index)
            assert spans[0][0] == 0 and spans[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert deal(tensors, 1) == [[(index, 0, numel) for index, (numel, _, _) in enumerate(tensors)]]


def test_a_tensor_that_is_not_contiguous_goes_whole_to_one_rank() -> None:
    tensors = [(10, 4, True), (1000, 4, False), (10, 4, True)]
    dealt = deal(tensors, 2)
    assert [pieces for pieces in dealt if (1, 0, 1000) in pieces] and all(
        index != 1 or (first, stop) == (0, 1000) for pieces in dealt for index, first, stop in pieces)


def test_a_large_tensor_split_across_ranks_is_put_back_together(tmp_path: Path) -> None:
    state = training_state()
    state[REPLICA]["models"][0]["embedding"] = torch.randn(300, 40)  # most of the replica's bytes
    state[REPLICA]["models"][0]["transposed"] = torch.randn(40, 30).t()  # not contiguous: dealt whole
    write_node(tmp_path, 7, state)
    parts = [RankSnapshots(tmp_path, rank).committed()[0].nbytes for rank in LOCAL_RANKS]
    assert max(parts) < 1.2 * min(parts)
    for rank in LOCAL_RANKS:
        read = reader(tmp_path, rank).read(7, live={})
        assert_same(read[REPLICA], state[REPLICA])
        assert read[REPLICA]["models"][0]["embedding"].shape == (300, 40)


def write_node(directory: Path, step: int, state: dict, whole_on: int | None = None,
               skip: int | None = None) -> None:
    """Every local rank's snapshot of ``step``: its part of the replica (or, on ``whole_on``, all of it)
    and its own state; ``skip``: a rank that wrote nothing."""
    for index, rank in enumerate(LOCAL_RANKS):
        if rank == skip:
            continue
        snapshots = RankSnapshots(directory, rank)
        if rank == whole_on:
            written = {REPLICA: state[REPLICA], "rank": {"rng": torch.tensor([rank])}}
        else:
            written = {PART: replica_part(state[REPLICA], index, len(LOCAL_RANKS)),
                       "rank": {"rng": torch.tensor([rank])}}
        assert snapshots.write(written, step=step, generation=1, world_size=4) is not None
        snapshots.close()


def reader(directory: Path, rank: int) -> NodeReplica:
    return NodeReplica(directory, RankSnapshots(directory, rank), LOCAL_RANKS, slots=2)


def test_a_node_snapshot_is_put_back_together_bitwise_on_every_local_rank(tmp_path: Path) -> None:
    state = training_state()
    write_node(tmp_path, 7, state)
    for rank in LOCAL_RANKS:
        node = reader(tmp_path, rank)
        assert node.held(replicas=4) == [7]
        assert node.held(replicas=2) == []
        read = node.read(7, live={})
        assert_same(read[REPLICA], state[REPLICA])
        assert torch.equal(read["rank"]["rng"], torch.tensor([rank]))  # its own part, not a peer's


def test_each_rank_holds_only_its_part(tmp_path: Path) -> None:
    state = training_state()
    write_node(tmp_path, 7, state)
    _, tensors = flatten_state(state[REPLICA])
    whole = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    held = [RankSnapshots(tmp_path, rank).committed()[0].nbytes for rank in LOCAL_RANKS]
    assert sum(held) < whole * 1.1 and max(held) < whole


def test_a_step_a_local_rank_lacks_is_not_held_and_does_not_load(tmp_path: Path) -> None:
    state = training_state()
    write_node(tmp_path, 7, state)
    write_node(tmp_path, 8, training_state(seed=1), skip=3)  # rank 3 died before its snapshot of 8
    node = reader(tmp_path, 2)
    assert node.held(replicas=4) == [7]
    with pytest.raises(KeyError):
        node.read(8, live={})
    assert_same(node.read(7, live={})[REPLICA], state[REPLICA])


def test_a_torn_part_is_not_held(tmp_path: Path) -> None:
    write_node(tmp_path, 7, training_state())
    write_node(tmp_path, 8, training_state(seed=1))
    torn = RankSnapshots(tmp_path, 3)
    slot = next(s for s in torn._slots if s.info is not None and s.info.step == 8)
    slot.begin_write(slot.size - 4096, 0)  # a writer killed mid-copy leaves its slot WRITING
    torn.close()
    assert reader(tmp_path, 2).held(replicas=4) == [7]


def test_the_t2_writers_whole_snapshot_serves_every_local_rank(tmp_path: Path) -> None:
    state = training_state()
    write_node(tmp_path, 10, state, whole_on=2)
    for rank in LOCAL_RANKS:
        assert_same(reader(tmp_path, rank).read(10, live={})[REPLICA], state[REPLICA])


def test_a_read_copies_into_the_live_tensors(tmp_path: Path) -> None:
    state = training_state()
    write_node(tmp_path, 7, state)
    live = training_state(seed=5)
    weight = live[REPLICA]["models"][0]["0.weight"]
    read = reader(tmp_path, 3).read(7, live={REPLICA: live[REPLICA]})
    assert read[REPLICA]["models"][0]["0.weight"] is weight
    assert torch.equal(weight, state[REPLICA]["models"][0]["0.weight"])


def test_parts_that_do_not_fit_together_are_not_held(tmp_path: Path) -> None:
    """Ranks whose replica states differ in shape (a registered object with more tensors on one rank)
    deal them differently: the node holds no usable snapshot of that step, and a restart takes T2."""
    state, other = training_state(), training_state()
    other[REPLICA]["statefuls"]["extra"] = torch.ones(3)
    for index, (rank, replica) in enumerate(zip(LOCAL_RANKS, (state[REPLICA], other[REPLICA]), strict=True)):
        snapshots = RankSnapshots(tmp_path, rank)
        snapshots.write({PART: replica_part(replica, index, 2), "rank": {}}, step=7, generation=1, world_size=4)
        snapshots.close()
    assert reader(tmp_path, 2).held(replicas=4) == []
