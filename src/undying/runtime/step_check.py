"""The bad-step check: a step whose values are not finite, or whose loss spikes, is never committed.

Runs in the worker, inside the commit (runtime/step_transaction.py), after the gradients are
averaged and before any rank applies the update. Each rank checks what it holds: the values the
loop named with ``ft.check(loss=..., ...)`` (non-finite: this rank's own fault, so the rank is
named) and the norm of its gradients (non-finite on every rank once one rank's are: the average
spreads it). Its verdict rides on the commit vote as three numbers (a bad-value count, the sum and
the count of the ranks' losses), so every rank learns the same verdict from the same sums: the job's
mean loss is compared with its mean over the last ``loss_spike_window`` committed steps, a
history every rank holds alike (registered job state: rolled back with a failed step, handed to a
replacement, checkpointed). What a bad step leads to is runtime/bad_steps.py.

Cost per step: one pass over the gradients for their norm (``torch.nn.utils.get_total_norm``, read
back with one ``.item()``: on a GPU, a sync before the vote's own), over this rank's share of them
only where every rank holds the same averaged gradients (``share_of``: a non-finite gradient is
non-finite on every rank, so one rank finding it is enough); and the vote's numbers, the counts
among them packed into the vote's first element (runtime/vote_sums.py), the loss one more.
"""

from __future__ import annotations

import collections
import functools
import heapq
import math
from dataclasses import dataclass
from typing import Any

import torch

from undying.config import JobSpec
from undying.runtime.scalars import NAME_PATTERN

LOSS = "loss"  # the ft.check name whose spikes are looked for
GRAD_NORM = "grad_norm"  # a bad value of the gradients' (every rank's, once averaged), not a checked one
REPORT_LEN = 5  # the numbers this check adds to the commit vote
COUNT_FIELDS = (0, 2, 3, 4)  # which of them are counts (packed into few elements, runtime/vote_sums.py)
RANK_LIMIT = 2**24 - 1  # the ranks a named bad value's count field is sized for
COUNT_LIMITS = (1, 1, 1, RANK_LIMIT)  # each count's most on one rank
RECENT_LOSSES = "undying.recent_losses"  # its registered name (job state)


@dataclass(frozen=True)
class BadStep:
    """Why a step may not be committed: in words (the same on every rank), this rank's own bad values
    (name -> value), and the ranks whose own checked values were bad (known when there is one; the
    count in ``named_count``)."""

    cause: str
    own: dict[str, float]
    named: list[int]
    named_count: int


class RecentLosses:
    """The job's mean loss of each of the newest committed steps (at most ``window``): job state."""

    def __init__(self, window: int) -> None:
        self.losses: collections.deque[float] = collections.deque(maxlen=window)

    def mean(self) -> float | None:
        """Their mean once the window is full (None before: too little history to call a spike)."""
        if len(self.losses) < (self.losses.maxlen or 0):
            return None
        return sum(self.losses) / len(self.losses)

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses.clear()
        self.losses.extend(float(loss) for loss in state["losses"])


