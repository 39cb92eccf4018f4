"""The commit vote carrying numbers of every rank, in as few elements as the all-reduce allows.

Runs in the worker, at the commit (runtime/step_transaction.py). The vote is one float64
all-reduce: the vote itself, the bad-step check's numbers (runtime/step_check.py) and the peer
copies' (runtime/peer_copies.py). Most of them are small counts (a rank's vote, whether its values
were bad, whether it checked a loss): those are packed side by side into the bits of as few
float64 elements as hold them exactly (53 bits each; a field of a count at most ``limit`` on one
rank takes the bits of ``world * limit``), so that their sums over the ranks never carry into the
next field. The rest (a loss, a step number) travel as elements of their own.

Why: the cost of a small all-reduce grows with its elements before it grows with bytes (for 4 gloo
ranks on 2 cores, 0.65-0.80 ms for 1-2 elements against 2.75-4.30 ms for 3-6: bench/vote_elements.py,
docs/benchmarks.md), and the vote is on every step's critical path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from undying.runtime.pg import GenerationGroup

EXACT_BITS = 53  # the integers a float64 holds exactly, and so sums of them


def field_bits(limits: Sequence[int], world_size: int) -> list[int]:
    """The bits each count's field takes: enough for ``world_size`` ranks each at its limit."""
    return [max(1, (world_size * limit).bit_length()) for limit in limits]


def pack_counts(counts: Sequence[int], limits: Sequence[int], world_size: int) -> list[float]:
    """``counts`` (each 0..its limit) side by side in the bits of float64 elements, fields in order,
    a new element when the next field would not fit."""
    elements: list[int] = []
    used = EXACT_BITS
    for count, bits, limit in zip(counts, field_bits(limits, world_size), limits, strict=True):
        if not 0 <= count <= limit:
            raise ValueError(f"vote count {count} outside 0..{limit}")
        if bits > EXACT_BITS:
            raise ValueError(f"vote count field of {bits} bits: more than a float64 holds exactly")
        if used + bits > EXACT_BITS:
            elements.append(0)
            used = 0
        elements[-1] |= count << used
        used += bits
    return [float(element) for element in elements]


def unpack_counts(elements: Sequence[float], limits: Sequence[int], world_size: int) -> list[int]:
    """The summed counts out of the summed elements of ``pack_counts`` (the same limits and world)."""
    counts: list[int] = []
    index, used = -1, EXACT_BITS
    for bits in field_bits(limits, world_size):
        if used + bits > EXACT_BITS:
            index, used = index + 1, 0
        counts.append((int(elements[index]) >> used) & ((1 << bits) - 1))
        used += bits
    return counts


def commit_vote_with_sums(group: GenerationGroup, ok: bool, counts: Sequence[int], limits: Sequence[int],
                          floats: Sequence[float], device: torch.device) -> tuple[bool, list[int], list[float]]:
    """The commit vote carrying every rank's ``counts`` (each at most its ``limits``) and ``floats``:
    (every rank voted ``ok``, the counts summed over the ranks, the floats summed), in one float64
    all-reduce. Every rank passes the same ``limits``."""
    world = group.world_size
    packed = pack_counts([1 if ok else 0, *counts], [1, *limits], world)
    votes = torch.tensor([*packed, *floats], dtype=torch.float64, device=device)
    group.allreduce_sum(votes)
    total = votes.cpu().tolist()
    summed = unpack_counts(total[:len(packed)], [1, *limits], world)
    return summed[0] == world, summed[1:], total[len(packed):]
