"""Gradient sync with a fixed layout: DDP semantics whose float sums replay bit for bit.

Runs in the worker. Stock DDP rebuilds its buckets after the first iteration, so the
first step after a restart sums gradients in a different layout and the run
diverges (measured: docs/design.md, "Why the gradient sync is not DDP"). Here the layout depends only on the
parameter list: one flat buffer per dtype, parameters in registration order, plus
one vote slot. Every replay of a step therefore sums every element in the same
ring position and order. The vote is summed in a dtype that counts ranks exactly (a bf16
sum of ones stops at 256): in the float32 (or float64) buffer, else in a one-element float32
all-reduce of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from undying.runtime.pg import GenerationGroup, flat_views

# Dtypes whose sum of ones stays exact far beyond any job's size (float32: up to 2**24 ranks).
EXACT_VOTE_DTYPES = (torch.float32, torch.float64)
SEPARATE_VOTE_DTYPE = torch.float32  # the vote's own all-reduce when no gradient bucket counts exactly


def vote_bucket_index(dtypes: list[torch.dtype]) -> int | None:
    """Which gradient bucket carries the vote slot: the first whose dtype counts ranks exactly, or
    None (the vote is then all-reduced on its own). An fp32-only model keeps its one bucket + slot."""
    for index, dtype in enumerate(dtypes):
        if dtype in EXACT_VOTE_DTYPES:
            return index
    return None


class _Bucket:
    """One flat buffer holding the gradients of all parameters of one dtype."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device, with_vote: bool,
                 dtype: torch.dtype | None = None) -> None:
        self.params = params
        numel = sum(p.numel() for p in params)
        self.vote_index = numel if with_vote else None
        self.numel = numel
        self.flat = torch.zeros(numel + (1 if with_vote else 0), dtype=dtype or params[0].dtype, device=device)
        self.views = flat_views(params, self.flat[:numel])
        self.generation: int | None = None  # the generation whose collectives this buffer was given to

    def use_in(self, generation: int) -> None:
        """A fresh buffer for each generation: a collective of an abandoned generation may still
        write into the buffer it was handed (a peer that froze mid all-reduce wakes up and sends
        its part), and it must not land in the gradients of a later step."""
        if self.generation is not None and self.generation != generation:
            self.flat = torch.zeros_like(self.flat)
            self.views = flat_views(self.params, self.flat[:self.numel])
        self.generation = generation


class FixedLayoutDDP(torch.nn.Module):
    """Wraps a model so gradients are averaged over the current data-parallel world.

    Guarantees: after ``sync_gradients()`` every rank holds the same averaged
    gradients, computed in an order that depends only on the parameter list and
    the world size (bitwise-reproducible replays). Parameters and buffers start
    equal on every rank (broadcast from rank 0 at wrap time). Does not overlap
    communication with the backward pass; the sync happens once, at ``opt.step()``.
    A parameter without a gradient on a rank contributes zeros.

    After an elastic shrink (``set_replica_share``) the average stays the one over the
    job's full global batch: each replica's gradient is weighted by the share of the
    step's batch slots it covered and the sum is divided by the number of slots.
    """

    def __init__(self, module: torch.nn.Module, group_of: Callable[[], GenerationGroup],
                 device: torch.device, broadcast: bool = True) -> None:
        super().__init__()
        self.module = module
        self._group_of = group_of
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("wrap_model: the model has no parameters that require gradients")
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param in params:
            by_dtype.setdefault(param.dtype, []).append(param)
        vote_in = vote_bucket_index(list(by_dtype))
        self._buckets = [_Bucket(group, device, with_vote=(index == vote_in))
                         for index, group in enumerate(by_dtype.values())]
        # No exact gradient dtype (a bf16/fp16-only model): the vote is its own one-element all-reduce.
        self._vote_bucket = (None if vote_in is not None
                             else _Bucket([], device, with_vote=True, dtype=SEPARATE_VOTE_DTYPE))
        self._gradient_weight = 1  # slots covered by one backward of this replica (elastic ``grow``)
        self._slots_per_step: int | None = None  # None: divide by the process group's size
        if broadcast:
            self.sync_parameters()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_parameters(self, root: int = 0) -> None:
        """Make every rank's parameters and buffers equal to ``root``'s."""
        group = self._group_of()
        tensors = [p.data for p in self.module.parameters()] + list(self.module.buffers())
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same_dtype])
            group.broadcast(flat, root)
            for tensor, view in zip(same_dtype, flat_views(same_dtype, flat), strict=True):
                tensor.copy_(view)

    def set_replica_share(self, gradient_weight: int, slots_per_step: int | None) -> None:
        """Elastic training: this replica's gradient stands for ``gradient_weight`` batch slots (one
        larger batch) and the step's gradient is the sum over ``slots_per_step`` slots divided by it.
        ``(1, None)`` is the plain data-parallel mean over the group."""
        self._gradient_weight = gradient_weight
        self._slots_per_step = slots_per_step

    @torch.no_grad()
    def sync_gradients(self, vote_ok: bool = True) -> bool:
        """Average gradients over the world; returns True iff every rank voted its step ok."""
        group = self._group_of()
        world_size = group.world_size
        all_ok = True
        for bucket in self._buckets:
            bucket.use_in(group.generation)
            for param, view in zip(bucket.params, bucket.views, strict=True):
                if param.grad is None:
                    view.zero_()
                else:
                    view.copy_(param.grad)
            if self._gradient_weight != 1:
                bucket.flat.mul_(self._gradient_weight)
            if bucket.vote_index is not None:
                bucket.flat[bucket.vote_index] = 1.0 if vote_ok else 0.0
            group.allreduce_sum(bucket.flat)
            if bucket.vote_index is not None:
                all_ok = int(bucket.flat[bucket.vote_index].item()) == world_size
            bucket.flat.div_(self._slots_per_step or world_size)
            for param, view in zip(bucket.params, bucket.views, strict=True):
                if param.grad is None:
                    param.grad = view.clone()
                else:
                    param.grad.copy_(view)
        if self._vote_bucket is not None:
            vote = self._vote_bucket
            vote.use_in(group.generation)
            vote.flat[0] = 1.0 if vote_ok else 0.0
            group.allreduce_sum(vote.flat)
            all_ok = int(vote.flat[0].item()) == world_size
        return all_ok

    @property
    def vote_dtype(self) -> torch.dtype:
        """The dtype the commit vote is summed in."""
        if self._vote_bucket is not None:
            return self._vote_bucket.flat.dtype
        return next(bucket.flat.dtype for bucket in self._buckets if bucket.vote_index is not None)
