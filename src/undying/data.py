"""Deterministic, resumable, re-shardable batching over a map-style dataset.

Runs in worker processes: each rank holds one ``ResumableLoader`` (made by
``ft.dataloader``); its ``state_dict`` is part of every snapshot, and ``reshard``
and ``set_replicas`` are how a world-size change keeps the global sample order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import default_collate

# Mixed into the per-epoch seed so that epoch e of seed s never equals epoch e' of seed s'
# for small values (a prime larger than any realistic epoch count).
EPOCH_SEED_STRIDE = 1_000_003

# How a replica covers the slots of lost replicas after an elastic shrink: more micro-batches
# per step (gradient accumulation, same memory per forward) or one larger batch.
ACCUMULATE = "accumulate"
GROW = "grow"
ELASTIC_BATCH_MODES = (ACCUMULATE, GROW)


def replica_slots(replica: int, replicas: int, slots: int) -> tuple[int, int]:
    """(first slot, slot count) of ``replica`` when a step's ``slots`` batch slots are spread over
    ``replicas`` replicas in contiguous runs, the first ``slots % replicas`` taking one more."""
    per_replica, extra = divmod(slots, replicas)
    return replica * per_replica + min(replica, extra), per_replica + (1 if replica < extra else 0)


class MapStyleDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


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

    Does not guarantee: that ranks call ``next`` the same number of times (the caller's
    step loop keeps them in lockstep), nor any worker-process prefetching; batches are
    read on the calling thread.
    """

    def __init__(
        self,
        dataset: MapStyleDataset,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.seed = int(seed)
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.dataset_len = len(dataset)
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order: list[int] = []
        self.last_indices: list[int] = []
        self.step_indices: list[int] = []  # every index this rank took in the current step
        self.step_epoch = 0  # the epoch the current step's samples come from
        self.mode = ACCUMULATE
        self._slots_taken = 0  # micro-batches already handed out in this step (accumulate)
        self._set_shard(rank, world_size, batch_size)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """Samples consumed globally (by all ranks together) in the current epoch."""
        return self._position

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def __iter__(self) -> ResumableLoader:
        return self

    @property
    def micro_batches(self) -> int:
        """Micro-batches this replica takes per step in ``accumulate`` mode (1 when nothing is lost)."""
        return self.slot_count if self.mode == ACCUMULATE else 1

    def __next__(self) -> Any:
        """The next batch of this replica: its slice of the step's global batch (or, after an
        elastic shrink in ``accumulate`` mode, its next micro-batch of the step)."""
        self._roll_if_exhausted()
        if self._slots_taken == 0:
            self.step_indices = []
            self.step_epoch = self._epoch
        order = self._epoch_order()
        if self.mode == ACCUMULATE:
            start = self._position + (self.first_slot + self._slots_taken) * self.batch_size
            indices = order[start : start + self.batch_size]
            self._slots_taken += 1
        else:
            start = self._position + self.first_slot * self.batch_size
            indices = order[start : start + self.slot_count * self.batch_size]
            self._slots_taken = self.slot_count
        if self._slots_taken == self.slot_count:
            self._slots_taken = 0
            self._position += self.global_batch_size
            self._roll_if_exhausted()
        self.last_indices = indices
        self.step_indices.extend(indices)
        return self.collate_fn([self.dataset[i] for i in indices])

    def step_batches(self) -> Iterator[Any]:
        """This replica's batches for one step: one batch normally; after an elastic shrink in
        ``accumulate`` mode, one micro-batch per slot it covers. Backward each of them."""
        for _ in range(self.micro_batches):
            yield next(self)

    def step_incomplete(self) -> bool:
        """True if this step took some but not all of its micro-batches (a loop calling ``next``
        once per step while an elastic shrink asks for more)."""
        return self._slots_taken != 0

    def begin_step(self) -> None:
        """Forget a step in flight that was abandoned part-way (its position was never advanced)."""
        self._slots_taken = 0
        self.step_indices = []

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self._epoch,
            "position": self._position,
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
        self._epoch = epoch
        self._position = position
        self.last_indices = []
        self.begin_step()
        self._roll_if_exhausted()

    def reshard(self, rank: int, world_size: int, batch_size: int | None = None) -> None:
        """Take a new slice of the global order from the next batch on; epoch and position are kept.
        The global batch becomes ``batch_size * world_size`` (a job restarted at another size)."""
        self._set_shard(rank, world_size, self.batch_size if batch_size is None else batch_size)
        # A larger global batch may no longer fit in what is left of this epoch.
        self._roll_if_exhausted()

    def set_replicas(self, replica: int, replicas: int, mode: str = ACCUMULATE) -> None:
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

    def _roll_if_exhausted(self) -> None:
        if self.dataset_len - self._position < self.global_batch_size:
            self._epoch += 1
            self._position = 0

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * EPOCH_SEED_STRIDE + self._epoch)
            self._order = torch.randperm(self.dataset_len, generator=generator).tolist()
            self._order_epoch = self._epoch
        return self._order
