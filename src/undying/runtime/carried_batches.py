"""A batch carried into a step in a Python variable, found at the step's first forward.

Runs in the worker. A rollback, a restore and a replacement's repair put the loaders' positions,
the RNG and the model back as of a committed step; the script's own variables they cannot reach.
A loop that prefetches (``X, Y = get_batch()`` before the loop and again at the end of the body, as
nanoGPT's does) trains each step on a batch drawn in the step before it: after a fault the re-run
step would read the failed attempt's batch, a replacement the one it drew before its restore, and
the run would end with other parameters and no error. ``DrawLedger`` keeps the order of the batches
``ft.dataloader`` hands out and of the wrapped models' training forwards, and refuses the pattern
at its first step, fault or no fault, so that it is fixed before it can change a result.
"""

from __future__ import annotations

MIGRATING_SECTION = 'docs/migrating.md, "Batches prefetched across steps"'


class CarriedBatchError(RuntimeError):
    """A step's first training forward came before any batch of the step was drawn while the newest
    batch belongs to another step. The script's error, never retried: every re-run would meet it."""


class DrawLedger:
    """The order of draws (a batch handed out by a loader of ``ft.dataloader``) and training forwards
    (a wrapped model called with gradients enabled) on one rank, and what a rollback or restore did
    to the newest draw.

    Guarantees: ``forward`` raises ``CarriedBatchError`` at the first training forward of a step in
    which no batch was drawn yet, if the newest batch was drawn after the previous step's last
    training forward (a batch carried from one step into the next: a prefetch, the pre-loop draw
    among them) or in a step since rolled back or before the loaders' positions were replaced (a
    restore, a repair). Not guaranteed: anything about data not drawn from ``ft.dataloader``, or a
    model called other than through its wrapper; a step whose first training forward reads other
    data (not the loader's) before it draws is refused too (draw first).
    """

    def __init__(self) -> None:
        self._clock = 0  # one tick per draw and per training forward in a step, in order
        self._newest_draw: int | None = None
        self._newest_forward: int | None = None
        self._newest_draw_stale = False  # drawn in a rolled-back step, or before a position was replaced
        self._step_started = 0  # the clock when the step in flight began
        self._step: int | None = None  # the step in flight (None between steps)
        self._checked = False  # the step's first training forward was looked at

    def begin_step(self, step: int) -> None:
        self._step, self._step_started, self._checked = step, self._clock, False

    def end_step(self) -> None:
        self._step = None

    def drew(self) -> None:
        """A loader handed out a batch."""
        self._clock += 1
        self._newest_draw = self._clock
        self._newest_draw_stale = False

    def position_replaced(self) -> None:
        """A loader's position was loaded (a rollback, a restore, a repair, the script's own load): a
        batch drawn since the step in flight began (or, before the first step, at all) belongs to a
        position given up."""
        if self._newest_draw is not None and self._newest_draw > self._step_started:
            self._newest_draw_stale = True

    def forward(self) -> None:
        """A wrapped model is called with gradients enabled."""
        if self._step is None:
            return
        if not self._checked:
            self._checked = True
            self._check_first_forward(self._step)
        self._clock += 1
        self._newest_forward = self._clock

    def _check_first_forward(self, step: int) -> None:
        newest = self._newest_draw
        if newest is None or newest > self._step_started:
            return  # nothing drawn yet, or the step drew its own batch first
        carried = self._newest_forward is None or newest > self._newest_forward
        if not carried and not self._newest_draw_stale:
            return  # a batch kept from a committed step's draw and used again: still that step's
        why = ("it was drawn in a step that failed and was rolled back, or before this rank's state was "
               "restored") if self._newest_draw_stale else (
               "it was drawn after the previous step's last forward (a batch prefetched for the next step, "
               "or drawn before the loop)")
        raise CarriedBatchError(
            f"undying: step {step} calls the model before drawing any batch of its own, and the newest batch "
            f"from ft.dataloader belongs to another step: {why}. A batch carried across steps in a variable is "
            f"not rolled back with a failed step nor handed to a replacement rank, so after a fault the run "
            f"would train on other batches and end with other parameters. Draw each step's batches inside the "
            f"step, before its first forward (`X, Y = next(loader)` at the top of each micro-step); "
            f"ft.dataloader's own workers prefetch (num_workers, prefetch_factor, pin_memory). "
            f"See {MIGRATING_SECTION}")
