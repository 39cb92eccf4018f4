"""Which parameters share a gradient bucket, in DDP's own two layouts, and the job state that picks one.

Runs in the worker. DDP reduces its first averaged backward pass in one bucket per dtype holding
the parameters in registration order, and every later one in buckets rebuilt from the order in
which that first backward produced the gradients (cut at 1 MiB for the first bucket, then at
``bucket_cap_mb``; torch's own ``_compute_bucket_assignment_by_size`` computes both). Under gloo a
bucket's layout decides which ring chunk an element is summed in, and so its rounding with more
than two ranks: to end bitwise where DDP ends, undying uses the same two layouts. The recorded
order is job state (``BucketOrder``, registered with the step transaction): a replacement receives
it, a checkpoint keeps it, and a failed first step rolls it back, so every replay of a step sums in
the layout of the step it replaces.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from undying._torch_compat.dist import bucket_assignment_by_size

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25  # DDP's default bucket_cap_mb
DEFAULT_FIRST_BUCKET_BYTES = MIB  # DDP's smaller first rebuilt bucket, when bucket_cap_mb is left out


def initial_layout(params: list[torch.nn.Parameter], find_unused_parameters: bool,
                   first_cap_bytes: int, cap_bytes: int) -> list[list[int]]:
    """DDP's buckets before its first averaged backward: one per dtype in registration order (with
    ``find_unused_parameters``, cut at ``[first_cap_bytes, cap_bytes]``), the list of buckets reversed."""
    limits = [first_cap_bytes, cap_bytes] if find_unused_parameters else [sys.maxsize]
    return list(reversed(bucket_assignment_by_size(list[torch.Tensor](params), limits)))


def rebuilt_layout(params: list[torch.nn.Parameter], ready_order: list[int], first_cap_bytes: int,
                   cap_bytes: int) -> list[list[int]]:
    """DDP's buckets after its first averaged backward: the parameters in the order that backward
    produced their gradients, cut when a bucket reaches ``first_cap_bytes``, then ``cap_bytes``."""
    ordered: list[torch.Tensor] = [params[index] for index in ready_order]
    return bucket_assignment_by_size(ordered, [first_cap_bytes, cap_bytes], ready_order)


def complete_order(fired: list[int], count: int) -> list[int]:
    """The ready order of a backward that produced gradients for ``fired`` (in that order): as DDP's,
    parameters without a gradient come first (DDP marks them ready before the backward runs)."""
    seen = set(fired)
    return [index for index in range(count) if index not in seen] + list(dict.fromkeys(fired))


class BucketOrder:
    """The gradient order recorded in the job's first averaged backward (None before it): the state
    that chooses between the two layouts. Registered with the step transaction as ``ddp.<n>.bucket_order``."""

    def __init__(self, parameter_count: int) -> None:
        self.parameter_count = parameter_count
        self.ready_order: list[int] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"ready_order": None if self.ready_order is None else list(self.ready_order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        order = state.get("ready_order")
        if order is not None and sorted(order) != list(range(self.parameter_count)):
            raise ValueError(f"ddp bucket order: the state holds an order of {len(order)} parameters; this "
                             f"model has {self.parameter_count} that require gradients")
        self.ready_order = None if order is None else [int(index) for index in order]