class StepCheck:
    """The values of the step in flight (``watch``), this rank's part of the vote, and the verdict."""

    def __init__(self, spec: JobSpec, rank: int) -> None:
        self.rank = rank
        self.enabled = spec.bad_step_check
        self.spike_factor = spec.loss_spike_factor
        self.recent = RecentLosses(spec.loss_spike_window)
        self._values: dict[str, list[Any]] = {}
        self._own: dict[str, float] = {}
        self._loss = math.nan  # this rank's loss of the step, as voted (nan: none checked)

    def watch(self, values: dict[str, Any]) -> None:
        """``ft.check(name=value)``: a number or a one-element tensor, read at the commit."""
        for name, value in values.items():
            if not NAME_PATTERN.fullmatch(name):
                raise ValueError(f"ft.check: value name {name!r}: allowed letters, digits and '_' (not first a digit)")
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ValueError(f"ft.check: {name}: allowed a number or a one-element tensor "
                                 f"(got a tensor of {value.numel()} elements)")
            if value is not None:
                self._values.setdefault(name, []).append(value.detach() if isinstance(value, torch.Tensor) else value)

    def begin_step(self) -> None:
        self._values.clear()
        self._own = {}

    def vote_report(self, gradients: list[torch.Tensor]) -> tuple[float, ...]:
        """This rank's part of the vote: (its values or gradients are not finite, its loss, 1 if it checked
        one, 1 if its own checked values are not finite, its rank if so). ``gradients``: this rank's
        (averaged, or local shards of) gradients."""
        own = {}
        for name, values in self._values.items():
            for value in values:
                number = float(value.item()) if isinstance(value, torch.Tensor) else float(value)
                if not math.isfinite(number):
                    own[name] = number
                    break
        losses = [float(value.item()) if isinstance(value, torch.Tensor) else float(value)
                  for value in self._values.get(LOSS, [])]
        if gradients:
            norm = float(torch.nn.utils.get_total_norm(gradients, foreach=True).item())
            if not math.isfinite(norm):
                own[GRAD_NORM] = norm
        self._own = own
        loss = sum(losses) / len(losses) if losses else 0.0
        self._loss = loss if losses and math.isfinite(loss) else math.nan
        named = any(name != GRAD_NORM for name in own)
        return (1.0 if own else 0.0, 0.0 if math.isnan(self._loss) else self._loss,
                0.0 if math.isnan(self._loss) else 1.0, 1.0 if named else 0.0, float(self.rank) if named else 0.0)

    def verdict(self, sums: list[float]) -> BadStep | None:
        """From the vote's sums (every rank's ``vote_report`` added up): why the step is bad, or None."""
        bad_ranks, loss_sum, losses, named, named_sum = sums[:REPORT_LEN]
        if bad_ranks > 0:
            return BadStep(f"non-finite values on {int(bad_ranks)} rank(s)", dict(self._own),
                           [int(named_sum)] if named == 1 else [], int(named))
        if losses > 0 and self.spike_factor is not None:
            loss, mean = loss_sum / losses, self.recent.mean()
            if mean is not None and mean > 0 and loss > self.spike_factor * mean:
                return BadStep(f"loss spike: {loss:.4g} > {self.spike_factor:g} x its mean {mean:.4g} over "
                               f"the last {len(self.recent.losses)} steps", {}, [], 0)
        return None

    def committed(self, sums: list[float]) -> None:
        """The step committed: its mean loss joins the history (every rank alike)."""
        if sums[2] > 0:
            self.recent.losses.append(sums[1] / sums[2])


def report_parts(report: tuple[float, ...]) -> tuple[list[int], list[float]]:
    """A ``vote_report`` as (its counts, its other numbers), to travel in the vote."""
    counts = [int(report[index]) for index in COUNT_FIELDS]
    return counts, [value for index, value in enumerate(report) if index not in COUNT_FIELDS]


def report_from_parts(counts: list[int], floats: list[float]) -> list[float]:
    """The summed counts and other numbers back in ``vote_report``'s order (for ``verdict``)."""
    numbers, summed = iter(counts), iter(floats)
    return [float(next(numbers)) if index in COUNT_FIELDS else next(summed) for index in range(REPORT_LEN)]


@functools.lru_cache(maxsize=8)
def _share_indices(numels: tuple[int, ...], rank: int, world_size: int) -> tuple[int, ...]:
    loads = [(0, holder) for holder in range(world_size)]  # a heap: the least loaded rank first
    mine = []
    for index in sorted(range(len(numels)), key=lambda index: (-numels[index], index)):
        load, holder = heapq.heappop(loads)
        if holder == rank:
            mine.append(index)
        heapq.heappush(loads, (load + numels[index], holder))
    return tuple(sorted(mine))


def share_of(params: list[torch.Tensor], rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's share of ``params`` (the same list on every rank), balanced by elements: every
    parameter in exactly one rank's share, the same split on every rank."""
    if world_size <= 1:
        return params
    return [params[index] for index in _share_indices(tuple(param.numel() for param in params), rank, world_size)]


def gradients_of(models: list[Any], shared: tuple[int, int] | None = None) -> list[torch.Tensor]:
    """Every gradient this rank holds, as plain local tensors (a DTensor's local shard: a norm of the
    DTensor itself would be a collective). ``shared`` (this rank, the world size): the models'
    gradients are the same on every rank (averaged), and only this rank's share of them is taken."""
    grads = []
    for model in models:
        # A wrapped DDP model keeps the list of the parameters it averages: no module walk per step.
        averaged = getattr(model, "averaged_parameters", None)
        params = averaged() if averaged is not None else list(model.parameters())
        for param in share_of(params, *shared) if shared is not None else params:
            grad = param.grad
            if grad is not None:
                grads.append(grad.to_local() if hasattr(grad, "to_local") else grad)
    return grads
