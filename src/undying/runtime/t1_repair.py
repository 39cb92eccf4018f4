"""A repair from node memory: a receiving rank whose node's T1 snapshot holds the plan's step loads it
instead of receiving the state from a peer, and a pure-FSDP job rolls back in place to a T1 step.

Runs in the worker, for the recovery client (runtime/recovery_client.py). Every member of the new
generation takes part in the repair, so the members agree in one collective: each hands in its
``T1Offer`` (did it load the target step from T1, which step it holds live, which steps its T1
holds), one tiny all-gather (``exchange_offers``) gives every rank all of them, and ``decide``, a
pure function of the offers, tells every rank alike who receives from a peer and whether the job
rolls back. A snapshot counts only once its slot's commit word and checksums say it is complete
(checkpoint/snapshot_slot.py); a torn one is not offered, and its rank receives from a peer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from undying.runtime.pg import GenerationGroup
from undying.runtime.sharded import ShardLost

NO_STEP = -1  # an offer's field without a step, as it travels (steps are >= 0)
COPY_COLUMNS = 2  # an offer's steps of peer copies (checkpoint/peer_slots.py: two slots per origin)


@dataclass(frozen=True)
class T1Offer:
    """What one rank brings to a repair from node memory."""

    loaded: bool  # a receiver that loaded the plan's target step from its own T1 snapshot
    live_step: int | None  # the committed step this process holds (None: a replacement holds none)
    held: tuple[int, ...]  # the steps of its complete T1 snapshots (taken at the current size)
    copies: tuple[int, ...] = ()  # the steps of its node's copies of its origin's snapshots (peer_copy.py)

    def steps(self) -> set[int]:
        """The steps this rank can be brought to without a peer."""
        return set(self.held) | ({self.live_step} if self.live_step is not None else set())


@dataclass(frozen=True)
class T1Decision:
    """What every rank of the repair does, alike on every rank."""

    from_t1: frozenset[int]  # group indices of the receivers that hold the target step from T1
    rollback_step: int | None = None  # pure FSDP: every rank goes back to this step, from T1 or live
    # ... or, a rank that holds it nowhere (its node was lost), from the copy its holder's node keeps:
    # group index -> its holder's group index.
    from_copies: Mapping[int, int] | None = None


def decide(offers: Sequence[T1Offer], receivers: Sequence[int], target_step: int,
           replicas_hold_state: bool, holders: Mapping[int, int] | None = None) -> T1Decision:
    """The repair for ``offers`` (one per group index) and ``receivers`` (group indices).

    A receiver that loaded ``target_step`` from T1 takes nothing from peers. The others receive from
    a peer where a replica holds their state (``replicas_hold_state``: data parallel, or HSDP with a
    surviving replica of the shard). A pure-FSDP job has no such peer: every rank goes back to the
    newest step not after ``target_step`` that every rank holds (in T1, or live), or that its holder's
    node keeps a peer copy of (``holders``: group index -> its holder's, checkpoint.peer_copy); raises
    ShardLost if there is none (only a restart from storage can bring the lost shard back)."""
    loaded = frozenset(index for index in receivers if offers[index].loaded)
    if len(loaded) == len(set(receivers)) or replicas_hold_state:
        return T1Decision(loaded)
    holders = holders or {}

    def reach(index: int) -> set[int]:
        holder = holders.get(index)
        copied = set(offers[holder].copies) if holder is not None and holder != index else set()
        return offers[index].steps() | copied

    common = set.intersection(*(reach(index) for index in range(len(offers))))
    reachable = [step for step in common if step <= target_step]
    if not reachable:
        lacking = sorted(set(receivers) - loaded)
        raise ShardLost(f"no replica holds the shard of group rank(s) {lacking} and no step of T1 or of its "
                        f"peer copies is held for every rank (step {target_step} wanted)")
    step = max(reachable)
    from_copies = {index: holders[index] for index in range(len(offers)) if step not in offers[index].steps()}
    return T1Decision(frozenset(range(len(offers))), step, from_copies or None)


def encode_offer(offer: T1Offer, slots: int) -> list[int]:
    """An offer as ``2 + slots + COPY_COLUMNS`` integers: loaded, the live step, the T1 steps, then the
    peer copies' steps (NO_STEP: none)."""
    held, copies = list(offer.held)[:slots], list(offer.copies)[:COPY_COLUMNS]
    return [int(offer.loaded), NO_STEP if offer.live_step is None else offer.live_step,
            *held, *[NO_STEP] * (slots - len(held)), *copies, *[NO_STEP] * (COPY_COLUMNS - len(copies))]


def decode_offer(row: Sequence[int], slots: int) -> T1Offer:
    def steps(values: Sequence[int]) -> tuple[int, ...]:
        return tuple(int(step) for step in values if step != NO_STEP)

    return T1Offer(bool(row[0]), None if row[1] == NO_STEP else int(row[1]), steps(row[2:2 + slots]),
                   steps(row[2 + slots:]))


def exchange_offers(group: GenerationGroup, offer: T1Offer, slots: int, device: torch.device) -> list[T1Offer]:
    """Every rank's offer, in group order, on every rank: one all-reduce of a (ranks x (2 + slots +
    COPY_COLUMNS)) integer table in which each rank fills its own row (the rest zero), on the job's device."""
    width = 2 + slots + COPY_COLUMNS
    table = torch.zeros((group.world_size, width), dtype=torch.int64, device=device)
    # Shifted by one so that the rows left at zero add nothing (NO_STEP is -1).
    table[group.rank] = torch.tensor(encode_offer(offer, slots), dtype=torch.int64, device=device) + 1
    group.allreduce_sum(table)
    return [decode_offer([value - 1 for value in row], slots) for row in table.cpu().tolist()]
