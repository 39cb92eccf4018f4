"""The chaos soak's plan (tests/faults/chaos.py ``draw_plan``): the same seed the same faults; faults
apart by the spacing (those that take a host by the node spacing), each kind as often as the
others, a persister's kill on a checkpoint step, and every ``--inject`` value one the CLI takes."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.faults.chaos import KINDS, NODE_LEVEL, draw_plan
from undying.inject import parse_injections


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_plan_is_spaced_fair_and_parses(seed: int) -> None:
    plan = draw_plan(seed, 4000, spacing=12, node_spacing=60, checkpoint_interval=25)
    assert plan == draw_plan(seed, 4000, spacing=12, node_spacing=60, checkpoint_interval=25)
    steps = [fault.step for fault in plan]
    assert all(later - earlier >= 12 for earlier, later in zip(steps, steps[1:], strict=False)), steps
    assert steps[-1] < 4000 - 12
    node_steps = [fault.step for fault in plan if fault.kind in NODE_LEVEL]
    assert all(later - earlier >= 60 for earlier, later in zip(node_steps, node_steps[1:], strict=False)), node_steps
    counts = Counter(fault.kind for fault in plan)
    assert set(counts) == set(KINDS)
    # Host faults wait for a warm spare, so they may trail; the others are dealt evenly.
    others = [counts[kind] for kind in KINDS if kind not in NODE_LEVEL]
    assert max(others) - min(others) <= 1, counts
    assert all(fault.step % 25 == 0 for fault in plan if fault.kind == "kill@persist")
    assert all(fault.node == 1 for fault in plan if fault.kind in NODE_LEVEL)
    parse_injections([spec for fault in plan for spec in fault.specs])
    assert draw_plan(seed + 100, 4000) != plan
