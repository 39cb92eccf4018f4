"""The commit vote's packed counts: what every rank packs, summed element by element, unpacks to the
sums of the counts; the bad-step check's gradient shares cover every parameter once."""

from __future__ import annotations

import random

import pytest
import torch

from undying.runtime.step_check import COUNT_LIMITS, report_from_parts, report_parts, share_of
from undying.runtime.vote_sums import EXACT_BITS, pack_counts, unpack_counts


@pytest.mark.parametrize("world", [1, 2, 4, 7, 64, 8191, 8192, 100_000])
def test_summed_packed_counts_unpack_to_the_sums(world: int) -> None:
    rng = random.Random(world)
    limits = [1, 1, 1, 1, 2**24 - 1, 3]
    ranks = min(world, 50)  # the rest of the world votes zeros
    per_rank = [[rng.randint(0, limit) for limit in limits] for _ in range(ranks)]
    per_rank[0] = list(limits)  # one rank at every limit
    if world == ranks:
        per_rank[-1] = list(limits)
    packed = [pack_counts(counts, limits, world) for counts in per_rank]
    summed = [sum(element) for element in zip(*packed, strict=True)]
    assert all(element < 2**EXACT_BITS for element in summed)
    assert unpack_counts(summed, limits, world) == [sum(column) for column in zip(*per_rank, strict=True)]


def test_small_worlds_pack_the_vote_and_the_check_into_one_element() -> None:
    assert len(pack_counts([1, 0, 1, 0, 3], [1, *COUNT_LIMITS], 4)) == 1
    assert len(pack_counts([1, 0, 1, 0, 3], [1, *COUNT_LIMITS], 8191)) == 2


def test_a_count_outside_its_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="outside 0..1"):
        pack_counts([2], [1], 4)


def test_a_check_report_survives_its_parts() -> None:
    report = (1.0, 2.75, 1.0, 1.0, 5.0)
    counts, floats = report_parts(report)
    assert (counts, floats) == ([1, 1, 1, 5], [2.75])
    assert report_from_parts(counts, floats) == list(report)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 9])
def test_gradient_shares_cover_every_parameter_once_and_balance(world: int) -> None:
    params = [torch.zeros(size) for size in (4096, 7, 300, 300, 1, 2048, 64, 64, 5, 1000)]
    shares = [share_of(params, rank, world) for rank in range(world)]
    ids = sorted(id(param) for share in shares for param in share)
    assert ids == sorted(id(param) for param in params)
    loads = [sum(param.numel() for param in share) for share in shares]
    if world > 1:
        assert max(loads) <= max(param.numel() for param in params) + sum(p.numel() for p in params) // world
