"""A wrapped model's buffers (BatchNorm's running statistics): broadcast from the group's first rank
as DDP's ``broadcast_buffers`` does, and wound back with a failed step.

Runs in the worker. A forward in training mode changes buffers on every rank, each from its own
batch; DDP then broadcasts rank 0's at the start of the next forward, so rank 0's are the ones that
go on. Here the broadcast happens where a step can still be refused, before its commit vote (and
before each further averaging round of the step), so at every commit boundary every rank holds rank
0's buffers, the state a replacement receives and a checkpoint keeps, whichever rank was lost. A
failed step's forwards changed them too: ``roll_back`` puts back the boundary's values. The copy
taken at each boundary is of the buffers changed since the one before (their version counters
say which), so a model's constant buffers (a causal mask) are copied once.
"""

from __future__ import annotations

import torch

from undying.runtime.pg import GenerationGroup, flat_views


class BufferSync:
    """The buffers of ``module``: ``broadcast`` from a group rank, ``mark_commit_boundary`` and
    ``roll_back`` to it. Buffers are looked up by name each time (a module may reassign one)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._boundary: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (copy, version it copies)

    def named(self) -> dict[str, torch.Tensor]:
        return dict(self._module.named_buffers())

    @torch.no_grad()
    def broadcast(self, group: GenerationGroup, root: int = 0) -> None:
        """Every rank's buffers made ``root``'s: one broadcast per dtype, in ``named_buffers`` order."""
        broadcast_tensors(group, list(self.named().values()), root)

    @torch.no_grad()
    def mark_commit_boundary(self) -> None:
        """Copy the buffers changed since the last boundary (all of them the first time)."""
        for name, buffer in self.named().items():
            kept = self._boundary.get(name)
            if kept is None or kept[1] != buffer._version or kept[0].shape != buffer.shape:
                self._boundary[name] = (buffer.detach().clone(), buffer._version)

    @torch.no_grad()
    def roll_back(self) -> None:
        """Put back every buffer a failed step changed, as it was at the last boundary."""
        for name, buffer in self.named().items():
            kept = self._boundary.get(name)
            if kept is not None and kept[1] != buffer._version and kept[0].shape == buffer.shape:
                buffer.copy_(kept[0])
                self._boundary[name] = (kept[0], buffer._version)


def broadcast_tensors(group: GenerationGroup, tensors: list[torch.Tensor], root: int) -> None:
    """``tensors`` made ``root``'s on every rank of ``group``: one broadcast per dtype, in order. A
    tensor already equal to root's is not written, so its version counter says it did not change."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same_dtype in by_dtype.values():
        flat = torch.cat([tensor.reshape(-1) for tensor in same_dtype])
        group.broadcast(flat, root)
        for tensor, view in zip(same_dtype, flat_views(same_dtype, flat), strict=True):
            if not torch.equal(tensor, view):
                tensor.copy_(view)
