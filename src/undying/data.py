"""Deterministic, resumable, re-shardable batching over a map-style dataset.

Runs in worker processes: each rank holds one ``ResumableLoader`` (made by
``ft.dataloader``); its ``state_dict`` is part of every snapshot, and ``reshard``
is how an elastic world-size change keeps the global sample order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils.data import default_collate

# Mixed into the per-epoch seed so that epoch e of seed s never equals epoch e' of seed s'
# for small values (a prime larger than any realistic epoch count).
EPOCH_SEED_STRIDE = 1_000_003


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

    def __next__(self) -> Any:
        self._roll_if_exhausted()
        start = self._position + self.rank * self.batch_size
        indices = self._epoch_order()[start : start + self.batch_size]
        self._position += self.global_batch_size
        self._roll_if_exhausted()
        self.last_indices = indices
        return self.collate_fn([self.dataset[i] for i in indices])

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
        self._roll_if_exhausted()

    def reshard(self, rank: int, world_size: int, batch_size: int | None = None) -> None:
        """Take a new slice of the global order from the next batch on; epoch and position are kept."""
        self._set_shard(rank, world_size, self.batch_size if batch_size is None else batch_size)
        # A larger global batch may no longer fit in what is left of this epoch.
        self._roll_if_exhausted()

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
