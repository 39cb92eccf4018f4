"""One gradient bucket: gathered from the parameters, summed over the generation's group, written back;
plainly (DDP's reducer) or through one of torch's stock communication hooks.

Runs in the worker. The arithmetic is DDP's, operation for operation, so a bucket laid out as DDP's
sums to the same bits: without a hook each gradient is multiplied by ``1 / world`` as it is copied
in (DDP's ``mul_out`` with a wrapped scalar) and the sum is the average; ``allreduce_hook`` divides
the bucket, then sums; ``fp16_compress_hook`` and ``bf16_compress_hook`` cast it to 16 bits, divide,
sum in 16 bits and copy the result back. After an elastic shrink the factor is the replica's share
of the step's batch slots (``weight / slots``) instead of ``1 / world``.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from undying._torch_compat.tensors import foreach_copy
from undying.runtime.pg import GenerationGroup, flat_views

STOCK_HOOKS_MODULE = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"
# From this many elements a gradient is multiplied into its bucket by a call of its own, where a
# smaller one is copied with the others in one fused call and scaled in another: the pass over its
# bytes saved outweighs a call. On a CPU about even at 16k float32 elements (bench/studies/
# bucket_gather.py); on an accelerator a call is a kernel launch of microseconds and a pass over 16
# MiB takes about as long, so only gradients above that go one by one there.
FUSED_MIN_ELEMENTS = {"cpu": 1 << 14}
FUSED_MIN_ELEMENTS_ACCELERATOR = 1 << 22


class CommHook(enum.Enum):
    """How a bucket is summed: DDP's reducer, or one of torch's stock hooks (by its function name)."""

    NONE = "none"
    ALLREDUCE = "allreduce_hook"
    FP16_COMPRESS = "fp16_compress_hook"
    BF16_COMPRESS = "bf16_compress_hook"

    @property
    def wire_dtype(self) -> torch.dtype | None:
        return {CommHook.FP16_COMPRESS: torch.float16, CommHook.BF16_COMPRESS: torch.bfloat16}.get(self)


def stock_hook(hook: Callable[..., Any]) -> CommHook | None:
    """Which stock hook ``hook`` is (None: not one of torch's). Looked up, never imported: a script
    that passes one has imported its module already."""
    module = sys.modules.get(STOCK_HOOKS_MODULE)
    for kind in (CommHook.ALLREDUCE, CommHook.FP16_COMPRESS, CommHook.BF16_COMPRESS):
        if module is not None and hook is getattr(module, kind.value, None):
            return kind
    return None


def copied_spans(numels: list[int], fused: list[bool]) -> list[tuple[int, int]]:
    """The (start, end) offsets in a bucket of each run of consecutive parameters not ``fused``."""
    spans: list[tuple[int, int]] = []
    offset = 0
    for numel, alone in zip(numels, fused, strict=True):
        if not alone and numel:
            if spans and spans[-1][1] == offset:
                spans[-1] = (spans[-1][0], offset + numel)
            else:
                spans.append((offset, offset + numel))
        offset += numel
    return spans


class Bucket:
    """A flat buffer holding the gradients of a fixed run of parameters of one dtype."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=device)
        self.views = flat_views(params, self.flat)
        # Which gradients are multiplied into the buffer one call each (one pass over their bytes)
        # rather than copied in one fused call and then scaled (two passes), and the spans of the
        # buffer the others fill, end to end, each scaled in one call.
        least = FUSED_MIN_ELEMENTS.get(device.type, FUSED_MIN_ELEMENTS_ACCELERATOR)
        self.fused = [param.numel() >= least for param in params]
        self.copied_spans = copied_spans([param.numel() for param in params], self.fused)
        self.generation: int | None = None  # the generation whose collectives this buffer was given to
        self._wire: torch.Tensor | None = None  # the 16-bit copy a compressing hook sums

    def use_in(self, generation: int) -> None:
        """A fresh buffer for each generation: a collective of an abandoned generation may still
        write into the buffer it was handed (a peer that froze mid all-reduce wakes up and sends
        its part), and it must not land in the gradients of a later step."""
        if self.generation is not None and self.generation != generation:
            self.flat = torch.zeros_like(self.flat)
            self.views = flat_views(self.params, self.flat)
        self.generation = generation

    @torch.no_grad()
    def gather(self, hook: CommHook, weight: int, divisor: int) -> None:
        """This rank's gradients into the buffer (zeros for a parameter without one), each multiplied
        by the bucket's factor on the way: DDP's ``mul_out`` of each gradient by a wrapped scalar,
        the same product per element, so the same bits."""
        scale = weight / divisor if hook is CommHook.NONE else weight
        sources, destinations = [], []
        for param, view, fused in zip(self.params, self.views, self.fused, strict=True):
            grad = param.grad
            if grad is None:
                view.zero_()
            elif fused and scale != 1:
                torch.mul(grad, scale, out=view)
            else:
                sources.append(grad)
                destinations.append(view)
        if destinations:
            foreach_copy(destinations, sources)  # one fused call, not a dispatch per parameter
        if scale != 1:
            for start, end in self.copied_spans:
                self.flat[start:end].mul_(scale)

    @torch.no_grad()
    def start(self, group: GenerationGroup, hook: CommHook, divisor: int) -> dist.Work | None:
        """Start the sum of the gathered buffer over ``group`` (None: a group of one)."""
        if hook is CommHook.ALLREDUCE:
            self.flat.div_(divisor)
        wire_dtype = hook.wire_dtype
        if wire_dtype is None:
            return group.start_allreduce(self.flat)
        self._wire = self.flat.to(wire_dtype).div_(divisor)
        return group.start_allreduce(self._wire)

    @torch.no_grad()
    def finish(self, as_view: bool, skip: set[int], correction: float = 0.0,
               before: dict[int, torch.Tensor] | None = None) -> None:
        """The sum back into the buffer (a compressed one decompressed), plus ``correction`` times each
        parameter's earlier average in ``before`` (by id), then into the gradients, but those of
        parameters in ``skip`` (by id)."""
        if self._wire is not None:
            self.flat.copy_(self._wire)
            self._wire = None
        sources, destinations = [], []
        for param, view in zip(self.params, self.views, strict=True):
            if correction and before is not None and id(param) in before:
                view.add_(before[id(param)], alpha=correction)
            if id(param) in skip:
                continue
            if as_view:
                if param.grad is not view:
                    param.grad = view
            elif param.grad is None:
                param.grad = view.clone()
            else:
                sources.append(view)
                destinations.append(param.grad)
        if destinations:
            foreach_copy(destinations, sources)
