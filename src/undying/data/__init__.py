"""The worker's data loading: deterministic, resumable, re-shardable batches that are part of each step.

Runs in worker processes (``ft.dataloader`` makes the loaders). ``loader.py`` holds
``ResumableLoader`` (a map-style dataset through a torch DataLoader), ``sampler.py`` the batch plan
it follows (which sample indices come next from a logical position), and ``iterable.py`` the wrapper
for a user's own stateful loader or iterable dataset. A training script may import the loader from
here (``from undying.data import ResumableLoader``).
"""

from __future__ import annotations

from undying.data.loader import (
    ACCUMULATE,
    ELASTIC_BATCH_MODES,
    EPOCH_SEED_STRIDE,
    GROW,
    DrawWatcher,
    MapStyleDataset,
    ResumableLoader,
    is_map_style,
    replica_slots,
)

__all__ = ["ACCUMULATE", "ELASTIC_BATCH_MODES", "EPOCH_SEED_STRIDE", "GROW", "DrawWatcher", "MapStyleDataset",
           "ResumableLoader", "is_map_style", "replica_slots"]
