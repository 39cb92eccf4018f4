"""What ``ft.dataloader`` builds: a ``ResumableLoader`` over a map-style dataset, or a registered
``StatefulIterableLoader`` over a user's stateful iterable; either way part of the step transaction
and watched by the draw ledger (runtime/carried_batches.py).

Runs in the worker, called by the runtime (runtime/core.py).
"""

from __future__ import annotations

from typing import Any

import torch

from undying.data import ResumableLoader, is_map_style
from undying.data.iterable import StatefulIterableLoader, iterable_loader
from undying.runtime.carried_batches import DrawLedger
from undying.runtime.training_state import TrainingState


def build_loader(state: TrainingState, draws: DrawLedger, dataset: Any, batch_size: int | None, seed: int,
                 collate_fn: Any, worker_options: dict[str, Any], *, rank: int, world_size: int,
                 device: torch.device, elastic: bool) -> ResumableLoader | StatefulIterableLoader:
    """The loader of ``dataset`` for this rank, taken into ``state``: a map-style dataset's in its
    loaders (the caller then gives it this generation's share), an iterable registered as
    ``dataloader.<n>``. ``worker_options``: the torch DataLoader's (num_workers, pin_memory,
    persistent_workers, prefetch_factor, worker_init_fn); pinning only where ``device`` is CUDA."""
    if not is_map_style(dataset):
        stateful = iterable_loader(dataset, batch_size, collate_fn, elastic=elastic, worker_options=worker_options)
        state.register(f"dataloader.{sum(name.startswith('dataloader.') for name in state.statefuls)}", stateful)
        stateful.draws = draws
        return stateful
    if batch_size is None:
        raise ValueError("ft.dataloader: batch_size is required for a map-style dataset (an integer >= 1)")
    options = {**worker_options, "pin_memory": worker_options.get("pin_memory", False) and device.type == "cuda"}
    loader = ResumableLoader(dataset, batch_size, seed, rank, world_size, collate_fn, **options)
    loader.draws = draws
    state.loaders.append(loader)
    return loader
