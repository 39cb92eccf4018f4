"""FSDP2 internals: a ``fully_shard``-ed module's parameter groups. Runs in the worker.

FSDP2's public API (``FSDPModule``: ``reshard``, ``reset_iter_state``, ``set_*``) says nothing about
which mesh a module's parameters are sharded over, and offers no way to drop the gradients a failed
backward left on the unsharded parameters. Known to work with torch 2.13.0. Nothing here imports
FSDP: a module that was never ``fully_shard``-ed simply has no parameter groups.
"""

from __future__ import annotations

from typing import Any

import torch


def _param_groups(module: torch.nn.Module) -> list[Any]:
    """``module``'s own FSDP parameter groups (none if ``fully_shard`` was not applied to it).

    Needs ``FSDPModule._get_fsdp_state()._fsdp_param_groups``: the groups are FSDP's internal state."""
    state_of = getattr(module, "_get_fsdp_state", None)
    if state_of is None:
        return []
    return list(getattr(state_of(), "_fsdp_param_groups", None) or [])


def fsdp_meshes(module: torch.nn.Module) -> list[Any]:
    """The DeviceMesh of each of ``module``'s own FSDP parameter groups: what its parameters are
    sharded (and replicated) over. Needs each group's ``mesh_info.mesh``: not public."""
    return [param_group.mesh_info.mesh for param_group in _param_groups(module)]


def forget_unsharded_gradients(module: torch.nn.Module) -> None:
    """Drop the gradients a failed backward left on ``module``'s own unsharded parameters (and the
    gradient FSDP accumulates across steps without sync), so a re-run step does not add to them.

    Needs each FSDP parameter's ``_unsharded_param`` and ``unsharded_accumulated_grad``: the
    unsharded parameter exists only between all-gather and reshard, and FSDP exposes neither."""
    for param_group in _param_groups(module):
        for fsdp_param in param_group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            fsdp_param.unsharded_accumulated_grad = None
