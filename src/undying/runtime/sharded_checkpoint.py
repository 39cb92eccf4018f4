"""A sharded job's T2: its shards as one DCP checkpoint (checkpoint/dcp_sharded.py), and back.

Runs in the worker. The persister thread turns a T1 snapshot's shards (plain local tensors) into
DTensors again with each parameter's placement on the job's mesh (``DcpLayout.state_dict``: no
collective, the mesh is fixed for the job), so DCP plans and writes them as any sharded state; a
restore from storage fills the live model and a fresh optimizer state from it (``load``), whatever
mesh wrote it.
"""

from __future__ import annotations

from typing import Any

import torch

from undying.checkpoint.dcp_format import UNDYING_KEY, model_key, optimizer_key, optimizer_param_names
from undying.checkpoint.dcp_sharded import load_sharded, reader, saved_keys
from undying.checkpoint.storage import CommittedCheckpoint, CorruptCheckpoint
from undying.runtime.sharded import is_dtensor, named_tensors, reshard

# (device mesh, placements, global shape, global stride) of one sharded tensor.
Spec = tuple[Any, tuple[Any, ...], torch.Size, tuple[int, ...]]


class DcpLayout:
    """How the job's models and optimizers map to DCP keys; taken once from the live (sharded)
    parameters, whose mesh and placements stay for the life of the job."""

    def __init__(self, modules: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        for module in modules:
            reshard(module)
        self.modules = modules
        self.optimizers = optimizers
        self.specs: list[dict[str, Spec]] = [
            {name: (tensor.device_mesh, tuple(tensor.placements), tensor.shape, tuple(tensor.stride()))
             for name, tensor in named_tensors(module) if is_dtensor(tensor)}
            for module in modules]
        self.param_names = [optimizer_param_names(optimizer, modules) for optimizer in optimizers]

    def _spec_of(self, fqn: str) -> Spec | None:
        for index in range(len(self.specs) - 1, -1, -1):
            prefix = "" if index == 0 else f"{model_key(index)}."
            if fqn.startswith(prefix) and fqn[len(prefix):] in self.specs[index]:
                return self.specs[index][fqn[len(prefix):]]
        return None

    def state_dict(self, shards: dict[str, Any], extras: dict[str, Any] | None) -> dict[str, Any]:
        """The DCP state dict of ``shards`` (TrainingState.shard_state's layout, e.g. from a snapshot);
        ``extras``: the ``undying`` entry, written by the coordinator only."""
        state: dict[str, Any] = {}
        for index, (tensors, specs) in enumerate(zip(shards["models"], self.specs, strict=True)):
            state[model_key(index)] = {name: _as_dtensor(tensor, specs.get(name)) for name, tensor in tensors.items()}
        for index, optimizer in enumerate(shards["optimizers"]):
            names = self.param_names[index]
            sharded = {(param_id, key) for param_id, key in optimizer["dtensors"]}
            state[optimizer_key(index)] = {
                "state": {names[param_id]: {key: _as_dtensor(value, self._spec_of(names[param_id]))
                                            if (param_id, key) in sharded else value
                                            for key, value in entry.items()}
                          for param_id, entry in optimizer["state"].items()},
                "param_groups": [{**{key: value for key, value in group.items() if key != "params"},
                                  "params": [names[param_id] for param_id in group["params"]]}
                                 for group in optimizer["param_groups"]],
            }
        if extras is not None:
            state[UNDYING_KEY] = extras
        return state

    def load(self, ckpt: CommittedCheckpoint) -> None:
        """Fill the live models and the optimizers' state from ``ckpt`` (verified by the caller)."""
        saved = saved_keys(ckpt)
        targets: dict[str, Any] = {}
        for index, module in enumerate(self.modules):
            targets[model_key(index)] = {name: tensor.detach()
                                         for name, tensor in named_tensors(module)}
        groups = _param_groups(ckpt, len(self.optimizers))
        for index, optimizer in enumerate(self.optimizers):
            targets[optimizer_key(index)] = {"state": self._state_targets(index, optimizer, saved)}
        load_sharded(ckpt, targets)
        for index, optimizer in enumerate(self.optimizers):
            names = [name for group in groups[index] for name in group["params"]]
            ids = {name: position for position, name in enumerate(names)}
            loaded = targets[optimizer_key(index)]["state"]
            optimizer.load_state_dict({
                "state": {ids[name]: entry for name, entry in loaded.items()},
                "param_groups": [{**group, "params": [ids[name] for name in group["params"]]}
                                 for group in groups[index]]})

    def _state_targets(self, index: int, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
        """Empty tensors shaped like what ``ckpt`` holds for each parameter's optimizer state: a
        DTensor placed like its parameter where the saved tensor has the parameter's global shape."""
        params = {name: param for name, param in zip(self.param_names[index],
                                                     (p for group in optimizer.param_groups for p in group["params"]),
                                                     strict=True)}
        prefix = f"{optimizer_key(index)}.state."
        targets: dict[str, dict[str, Any]] = {}
        for flat, meta in saved.items():
            if not flat.startswith(prefix) or not hasattr(meta, "size"):
                continue
            name, key = flat[len(prefix):].rsplit(".", 1)
            param = params.get(name)
            if param is None:
                raise CorruptCheckpoint(f"optimizer state of {name!r}, a parameter this job's optimizer lacks")
            if is_dtensor(param) and tuple(meta.size) == tuple(param.shape):
                target: torch.Tensor = torch.empty_like(param.detach(), dtype=meta.properties.dtype)
            else:  # a step counter and the like: where torch's optimizer keeps it
                target = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            targets.setdefault(name, {})[key] = target
        return targets


def _as_dtensor(tensor: torch.Tensor, spec: Spec | None) -> torch.Tensor:
    if spec is None:
        return tensor
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = spec
    return DTensor.from_local(tensor, mesh, placements, run_check=False, shape=shape, stride=stride)


def _param_groups(ckpt: CommittedCheckpoint, count: int) -> list[list[dict[str, Any]]]:
    """Each optimizer's saved param_groups (hyperparameters, parameter FQNs)."""
    from undying._torch_compat.dcp import EmptyStateDictLoadPlanner, load_without_process_group

    keys = {f"{optimizer_key(index)}.param_groups" for index in range(count)}
    state: dict[str, Any] = {}
    try:
        load_without_process_group(state, reader(ckpt), EmptyStateDictLoadPlanner(keys=keys))
    except Exception as error:  # noqa: BLE001 - verified bytes DCP cannot read: unusable
        raise CorruptCheckpoint(f"{ckpt.path}: optimizer param_groups unreadable ({error!r})") from error
    return [state[optimizer_key(index)]["param_groups"] for index in range(count)]
