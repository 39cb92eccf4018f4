"""How the members of a repair agree on a repair from node memory (runtime/t1_repair.py): who still
receives from a peer, when a pure-FSDP job rolls back and to which step, when nothing can repair it;
the offers every rank sees after the exchange; and which T1 snapshots a rank may offer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.gloo_ranks import run_ranks
from undying.checkpoint.node_replica import NodeReplica
from undying.checkpoint.snapshot import RankSnapshots
from undying.checkpoint.snapshot_slot import STATE_WRITING
from undying.runtime.pg import GenerationGroup
from undying.runtime.sharded import ShardLost
from undying.runtime.t1_repair import (
    T1Decision,
    T1Offer,
    decide,
    decode_offer,
    encode_offer,
    exchange_offers,
)


def survivor(step: int, *held: int) -> T1Offer:
    return T1Offer(loaded=False, live_step=step, held=held)


def replacement(loaded: bool, *held: int) -> T1Offer:
    return T1Offer(loaded=loaded, live_step=None, held=held)


def test_a_replacement_that_loaded_the_step_from_t1_takes_nothing_from_peers() -> None:
    offers = [survivor(15, 15, 14), replacement(True, 15, 14), survivor(15, 15, 14)]
    for replicas_hold_state in (True, False):
        assert decide(offers, [1], 15, replicas_hold_state) == T1Decision(frozenset({1}))


def test_where_a_replica_holds_the_state_a_receiver_without_the_step_in_t1_gets_it_from_a_peer() -> None:
    offers = [survivor(15, 15, 14), replacement(False, 14, 13), replacement(True, 15), survivor(15, 15)]
    assert decide(offers, [1, 2], 15, replicas_hold_state=True) == T1Decision(frozenset({2}))


def test_pure_fsdp_rolls_back_to_the_newest_step_every_rank_holds() -> None:
    """The replacement's T1 lacks step 15 (snapshots every 4 steps): every rank goes back to 12."""
    offers = [survivor(15, 12, 8), replacement(False, 12, 8), survivor(15, 12, 8), survivor(15, 12, 8)]
    decision = decide(offers, [1], 15, replicas_hold_state=False)
    assert decision == T1Decision(frozenset(range(4)), rollback_step=12)


def test_a_rollback_goes_no_further_than_a_step_a_rank_holds_live() -> None:
    """A survivor behind the others (it holds step 14 live, nothing in T1) is brought along: 14 is held
    by every rank, in T1 or live. A step after the plan's is never chosen."""
    offers = [survivor(14), replacement(False, 16, 14), survivor(15, 15, 14), survivor(15, 14, 16)]
    assert decide(offers, [0, 1], 15, replicas_hold_state=False).rollback_step == 14


def test_pure_fsdp_without_a_common_t1_step_cannot_be_repaired() -> None:
    offers = [survivor(15, 15, 14), replacement(False), survivor(15, 15, 14), survivor(15, 15, 14)]
    with pytest.raises(ShardLost, match=r"group rank\(s\) \[1\]"):
        decide(offers, [1], 15, replicas_hold_state=False)
    disjoint = [survivor(15, 15, 14), replacement(False, 13), survivor(15, 15, 14), survivor(15, 15, 14)]
    with pytest.raises(ShardLost):
        decide(disjoint, [1], 15, replicas_hold_state=False)


def test_a_lost_nodes_ranks_go_back_with_the_others_to_the_newest_step_their_copies_cover() -> None:
    """1 x 4, node 1 (ranks 2 and 3) lost: their holders (0 and 1, holder of r is r + 2 mod 4) keep
    copies of steps 14 and 12 of rank 2 and 14 and 13 of rank 3; the survivors hold 15 live and 15, 14
    in T1. Step 14 is the newest every rank reaches: ranks 2 and 3 from the copies, 0 and 1 from T1."""
    holders = {0: 2, 1: 3, 2: 0, 3: 1}
    offers = [T1Offer(False, 15, (15, 14), copies=(14, 12)), T1Offer(False, 15, (15, 14), copies=(14, 13)),
              replacement(False), replacement(False)]
    decision = decide(offers, [2, 3], 15, replicas_hold_state=False, holders=holders)
    assert decision == T1Decision(frozenset(range(4)), rollback_step=14, from_copies={2: 0, 3: 1})
    # Without the holders' copies nothing covers the lost shards; a copy of a rank's own is no cover.
    with pytest.raises(ShardLost, match="peer copies"):
        decide(offers, [2, 3], 15, replicas_hold_state=False)
    behind = [T1Offer(False, 15, (15, 14), copies=(12,)), T1Offer(False, 15, (15, 14), copies=(14, 13)),
              replacement(False), replacement(False)]
    with pytest.raises(ShardLost):
        decide(behind, [2, 3], 15, replicas_hold_state=False, holders=holders)


@pytest.mark.parametrize("offer", [survivor(0), survivor(15, 15, 14), replacement(True, 15),
                                   replacement(False), replacement(False, 3, 0),
                                   T1Offer(False, 15, (15, 14), copies=(14, 12)), T1Offer(False, None, (), (3,))])
def test_an_offer_travels_as_integers_and_back(offer: T1Offer) -> None:
    row = encode_offer(offer, slots=3)
    assert len(row) == 7 and all(isinstance(value, int) for value in row)
    assert decode_offer(row, slots=3) == offer


def test_every_rank_sees_every_offer_in_group_order() -> None:
    offers = [survivor(15, 15, 14), replacement(True, 15, 14), survivor(0), T1Offer(False, None, (), (7, 6))]

    def body(group: GenerationGroup) -> list[T1Offer]:
        return exchange_offers(group, offers[group.rank], 2, torch.device("cpu"))

    assert run_ranks(4, body) == [offers] * 4


def test_only_complete_snapshots_of_the_current_size_are_offered(tmp_path: Path) -> None:
    """A slot whose write was torn (its commit word never said COMMITTED) is not offered: a new process
    opening the node's slots sees only step 14; a snapshot taken at another size is not offered."""
    state = {"weight": torch.arange(4.0)}
    writer = RankSnapshots(tmp_path, rank=1)
    writer.write(state, step=14, generation=1, world_size=4)
    writer.wait_reserved()  # the second slot is allocated in the background after the first write
    info = writer.write(state, step=15, generation=1, world_size=4)
    assert info is not None
    writer._slots[info.slot].set_state(STATE_WRITING)  # as a SIGKILL during the copy of step 15 leaves it
    writer.close()
    reopened = RankSnapshots(tmp_path, rank=1)
    own = NodeReplica(tmp_path, reopened, [1], slots=2)  # a rank that keeps its snapshots whole
    assert own.held(replicas=4) == [14]
    assert own.held(replicas=2) == []
    reopened.close()
