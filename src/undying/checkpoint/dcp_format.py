"""T2 format of the shared shard: a torch.distributed.checkpoint (DCP) directory that needs no undying to read.

Runs in the worker: rank 0's persister thread (or the dying-checkpoint writer) writes it into
a checkpoint's staging directory, and rank 0 reads it back at a restore. The state dict
handed to ``torch.distributed.checkpoint.save`` (which flattens nested keys with dots)::

    model          the first model's state_dict, keyed by the model's own FQNs
    model_<i>      further models, if the job wrapped several
    optimizer      {"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}: the
                   layout of torch.distributed.checkpoint.state_dict.get_optimizer_state_dict
    optimizer_<i>  further optimizers
    undying        {"format", "committed_step", "loaders", "statefuls", "models", "optimizers"}

``dcp.load({"model": model.state_dict()}, checkpoint_id=path)`` loads the weights into a
plain model (docs/checkpoints.md); under a URL root (``checkpoint.dir`` an fsspec URL) the
shard is written and read with DCP's fsspec storage, and ``checkpoint_id=url`` loads it the
same way. Our MANIFEST.json sits beside DCP's ``.metadata`` and ``*.distcp`` files and lists
each with its size and CRC-32.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from undying.checkpoint.dcp_writer import check_complete, checksummed_writer, records_of, write_threads
from undying.checkpoint.state_tree import flatten_state, unflatten_state
from undying.checkpoint.storage import (
    CheckpointRoot,
    CommittedCheckpoint,
    CorruptCheckpoint,
    FileRecord,
    Location,
    verify_files,
)

DCP_METADATA = ".metadata"
DCP_DATA_SUFFIX = ".distcp"
UNDYING_KEY = "undying"
SHARD_FORMAT = 1

# Saving without a default process group is exactly what we mean (one replica writes the shard).
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def model_key(index: int) -> str:
    return "model" if index == 0 else f"model_{index}"


def optimizer_key(index: int) -> str:
    return "optimizer" if index == 0 else f"optimizer_{index}"


def optimizer_param_names(optimizer: Any, modules: list[torch.nn.Module]) -> list[str]:
    """The FQN of each parameter of ``optimizer``, in the order its ``state_dict`` numbers them.

    A parameter of the first module is named as in that module's state_dict; one of module
    ``i > 0`` gets the prefix ``model_<i>.``; one in no module gets ``unnamed.<n>``.
    """
    names: dict[int, str] = {}
    for index, module in enumerate(modules):
        prefix = "" if index == 0 else f"{model_key(index)}."
        for name, parameter in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), prefix + name)
    ordered: list[str] = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            ordered.append(names.get(id(parameter), f"unnamed.{len(ordered)}"))
    return ordered


def materialize(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors own their memory (not views into a snapshot slot): what
    ``torch.save`` of a view would otherwise write is the whole slot."""
    skeleton, tensors = flatten_state(obj)
    return unflatten_state(skeleton, [tensor.clone() for tensor in tensors])


def to_dcp(replica_state: dict[str, Any], param_names: list[list[str]]) -> dict[str, Any]:
    """The runtime's replica state (models, optimizers with integer parameter ids, loaders,
    statefuls) as the FQN-keyed state dict described in the module docstring."""
    state: dict[str, Any] = {}
    for index, model_state in enumerate(replica_state["models"]):
        state[model_key(index)] = model_state
    for index, optimizer_state in enumerate(replica_state["optimizers"]):
        names = param_names[index]
        state[optimizer_key(index)] = {
            "state": {names[param_id]: per_param for param_id, per_param in optimizer_state["state"].items()},
            "param_groups": [
                {**materialize({k: v for k, v in group.items() if k != "params"}),
                 "params": [names[param_id] for param_id in group["params"]]}
                for group in optimizer_state["param_groups"]
            ],
        }
    state[UNDYING_KEY] = materialize({
        "format": SHARD_FORMAT,
        "committed_step": replica_state["committed_step"],
        "loaders": replica_state["loaders"],
        "statefuls": replica_state.get("statefuls", {}),
        "models": len(replica_state["models"]),
        "optimizers": len(replica_state["optimizers"]),
    })
    return state


