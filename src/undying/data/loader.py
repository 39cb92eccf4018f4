"""Deterministic, resumable, re-shardable batching over a map-style dataset, served by a torch DataLoader.

Runs in worker processes: each rank holds one ``ResumableLoader`` (made by ``ft.dataloader``); its
``state_dict`` is part of every snapshot, and ``reshard`` and ``set_replicas`` are how a world-size
change keeps the global sample order. Which indices come next is planned in sampler.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, default_collate

from undying.data.sampler import (
    ACCUMULATE,
    ELASTIC_BATCH_MODES,
    EPOCH_SEED_STRIDE,
    GROW,
    Cursor,
    Layout,
    PlannedBatchSampler,
    replica_slots,
    roll_if_exhausted,
)

__all__ = ["ACCUMULATE", "ELASTIC_BATCH_MODES", "EPOCH_SEED_STRIDE", "GROW", "DrawWatcher", "MapStyleDataset",
           "ResumableLoader", "is_map_style", "replica_slots"]

SEED_MASK = (1 << 63) - 1  # torch.Generator.manual_seed takes a 64-bit seed


class DrawWatcher(Protocol):
    """Told of every batch a loader hands out and of every load of its position (the worker's
    runtime/carried_batches.py ``DrawLedger``: a batch carried across steps in a variable)."""

    def drew(self) -> None: ...

    def position_replaced(self) -> None: ...


class MapStyleDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def is_map_style(dataset: object) -> bool:
    """True for what ``ResumableLoader`` can index: ``len`` and ``[]``, and not a torch IterableDataset."""
    return (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
            and not isinstance(dataset, torch.utils.data.IterableDataset))


class ResumableLoader:
    """Deterministic, resumable, re-shardable batches over a map-style dataset (len + __getitem__).

    Guarantees:

    - Each epoch has one global order, ``torch.randperm(len(dataset))`` seeded by
      ``seed * 1_000_003 + epoch``; it depends on neither rank nor world size.
    - Each step consumes one global batch of ``batch_size * world_size`` samples from
      that order; rank ``r`` takes the ``r``-th ``batch_size`` slice of it. Across all
      ranks every index of an epoch is used at most once per epoch, and exactly once
      except for the final remainder shorter than a global batch (drop_last).
    - ``state_dict`` / ``load_state_dict`` resume at the same sample as an uninterrupted
      run; ``reshard`` changes rank, world size or batch size from the next batch on
      without skipping or repeating a sample of the global order.
    - ``set_replicas`` (elastic training) keeps the global batch: the step still has
      ``world_size`` slots of ``batch_size`` samples, spread over fewer replicas; each
      replica takes a contiguous run of slots, as that many micro-batches
      (``accumulate``: iterate ``step_batches()``) or as one larger batch (``grow``).
      Every sample of a step is the one a fixed-size job would use in that step.
    - The batches are read through a torch ``DataLoader`` (``num_workers`` processes,
      ``prefetch_factor``, ``pin_memory``, ``persistent_workers``, ``worker_init_fn``) whose
      batch sampler yields the batches planned from this loader's logical position; the
      position is the loader's, never how far the prefetch ran. Each batch is the one
      ``collate_fn([dataset[i] for i in indices])`` gives, with or without worker processes.
      When the position jumps (``load_state_dict``, ``reshard``, ``set_replicas``, a step
      abandoned part-way) the prefetched batches are dropped and reading restarts there.

    Does not guarantee: that ranks call ``next`` the same number of times (the caller's
    step loop keeps them in lockstep); with worker processes, random numbers drawn inside
    ``dataset[i]`` come from the workers' own generators (seeded from the position the
    reading started at), not from the process's RNG that a rollback restores, so a replayed
    step redraws them alike only with ``num_workers=0``.
    """

    def __init__(
        self,
        dataset: MapStyleDataset,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        *,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> None:
        if not is_map_style(dataset):
            raise TypeError(f"ResumableLoader needs a map-style dataset (len and __getitem__), "
                            f"got {type(dataset).__name__}")
        self.dataset = dataset
        self.seed = int(seed)
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.dataset_len = len(dataset)
        self._cursor = Cursor(0, 0)
        self.last_indices: list[int] = []
        self.step_indices: list[int] = []  # every index this rank took in the current step
        self.step_epoch = 0  # the epoch the current step's samples come from
        self.mode = GROW
        self._set_shard(rank, world_size, batch_size)
        self._sampler = PlannedBatchSampler(self.seed, self.dataset_len)
        # Its own generator: a DataLoader iterator draws its workers' base seed from it, and from
        # the process's RNG otherwise, which would shift the training's random stream (dropout)
        # at every restart of reading and break the bitwise replay of a rolled-back step.
        self._worker_seeds = torch.Generator()
        # Pinning needs CUDA; without it the DataLoader would warn at every iterator.
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self._dataloader: DataLoader[Any] = DataLoader(
            dataset,  # type: ignore[arg-type]  # any len + __getitem__ object, as DataLoader reads it
            batch_sampler=self._sampler,
            collate_fn=self.collate_fn,
            num_workers=num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            worker_init_fn=worker_init_fn,
            generator=self._worker_seeds,
        )
        # Entered around each micro-batch of step_batches, with its slot: the runtime draws a slot's
        # random numbers from the stream of the rank whose slot it is (runtime/slot_rng.py).
        self.slot_draws: Callable[[int], AbstractContextManager[Any]] = lambda slot: nullcontext()
        self._batches: Iterator[Any] | None = None
        self._batches_at: tuple[Cursor, Layout] | None = None  # where the next batch of _batches is from
        self.stream_restarts = 0  # DataLoader iterators started (the first included)
        self.read_seconds = 0.0  # spent in ``next``: waiting for batches (runtime/step_timing.py)
        self.draws: DrawWatcher | None = None  # ft.dataloader's: told of each batch and position load

    @property
    def epoch(self) -> int:
        return self._cursor.epoch

    @property
    def position(self) -> int:
        """Samples consumed globally (by all ranks together) in the current epoch."""
        return self._cursor.position

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def num_workers(self) -> int:
        return self._dataloader.num_workers

    def __iter__(self) -> ResumableLoader:
        return self

    @property
    def micro_batches(self) -> int:
        """Micro-batches this replica takes per step in ``accumulate`` mode (1 when nothing is lost)."""
        return self.slot_count if self.mode == ACCUMULATE else 1

    def __next__(self) -> Any:
        """The next batch of this replica: its slice of the step's global batch (or, after an
        elastic shrink in ``accumulate`` mode, its next micro-batch of the step)."""
        started = time.perf_counter()
        try:
            return self._next_batch()
        finally:
            self.read_seconds += time.perf_counter() - started

    def _next_batch(self) -> Any:
        self._cursor = roll_if_exhausted(self._cursor, self._layout(), self.dataset_len)
        if self._cursor.slots_taken == 0:
            self.step_indices = []
            self.step_epoch = self._cursor.epoch
        at = (self._cursor, self._layout())
        if self._batches is None or self._batches_at != at:
            self._restart_reading(*at)
        assert self._batches is not None
        try:
            batch = next(self._batches)
        except BaseException:
            # The DataLoader moved past the batch that failed; its plan entry did not: read afresh.
            self._stop_reading()
            raise
        planned = self._sampler.planned.popleft()
        if (planned.cursor, planned.layout) != at:
            self._stop_reading()
            raise RuntimeError(f"ResumableLoader: the DataLoader delivered the batch planned at {planned.cursor}, "
                               f"expected the one at {self._cursor}")
        self._cursor = planned.after
        self._batches_at = (planned.after, planned.layout)
        self.last_indices = planned.indices
        self.step_indices.extend(planned.indices)
        if self.draws is not None:
            self.draws.drew()
        return batch

    def step_batches(self) -> Iterator[Any]:
        """This replica's batches for one step: one batch normally; after an elastic shrink in
        ``accumulate`` mode, one micro-batch per slot it covers. Backward each of them. What is drawn
        from the RNG while a micro-batch is read and used comes from ``slot_draws`` of its slot."""
        for index in range(self.micro_batches):
            with self.slot_draws(self.first_slot + index):
                yield next(self)

    def step_incomplete(self) -> bool:
        """True if this step took some but not all of its micro-batches (a loop calling ``next``
        once per step while an elastic shrink asks for more)."""
        return self._cursor.slots_taken != 0

    def begin_step(self) -> None:
        """Forget a step in flight that was abandoned part-way (its position was never advanced)."""
        self._cursor = replace(self._cursor, slots_taken=0)
        self.step_indices = []

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self._cursor.epoch,
            "position": self._cursor.position,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [key for key in ("epoch", "position", "seed", "dataset_len") if key not in state]
        if missing:
            raise ValueError(f"loader state is missing {', '.join(missing)}")
        if int(state["seed"]) != self.seed:
            raise ValueError(f"loader state has seed {state['seed']}, this loader has seed {self.seed}")
        if int(state["dataset_len"]) != self.dataset_len:
            raise ValueError(
                f"loader state has dataset_len {state['dataset_len']}, this dataset has {self.dataset_len} samples"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.dataset_len:
            raise ValueError(f"loader state has epoch {epoch} position {position}, out of range")
        # The batches read ahead stay valid if the position did not move (nothing was taken since).
        self._cursor = roll_if_exhausted(Cursor(epoch, position), self._layout(), self.dataset_len)
        self.last_indices = []
        self.begin_step()
        if self.draws is not None:
            self.draws.position_replaced()

    def reshard(self, rank: int, world_size: int, batch_size: int | None = None) -> None:
        """Take a new slice of the global order from the next batch on; epoch and position are kept.
        The global batch becomes ``batch_size * world_size`` (a job restarted at another size)."""
        self._set_shard(rank, world_size, self.batch_size if batch_size is None else batch_size)
        # A larger global batch may no longer fit in what is left of this epoch.
        self._cursor = roll_if_exhausted(self._cursor, self._layout(), self.dataset_len)

    def set_replicas(self, replica: int, replicas: int, mode: str = GROW) -> None:
        """Elastic training: spread the ``world_size`` slots of every step over ``replicas`` replicas,
        keeping the global batch and its samples; this one is replica number ``replica``.

        Slots are split as evenly as possible, the first ``world_size % replicas`` replicas taking
        one more; ``replicas == world_size`` is the fixed-size layout (one slot each)."""
        if mode not in ELASTIC_BATCH_MODES:
            raise ValueError(f"elastic_batch must be one of {', '.join(ELASTIC_BATCH_MODES)}, got {mode!r}")
        if not 1 <= replicas <= self.world_size or not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} of {replicas} does not fit a world of {self.world_size} slots")
        self.first_slot, self.slot_count = replica_slots(replica, replicas, self.world_size)
        self.mode = mode
        self.begin_step()

    def _set_shard(self, rank: int, world_size: int, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank} with world_size {world_size}")
        if self.dataset_len < batch_size * world_size:
            raise ValueError(
                f"dataset has {self.dataset_len} samples, fewer than one global batch of "
                f"{batch_size * world_size} (batch_size {batch_size} x world_size {world_size})"
            )
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.first_slot = rank  # the step's slots this replica takes (see set_replicas)
        self.slot_count = 1

    def _layout(self) -> Layout:
        return Layout(self.batch_size, self.world_size, self.first_slot, self.slot_count, self.mode)

    def _restart_reading(self, cursor: Cursor, layout: Layout) -> None:
        """A DataLoader iterator whose first batch is the one at ``cursor``. Without persistent workers
        the old iterator's processes are shut down and new ones started; with them, torch keeps the
        processes and only waits for the batches they already had in hand (``iter`` resets them)."""
        self._stop_reading()
        self._sampler.start = (cursor, layout)
        self._worker_seeds.manual_seed(hash((self.seed, cursor.epoch, cursor.position)) & SEED_MASK)
        self._batches = iter(self._dataloader)
        self._batches_at = (cursor, layout)
        self.stream_restarts += 1

    def _stop_reading(self) -> None:
        self._batches = None  # the last reference to a non-persistent iterator: its workers exit
        self._batches_at = None
