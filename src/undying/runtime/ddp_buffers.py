"""A wrapped model's buffers (BatchNorm's running statistics): broadcast from the group's first rank
as DDP's ``broadcast_buffers`` does, and wound back with a failed step.

Runs in the worker. A forward in training mode changes buffers on every rank, each from its own
batch; DDP then broadcasts rank 0's at the start of the next forward, so rank 0's are the ones that
go on. Here the broadcast happens where a step can still be refused, before its commit vote (and
before each further averaging round of the step), so at every commit boundary every rank holds rank
0's buffers, the state a replacement receives and a checkpoint keeps, whichever rank was lost. A
failed step's forwards changed them too: ``roll_back`` puts back the boundary's values, copied at
each boundary (a copy of the buffers per step: BatchNorm's statistics are small; a large constant
buffer, a causal mask, costs its copy bandwidth).
"""

from __future__ import annotations

import torch

from undying.runtime.pg import GenerationGroup, flat_views


class BufferSync:
    """The buffers of ``module``: ``broadcast`` from a group rank, ``mark_commit_boundary`` and
    ``roll_back`` to it. The buffers are those the module has when wrapped (as DDP's), each read
    from its submodule by name every time: a module may reassign one (or set it to None)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._boundary: dict[str, torch.Tensor] = {}  # name -> its value at the last commit boundary
        # (full name, owning submodule, attribute): found once, not by a walk of the module tree twice a step.
        self._places: list[tuple[str, torch.nn.Module, str]] = [
            (full_name, module.get_submodule(full_name.rpartition(".")[0]), full_name.rpartition(".")[2])
            for full_name, _ in module.named_buffers()]

    def named(self) -> dict[str, torch.Tensor]:
        found = ((name, getattr(owner, attribute, None)) for name, owner, attribute in self._places)
        return {name: buffer for name, buffer in found if isinstance(buffer, torch.Tensor)}

    @torch.no_grad()
    def broadcast(self, group: GenerationGroup, root: int = 0) -> None:
        """Every rank's buffers made ``root``'s: one broadcast per dtype, in ``named_buffers`` order."""
        broadcast_tensors(group, list(self.named().values()), root)

    @torch.no_grad()
    def mark_commit_boundary(self) -> None:
        """Copy every buffer (into the copy kept from the boundary before, where it still fits): a
        buffer's version counter cannot tell, BatchNorm's kernels update the running statistics
        without bumping it."""
        named = self.named()
        for name, buffer in named.items():
            kept = self._boundary.get(name)
            if kept is None or kept.shape != buffer.shape or kept.dtype != buffer.dtype:
                self._boundary[name] = buffer.detach().clone()
            else:
                kept.copy_(buffer)
        for name in set(self._boundary) - set(named):
            del self._boundary[name]

    @torch.no_grad()
    def roll_back(self) -> None:
        """Put back every buffer as it was at the last boundary (a failed step's forwards changed them)."""
        for name, buffer in self.named().items():
            kept = self._boundary.get(name)
            if kept is not None and kept.shape == buffer.shape:
                buffer.copy_(kept)


def broadcast_tensors(group: GenerationGroup, tensors: list[torch.Tensor], root: int) -> None:
    """``tensors`` made ``root``'s on every rank of ``group``: one broadcast per dtype, in order."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same_dtype in by_dtype.values():
        flat = torch.cat([tensor.reshape(-1) for tensor in same_dtype])
        group.broadcast(flat, root)
        for tensor, view in zip(same_dtype, flat_views(same_dtype, flat), strict=True):
            tensor.copy_(view)
