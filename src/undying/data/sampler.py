"""The batch plan behind ``ResumableLoader``: which sample indices come next from a logical position.

Runs in worker processes, on the training thread (a torch ``DataLoader`` iterates its batch sampler
in the main process, also when worker processes load the samples). ``plan_batch`` is the one rule
for the next batch and the position after it; the loader and its batch sampler both follow it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# Mixed into the per-epoch seed so that epoch e of seed s never equals epoch e' of seed s'
# for small values (a prime larger than any realistic epoch count).
EPOCH_SEED_STRIDE = 1_000_003

# How a replica covers the slots of lost replicas after an elastic shrink: more micro-batches
# per step (gradient accumulation, same memory per forward) or one larger batch.
ACCUMULATE = "accumulate"
GROW = "grow"
ELASTIC_BATCH_MODES = (ACCUMULATE, GROW)

# Epoch orders kept by a sampler: the one being read and the next (prefetch crosses epoch ends).
ORDERS_KEPT = 2


def replica_slots(replica: int, replicas: int, slots: int) -> tuple[int, int]:
    """(first slot, slot count) of ``replica`` when a step's ``slots`` batch slots are spread over
    ``replicas`` replicas in contiguous runs, the first ``slots % replicas`` taking one more."""
    per_replica, extra = divmod(slots, replicas)
    return replica * per_replica + min(replica, extra), per_replica + (1 if replica < extra else 0)


@dataclass(frozen=True)
class Cursor:
    """A loader's logical position: ``position`` samples of epoch ``epoch``'s global order consumed by
    all replicas together, and the micro-batches this replica already took in the step in flight."""

    epoch: int
    position: int
    slots_taken: int = 0


@dataclass(frozen=True)
class Layout:
    """This replica's share of every step: the step has ``world_size`` slots of ``batch_size``
    samples, of which it covers ``slot_count`` from ``first_slot`` on, in ``mode``."""

    batch_size: int
    world_size: int
    first_slot: int
    slot_count: int
    mode: str

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size


@dataclass(frozen=True)
class PlannedBatch:
    """One batch of the plan: taken at ``cursor`` under ``layout``, it holds ``indices`` and leaves
    the loader at ``after``."""

    cursor: Cursor
    layout: Layout
    indices: list[int]
    after: Cursor


def epoch_order(seed: int, epoch: int, dataset_len: int) -> list[int]:
    """Epoch ``epoch``'s global order: the same on every rank and at every world size."""
    generator = torch.Generator().manual_seed(seed * EPOCH_SEED_STRIDE + epoch)
    return torch.randperm(dataset_len, generator=generator).tolist()


def roll_if_exhausted(cursor: Cursor, layout: Layout, dataset_len: int) -> Cursor:
    """The next epoch's start when what is left of this one is shorter than a global batch (drop_last)."""
    if dataset_len - cursor.position < layout.global_batch_size:
        return Cursor(cursor.epoch + 1, 0, cursor.slots_taken)
    return cursor


def plan_batch(cursor: Cursor, layout: Layout, dataset_len: int, order: list[int]) -> tuple[list[int], Cursor]:
    """The indices of the batch taken at ``cursor`` (``order`` is its epoch's order) and the cursor after
    it. ``accumulate`` takes one slot per batch, ``grow`` all of this replica's slots at once; the
    position moves by a whole global batch once every slot of the step was taken."""
    if layout.mode == ACCUMULATE:
        start = cursor.position + (layout.first_slot + cursor.slots_taken) * layout.batch_size
        indices = order[start: start + layout.batch_size]
        taken = cursor.slots_taken + 1
    else:
        start = cursor.position + layout.first_slot * layout.batch_size
        indices = order[start: start + layout.slot_count * layout.batch_size]
        taken = layout.slot_count
    if taken < layout.slot_count:
        return indices, Cursor(cursor.epoch, cursor.position, taken)
    return indices, roll_if_exhausted(Cursor(cursor.epoch, cursor.position + layout.global_batch_size),
                                      layout, dataset_len)


class PlannedBatchSampler:
    """A torch ``batch_sampler`` that yields the batches of the plan from a start the loader sets
    (``start``) before it asks the ``DataLoader`` for an iterator, endlessly (across epochs).

    Every batch it yields is also appended to ``planned``, a queue the loader reads: a ``DataLoader``
    returns its batches in the order its sampler yielded their indices (``in_order``, its default),
    so the n-th batch the loader receives is the n-th entry, however far the prefetch ran ahead.
    Each ``iter`` starts a new queue, so an abandoned iterator cannot add to the current one."""

    def __init__(self, seed: int, dataset_len: int) -> None:
        self.seed = seed
        self.dataset_len = dataset_len
        self.start: tuple[Cursor, Layout] | None = None
        self.planned: deque[PlannedBatch] = deque()
        self._orders: dict[int, list[int]] = {}

    def __iter__(self) -> Iterator[list[int]]:
        if self.start is None:
            raise RuntimeError("PlannedBatchSampler: no start position set")
        self.planned = deque()
        return self._batches(*self.start, self.planned)

    def _batches(self, cursor: Cursor, layout: Layout, planned: deque[PlannedBatch]) -> Iterator[list[int]]:
        while True:
            indices, after = plan_batch(cursor, layout, self.dataset_len, self._order(cursor.epoch))
            planned.append(PlannedBatch(cursor, layout, indices, after))
            yield indices
            cursor = after

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if len(self._orders) >= ORDERS_KEPT:
                del self._orders[next(iter(self._orders))]  # the one computed first
            self._orders[epoch] = epoch_order(self.seed, epoch, self.dataset_len)
        return self._orders[epoch]
