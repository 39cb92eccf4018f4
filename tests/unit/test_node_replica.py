"""A data-parallel replica kept once per node in T1 (checkpoint/node_replica.py): the deal of tensors to
local ranks, a node snapshot put back together bitwise, a step that a local rank lacks (never written,
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


def test_the_deal_balances_bytes_and_is_the_same_for_every_rank() -> None:
    sizes = [400, 100, 100, 100, 100, 50, 50]
    owners = deal(sizes, 2)
    assert owners == deal(list(sizes), 2)
    load = [sum(size for size, owner in zip(sizes, owners, strict=True) if owner == part) for part in (0, 1)]
    assert load == [450, 450]
    assert deal(sizes, 1) == [0] * len(sizes)
    assert sorted(set(deal(sizes, 4))) == [0, 1, 2, 3]


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
