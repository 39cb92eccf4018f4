"""A batch carried into a step in a Python variable is refused at the step's first training forward,
fault or no fault; loops that draw their batches inside the step, reuse a committed step's batch,
or draw nothing from ft.dataloader are left alone (runtime/carried_batches.py)."""

from __future__ import annotations

import pytest

from undying.runtime.carried_batches import MIGRATING_SECTION, CarriedBatchError, DrawLedger


def test_a_loop_that_draws_inside_each_step_is_left_alone_also_across_a_rollback() -> None:
    ledger = DrawLedger()
    attempts = [(0, True), (1, True), (2, False), (2, True), (3, True)]  # step 2 fails once, runs again
    for step, commits in attempts:
        ledger.begin_step(step)
        for _micro in range(2):  # accumulation: a draw before each micro-batch's forward
            ledger.drew()
            ledger.forward()
        ledger.end_step()
        if not commits:
            ledger.position_replaced()  # the rollback: the step's draws are given up


def test_the_prefetch_pattern_is_refused_at_its_first_step() -> None:
    """nanoGPT's: ``X, Y = get_batch()`` before the loop, the step's forward on it, the next step's
    batch drawn at the end of the body. Refused at step 0, without any fault."""
    ledger = DrawLedger()
    ledger.drew()  # before the loop
    ledger.begin_step(0)
    with pytest.raises(CarriedBatchError) as refused:
        ledger.forward()
    message = str(refused.value)
    assert "\n" not in message and "step 0" in message and "prefetched" in message
    assert "X, Y = next(loader)" in message and MIGRATING_SECTION in message


def test_a_prefetch_begun_later_is_refused_at_the_first_step_that_reads_it() -> None:
    ledger = DrawLedger()
    ledger.begin_step(0)
    ledger.drew()
    ledger.forward()
    ledger.drew()  # the next step's batch, drawn at the end of this one
    ledger.end_step()
    ledger.begin_step(1)
    with pytest.raises(CarriedBatchError, match="step 1 calls the model before drawing"):
        ledger.forward()


def test_a_prefetch_within_a_step_is_left_alone() -> None:
    """nanoGPT's micro-step loop draws the next micro-batch between forward and backward; within one
    step that is the step's own batch (only the one carried over the boundary is refused)."""
    ledger = DrawLedger()
    ledger.begin_step(0)
    ledger.drew()
    ledger.forward()
    ledger.drew()  # drawn after the first micro-batch's forward, for the second
    ledger.forward()
    ledger.end_step()


def test_a_batch_kept_from_a_committed_step_is_left_alone_but_not_after_a_restore() -> None:
    """A loop that draws every other step and trains on the batch twice: a survivor's rollback of a
    step that drew nothing keeps the variable right; a restore (or a replacement's repair) does not."""
    ledger = DrawLedger()
    for step in range(4):
        ledger.begin_step(step)
        if step % 2 == 0:
            ledger.drew()
        ledger.forward()
        ledger.end_step()
    ledger.begin_step(4)
    ledger.drew()
    ledger.forward()
    ledger.end_step()
    ledger.begin_step(5)  # fails before its forward; rolled back: it drew nothing
    ledger.end_step()
    ledger.position_replaced()
    ledger.begin_step(5)
    ledger.forward()
    ledger.end_step()

    restarted = DrawLedger()
    restarted.drew()  # the script's first draw, then ft.steps() restores another position
    restarted.position_replaced()
    restarted.begin_step(5)
    with pytest.raises(CarriedBatchError, match="before this rank's state was restored"):
        restarted.forward()


def test_a_batch_drawn_in_a_failed_step_is_refused_in_its_rerun() -> None:
    ledger = DrawLedger()
    for step in range(2):
        ledger.begin_step(step)
        if step == 0:
            ledger.drew()
        ledger.forward()
        ledger.end_step()
    ledger.begin_step(2)
    ledger.forward()  # trains on step 0's batch a third time (drawn before step 1's forward)
    ledger.drew()  # then draws, and the step fails
    ledger.end_step()
    ledger.position_replaced()
    ledger.begin_step(2)
    with pytest.raises(CarriedBatchError):
        ledger.forward()


def test_nothing_drawn_from_the_loader_means_nothing_to_check() -> None:
    ledger = DrawLedger()
    for step in range(3):
        ledger.begin_step(step)
        ledger.forward()
        ledger.forward()
        ledger.end_step()
    ledger.position_replaced()
    ledger.begin_step(3)
    ledger.forward()


def test_forwards_outside_a_step_are_not_looked_at() -> None:
    ledger = DrawLedger()
    ledger.drew()
    ledger.forward()  # before the loop (e.g. a warm-up): no step to check
    ledger.begin_step(0)
    ledger.drew()
    ledger.forward()
