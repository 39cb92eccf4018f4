"""A sharded model (FSDP2 ``fully_shard`` on undying's mesh) inside the step transaction.

Runs in the worker. ``ft.wrap_model`` returns a ``ShardedModel`` for a model that ``fully_shard``
was applied to over ``ft.device_mesh`` (runtime/mesh.py). FSDP averages the gradients itself during
backward (reduce-scatter over the shard dim, all-reduce over the replicate dim), so the step
transaction only votes and applies. What a rank holds of the model and its optimizer is its own
shard: it is part of the rank's state (``local_state``), not of the replica's, and a replacement
rank receives it from a rank that holds the same shard in another replica (``shard_donors``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from undying._torch_compat.fsdp import forget_unsharded_gradients, fsdp_meshes
from undying._torch_compat.training import compiled_original
from undying.runtime.mesh import SwappableGroup, SwappableMesh
from undying.sharded_support import NEEDS_PEER_COPIES, NEEDS_T1, mesh_refusal, usable_strategies
from undying.strategy_names import StrategyName

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

def make_mesh(rank: int, world_size: int, replicate: int, shard: int | None, strategies: list[str],
              backend: str, device: torch.device, t1_snapshots: bool = False,
              peer_copies: bool = False) -> SwappableMesh:
    """The job's (replicate, shard) mesh after checking that it fits the job; one-line errors.
    ``t1_snapshots``: the job keeps T1 snapshots between checkpoints (``snapshot_interval`` not 0);
    ``peer_copies``: ... and copies of them on the next node (runtime/peer_copy.py)."""
    if not isinstance(replicate, int) or replicate < 1:
        raise ValueError(f"ft.device_mesh: replicate must be an integer >= 1 (got {replicate!r})")
    shard = world_size // replicate if shard is None else shard
    if not isinstance(shard, int) or shard < 1 or replicate * shard != world_size:
        raise ValueError(f"ft.device_mesh: replicate x shard must equal the job's world size {world_size} "
                         f"(got {replicate} x {shard})")
    # Pure FSDP (replicate 1): no other replica holds a lost rank's shard. Its node's T1 snapshot does:
    # a replacement on the same node restores it from there (runtime/t1_repair.py), if T1 is on; with
    # peer copies, the next node's copy does when the node is lost (runtime/peer_copy.py).
    reasons = {str(name): mesh_refusal(StrategyName(name), replicate, t1_snapshots, peer_copies)
               for name in strategies}  # validated names (config/model.py)
    refused = [name for name, reason in reasons.items() if reason]
    if refused:
        usable = usable_strategies(replicate, t1_snapshots, peer_copies)
        allowed = ", ".join(str(name) for name in (*usable, StrategyName.JOB_RESTART, StrategyName.EXIT))
        hints = [hint for hint in (NEEDS_T1, NEEDS_PEER_COPIES) if hint in reasons.values()]
        why = f" ({hints[0]})" if hints else ""
        raise ValueError(f"ft.device_mesh: recover_strategy {', '.join(refused)} is not supported for a sharded "
                         f"model with replicate={replicate}{why}; allowed with this mesh: {allowed}")
    return SwappableMesh(rank, replicate, shard, backend, device)


def wrap_sharded(model: torch.nn.Module, mesh: SwappableMesh | None, joining: bool) -> ShardedModel:
    """``model`` (``fully_shard``-ed over ``mesh``) in the step transaction; one-line errors for a model
    sharded without undying's mesh or a mesh without a sharded model."""
    if mesh is None:
        raise ValueError("ft.wrap_model: this model is sharded (fully_shard) over a mesh undying does not manage; "
                         "build it with ft.device_mesh(replicate=R, shard=S) and pass that to fully_shard")
    if not is_sharded(model):
        raise ValueError("ft.wrap_model: with ft.device_mesh, apply fully_shard(module, mesh=mesh) to the model "
                         "(and to its blocks) before wrapping it")
    foreign = [name for name, group in _mesh_groups(model) if not isinstance(group, SwappableGroup)]
    if foreign:
        raise ValueError(f"ft.wrap_model: {foreign[0] or 'the model'} is sharded over a mesh ft.device_mesh did not "
                         f"build (its process groups would not survive a recovery); pass ft.device_mesh's mesh "
                         f"to every fully_shard call")
    # A replacement rank gets its shard in the repair, not by a broadcast the live ranks would not take part in.
    return ShardedModel(model, mesh, broadcast=not joining)


