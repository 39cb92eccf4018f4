"""A user's own stateful loader or iterable dataset, made part of the step transaction.

Runs in worker processes: ``ft.dataloader`` wraps an iterable that has ``state_dict`` and
``load_state_dict`` (torchdata's ``StatefulDataLoader``, a stateful ``IterableDataset``) in a
``StatefulIterableLoader`` and registers it, so a failed step rewinds it with the rest of the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import default_collate

from undying.data.loader import DrawWatcher

__all__ = ["StatefulIterableLoader", "is_stateful_iterable", "iterable_loader"]


def is_stateful_iterable(source: object) -> bool:
    """Iterable with ``state_dict`` and ``load_state_dict`` (duck typing: no torchdata import)."""
    return all(callable(getattr(source, name, None)) for name in ("__iter__", "state_dict", "load_state_dict"))


def iterable_loader(source: Any, batch_size: int | None, collate_fn: Callable[[list[Any]], Any] | None, *,
                    elastic: bool, worker_options: dict[str, Any]) -> StatefulIterableLoader:
    """``ft.dataloader`` for what is not a map-style dataset: refused in a job that may shrink
    (``elastic``) or with DataLoader options set (``worker_options``: name -> value), else wrapped."""
    if elastic:
        raise ValueError(f"ft.dataloader: {type(source).__name__} is not a map-style dataset; with "
                         f"elastic-training in recover_strategy only a map-style dataset (len and "
                         f"__getitem__) is allowed, its batches can be respread over fewer replicas")
    set_options = [name for name, value in worker_options.items() if value not in (0, False, None)]
    if set_options:
        raise ValueError(f"ft.dataloader: {', '.join(set_options)} apply to a map-style dataset only; give "
                         f"them to your own loader (e.g. a StatefulDataLoader) instead")
    return StatefulIterableLoader(source, batch_size, collate_fn)


class StatefulIterableLoader:
    """Batches from a stateful iterable, for jobs that cannot shrink (no ``elastic-training``).

    ``source`` yields batches itself (``batch_size=None``: a loader) or samples that this object
    groups ``batch_size`` at a time with ``collate_fn`` (an iterable dataset, read on this thread).

    Guarantees: ``state_dict`` is the source's, as of the batches handed out; ``load_state_dict``
    loads it into the source and drops the iterator held, so the next batch is the first one after
    the loaded position, provided the source's next ``iter`` resumes there (as torchdata's
    ``StatefulDataLoader`` does). A pass that ends raises ``StopIteration`` once (a last group of
    samples shorter than ``batch_size`` is dropped); the next ``next`` starts the source's next pass.

    Does not guarantee: one global sample order across ranks or world sizes (the source shards
    itself), hence no ``reshard``/``set_replicas``; nor that a replacement rank gets its own
    position: like every registered object it receives the live replica's state, which is right
    when every rank's position is the same count (a ``DistributedSampler`` behind the loader).
    """

    def __init__(self, source: Any, batch_size: int | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        if not is_stateful_iterable(source):
            raise TypeError(f"ft.dataloader: {type(source).__name__} has no state_dict/load_state_dict, so it "
                            f"cannot resume at the committed step; pass a map-style dataset (len and "
                            f"__getitem__) or an iterable with state_dict and load_state_dict "
                            f"(e.g. torchdata's StatefulDataLoader)")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.source = source
        self.batch_size = batch_size
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self._items: Iterator[Any] | None = None
        self.draws: DrawWatcher | None = None  # ft.dataloader's: told of each batch and position load
        self.read_seconds = 0.0  # spent in ``next``: waiting for batches (runtime/step_timing.py)

    def __iter__(self) -> StatefulIterableLoader:
        return self

    def __next__(self) -> Any:
        started = time.perf_counter()
        try:
            return self._next_batch()
        finally:
            self.read_seconds += time.perf_counter() - started

    def _next_batch(self) -> Any:
        if self._items is None:
            self._items = iter(self.source)
        if self.batch_size is None:
            batch = self._take()
        else:
            # A pass's last samples, fewer than a batch, are dropped with its StopIteration (drop_last).
            batch = self.collate_fn([self._take() for _ in range(self.batch_size)])
        if self.draws is not None:
            self.draws.drew()
        return batch

    def step_batches(self) -> Iterator[Any]:
        """One batch: the loop shape of ``ResumableLoader.step_batches`` (this loader never shrinks)."""
        yield next(self)

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)
        self._items = None
        if self.draws is not None:
            self.draws.position_replaced()

    def _take(self) -> Any:
        assert self._items is not None
        try:
            return next(self._items)
        except StopIteration:
            self._items = None  # the pass is over: the next ``next`` starts the next one
            raise