def from_dcp(state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``to_dcp``: optimizer state numbered again in param_groups order, as
    ``torch.optim.Optimizer.load_state_dict`` expects."""
    extras = state[UNDYING_KEY]
    if extras.get("format") != SHARD_FORMAT:
        raise ValueError(f"unsupported shared-shard format {extras.get('format')!r}")
    optimizers = []
    for index in range(extras["optimizers"]):
        saved = state[optimizer_key(index)]
        ids: dict[str, int] = {}
        for group in saved["param_groups"]:
            for name in group["params"]:
                ids[name] = len(ids)
        optimizers.append({
            # An optimizer that has not stepped yet has no state, and DCP stores no empty dict.
            "state": {ids[name]: per_param for name, per_param in saved.get("state", {}).items()},
            "param_groups": [{**group, "params": [ids[name] for name in group["params"]]}
                             for group in saved["param_groups"]],
        })
    return {
        "committed_step": extras["committed_step"],
        "models": [state.get(model_key(index), {}) for index in range(extras["models"])],
        "optimizers": optimizers,
        "loaders": extras["loaders"],
        "statefuls": extras.get("statefuls", {}),
    }


def write_shared_shard(staging: Location, replica_state: dict[str, Any], param_names: list[list[str]],
                       root: CheckpointRoot | None = None) -> list[FileRecord]:
    """Save the shared shard with DCP into ``staging`` (a local directory or a URL); return the
    records of every file DCP wrote, checksummed as they were written (checkpoint/dcp_writer.py).

    Tensors may be views into a T1 slot: DCP hands each to ``torch.save`` as it is (a copy of its
    own size first where its storage is larger), so the extra memory is at most the largest tensor
    per writer thread. A large state is written by two threads into two data files.
    """
    # Imported here, not at module load: torch.distributed.checkpoint costs every worker ~1.6 s of
    # import (3+ s with four workers on two cores), on the critical path of a cold replacement.
    import torch.distributed.checkpoint as dcp

    state = to_dcp(replica_state, param_names)
    root = root or CheckpointRoot.at(staging)  # a caller without a root: the staging directory's backend
    writer, files = checksummed_writer(staging, root.backend, write_threads(flatten_state(state)[1]))
    try:
        metadata = dcp.save(state, storage_writer=writer, no_dist=True)
    except dcp.CheckpointException as error:  # a BaseException: ``except Exception`` lets it through
        raise plain_error(error) from None
    check_complete(staging, metadata)
    names = sorted({info.relative_path for info in metadata.storage_data.values()}) + [DCP_METADATA]
    return records_of(root, staging, files, names)


def plain_error(error: Any) -> Exception:
    """The first rank's own exception inside DCP's ``CheckpointException`` (a ``BaseException``, which
    ``except Exception`` does not catch): an ``OSError`` stays one (a full disk keeps its errno)."""
    for inner, _trace in error.failures.values():
        if isinstance(inner, Exception):
            return inner
    return RuntimeError(str(error).splitlines()[0])


def is_dcp_shard(ckpt: CommittedCheckpoint) -> bool:
    return any(record.name == DCP_METADATA for record in ckpt.manifest.files)


def read_shared_shard(ckpt: CommittedCheckpoint, verified: bool = False, keys: set[str] | None = None) -> dict[str, Any]:
    """The replica state in ``ckpt``'s DCP files, after checking their sizes and CRC-32 against
    the manifest (skipped with ``verified=True``, when the caller just verified the checkpoint).
    ``keys``: read only these top-level entries (a sharded job's: ``{"undying"}``; each rank reads
    its own shards itself).

    Raises ``CorruptCheckpoint`` if the bytes do not match or DCP cannot read them.
    """
    from undying._torch_compat.dcp import load_without_process_group
    from undying.checkpoint.dcp_reader import AdoptingPlanner

    names = [record.name for record in ckpt.manifest.files
             if record.name == DCP_METADATA or record.name.endswith(DCP_DATA_SUFFIX)]
    if not verified:
        verify_files(ckpt, names)
    state: dict[str, Any] = {}
    try:
        load_without_process_group(state, ckpt.backend.dcp_reader(ckpt.path), AdoptingPlanner(keys=keys))
        return from_dcp(state)
    except Exception as error:  # noqa: BLE001 - any failure to parse verified bytes means unusable
        raise CorruptCheckpoint(f"{ckpt.path}: DCP shard unreadable ({error!r})") from error