class ShardedModel(torch.nn.Module):
    """``module`` (an FSDP2 module on ``mesh``) as the step transaction sees it. Calling it calls the
    module; FSDP's own API (``set_requires_gradient_sync``, ...) is on ``module``.

    At wrap time every replica takes replica 0's parameters and buffers (over the replicate dim), as
    DDP broadcasts rank 0's: FSDP shards whatever each rank initialised."""

    def __init__(self, module: torch.nn.Module, mesh: SwappableMesh, broadcast: bool) -> None:
        super().__init__()
        self.module = module
        self.mesh = mesh
        if broadcast and mesh.replicate > 1:
            self._sync_replicas()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _sync_replicas(self) -> None:
        group = self.mesh.groups[0]
        with torch.no_grad():
            for tensor in local_tensors(self.module).values():
                torch.distributed.broadcast(tensor, group=group, group_src=0)

    def begin_step(self) -> None:
        """Nothing to prepare: FSDP schedules its own collectives."""

    def sync_gradients(self) -> None:
        """Nothing to do at the commit: FSDP reduced the gradients during backward."""

    def set_replica_share(self, gradient_weight: int, slots_per_step: int | None) -> None:
        """Elastic training (the job shrunk by whole replicas): each rank's gradient stands for
        ``gradient_weight`` of the step's ``slots_per_step`` batch slots, and the step's gradient is
        the sum over every rank divided by ``slots_per_step / gradient_weight``, not FSDP's mean over
        the ranks that trained. ``(1, None)``: FSDP's own mean, as a job at full size.

        FSDP2 divides every rank's reduced gradient by one factor, so ``gradient_weight`` must be the
        same on every rank (``grow`` with the slots spread evenly; the controller shrinks to no other
        size). Sums only (``force_sum_reduction_for_comms``): gloo has no pre-multiplied sum."""
        from torch.distributed.fsdp import FSDPModule

        factor = None if slots_per_step is None else slots_per_step / gradient_weight
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                # None puts FSDP's own divisor (the groups' sizes) back.
                module.set_gradient_divide_factor(factor)  # type: ignore[arg-type]
                module.set_force_sum_reduction_for_comms(factor is not None)

    def forget_failed_step(self) -> None:
        """After a failed step: FSDP's per-iteration state is reset (its pending all-gathers belong to
        the left generation and return at once) and the gradients the failed backward left on the
        unsharded parameters are dropped; autograd would add the re-run step's to them."""
        reset = getattr(self.module, "reset_iter_state", None)
        try:
            if reset is not None:
                reset()
        except AttributeError:
            pass  # a model that never ran forward (a replacement's) has no per-iteration state yet
        reshard(self.module)
        for module in self.module.modules():
            forget_unsharded_gradients(module)


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """Is ``value`` a DTensor? Without importing ``torch.distributed.tensor`` (over half a second of
    every worker's start, measured) where nothing has: then nothing can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def fsdp_loaded() -> bool:
    """Has anything imported FSDP2? A data-parallel job never does, and never pays its import."""
    return "torch.distributed.fsdp" in sys.modules


def is_sharded(module: torch.nn.Module) -> bool:
    """Was ``fully_shard`` applied to ``module`` (or a compiled module's original)?"""
    if not fsdp_loaded():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(compiled_original(module) or module, FSDPModule)


def reshard(module: torch.nn.Module) -> None:
    """Put every FSDP module's sharded parameters back on it: between its all-gather and its reshard
    (a step that failed there) a module holds its unsharded parameters instead."""
    if not fsdp_loaded():
        return
    from torch.distributed.fsdp import FSDPModule

    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()


def _mesh_groups(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """(module name, process group) for every mesh dim of every FSDP parameter group in ``model``."""
    groups = []
    for name, module in model.named_modules():
        for mesh in fsdp_meshes(module):
            groups += [(name, mesh.get_group(dim)) for dim in range(mesh.ndim)]
    return groups


def named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by every name it has: a tied weight under each of its names, as
    ``state_dict`` lists it (a checkpoint must load into ``model.state_dict()``)."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def local_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of each parameter and buffer, by name: a DTensor's local shard (the storage
    FSDP trains), a plain tensor as it is."""
    reshard(module)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors(module):
        tensors[name] = (tensor.to_local() if is_dtensor(tensor) else tensor).detach()
    return tensors


def load_local_tensors(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    live = local_tensors(module)
    missing = sorted(set(live) - set(state))
    if missing:
        raise RuntimeError(f"sharded state: no value for {', '.join(missing[:3])} (a different model?)")
    with torch.no_grad():
        for name, tensor in live.items():
            tensor.copy_(state[name])


def local_optimizer_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state_dict with each DTensor replaced by its local shard, and which entries
    were DTensors (``dtensors``: [param id, key]) so that ``load_local_optimizer_state`` can make them
    again. Keys and param ids are torch's own."""
    state: dict[Any, dict[str, Any]] = {}
    dtensors: list[list[Any]] = []
    for param_id, entry in state_dict["state"].items():
        state[param_id] = {}
        for key, value in entry.items():
            if is_dtensor(value):
                state[param_id][key] = value.to_local()
                dtensors.append([param_id, key])
            else:
                state[param_id][key] = value
    return {"state": state, "param_groups": state_dict["param_groups"], "dtensors": dtensors}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, local: dict[str, Any]) -> None:
    """Load what ``local_optimizer_state`` made into ``optimizer`` (its state may not exist yet: a
    replacement rank's optimizer has not stepped): each former DTensor becomes one again, placed
    like the parameter it belongs to."""
    from torch.distributed.tensor import DTensor
    params = {saved: param for saved_group, group in zip(local["param_groups"], optimizer.param_groups, strict=True)
              for saved, param in zip(saved_group["params"], group["params"], strict=True)}
    state = {param_id: dict(entry) for param_id, entry in local["state"].items()}
    for param_id, key in local["dtensors"]:
        param = params[param_id]
        if not isinstance(param, DTensor):
            raise RuntimeError(f"sharded state: optimizer entry {key!r} was sharded but its parameter is not")
        state[param_id][key] = DTensor.from_local(state[param_id][key].to(param.to_local().device),
                                                  param.device_mesh, param.placements, run_check=False,
                                                  shape=param.shape, stride=param.stride())
    optimizer.load_state_dict({"state": state, "param_groups": local["param_groups"]})


def shard_donors(mesh: SwappableMesh, receivers: list[int], members: list[int]) -> dict[int, int]:
    """For each receiving rank, the rank that sends it its shard: the first rank in replica order that
    holds the same shard and keeps its state. Raises if a shard has no such holder left."""
    donors: dict[int, int] = {}
    for receiver in receivers:
        holders = [rank for rank in mesh.replica_peers(receiver) if rank not in receivers and rank in members]
        if not holders:
            raise ShardLost(f"no surviving replica holds shard {receiver % mesh.shard} of rank {receiver}")
        donors[receiver] = holders[0]
    return donors


class ShardLost(RuntimeError):
    """Every rank holding a shard lost its state: only a checkpoint can bring it back."""
