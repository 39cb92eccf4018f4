"""torch.distributed internals: a ProcessGroup around a backend undying built, torch's process-group
registry, a DeviceMesh over undying's groups, DDP's bucket sizing. Runs in the worker.

The public API builds process groups only through ``init_process_group`` / ``new_group``, over the
default group's store, with torch choosing the name and registering the group for good. undying
builds each generation's groups itself (its own store prefix, a join timeout, an abort flag) and
keeps one named group per mesh dim for the life of the job, so it does by hand the parts of
``new_group`` it needs. Known to work with torch 2.13.0.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.distributed_c10d import GroupName

# The ProcessGroup methods FSDP2, HSDP and DTensor call on a mesh's groups (torch 2.13: FSDP's
# all-gather and reduce-scatter, HSDP's all-reduce, DTensor's full_tensor, and what a state transfer
# or a broadcast over one dim uses). ``_allgather_base`` and ``_reduce_scatter_base`` are private
# names, but FSDP calls them, so a group standing in for FSDP's must answer them.
FSDP_GROUP_METHODS = ("all_gather_single", "_allgather_base", "allgather", "allgather_into_tensor_coalesced",
                      "all_gather_single_coalesced", "reduce_scatter_single", "_reduce_scatter_base",
                      "reduce_scatter", "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced",
                      "allreduce", "allreduce_coalesced", "broadcast", "barrier", "alltoall_base",
                      "all_to_all_single", "send", "recv")


def group_over_backend(backend: dist.ProcessGroup, store: dist.Store, rank: int, world_size: int,
                       device_type: str, backend_name: str, name: str) -> dist.ProcessGroup:
    """A full ``ProcessGroup`` named ``name`` whose collectives on ``device_type`` go to ``backend``
    (a ``ProcessGroupGloo`` / ``ProcessGroupNCCL``), as ``new_group`` makes one inside.

    Needs ``ProcessGroup._set_default_backend``, ``_register_backend`` and ``_set_group_name``: FSDP
    calls ProcessGroup methods a bare backend lacks, and the only public way to such a group is
    ``new_group``, which builds its own backend over the default group's store."""
    kind = dist.ProcessGroup.BackendType.NCCL if backend_name == "nccl" else dist.ProcessGroup.BackendType.GLOO
    group = dist.ProcessGroup(store, rank, world_size)
    group._set_default_backend(kind)
    group._register_backend(torch.device(device_type), kind, backend)  # type: ignore[arg-type]
    group._set_group_name(GroupName(name))
    return group


def register_named_group(group: dist.ProcessGroup, name: str, backend_name: str, ranks: dict[int, int],
                         tag: str) -> None:
    """Make ``group`` known to torch as ``new_group`` would: by ``name`` (the DeviceMesh and DTensor's
    functional collectives resolve groups by name) and in c10d's world map (``get_process_group_ranks``,
    c10d's logging of a failed collective). ``ranks``: rank in torch's default group -> rank in
    ``group``. Replaces a registration of the same name.

    Needs ``distributed_c10d._resolve_process_group``, ``_unregister_process_group``,
    ``_register_process_group`` and ``_world``: torch registers only the groups it builds itself, and
    empties the registry whenever its default group is destroyed (undying does at every recovery), so
    a group that outlives generations has to be put back by hand."""
    try:
        registered = distributed_c10d._resolve_process_group(GroupName(name))
    except (RuntimeError, ValueError):
        registered = None
    if registered is not None:  # still there: torch's default group was not rebuilt since
        distributed_c10d._unregister_process_group(GroupName(name))
    distributed_c10d._register_process_group(GroupName(name), group)
    world = distributed_c10d._world
    world.pg_map[group] = (backend_name, dist.HashStore())
    world.pg_group_ranks[group] = ranks
    world.pg_to_tag[group] = tag
    if group not in world.tags_to_pg.setdefault(tag, []):
        world.tags_to_pg[tag].append(group)


def default_group_names() -> dict[Any, str] | None:
    """c10d's registry of live groups (group -> name), which ``destroy_process_group()`` shuts down
    one by one; None where this torch has none of that shape.

    Needs ``distributed_c10d._world.pg_names``: undying empties it before destroying the default
    group, so that groups with a dead peer are dropped without blocking; no public call drops a
    default group without shutting its groups down."""
    names = getattr(getattr(distributed_c10d, "_world", None), "pg_names", None)
    return names if isinstance(names, dict) else None


def set_backend_timeout(options: Any, timeout: datetime.timedelta) -> None:
    """Set a backend's ``Options`` timeout (``ProcessGroupNCCL.Options``).

    Needs ``Options._timeout``: the timeout is public only as ``init_process_group``'s and
    ``new_group``'s argument, not on the options a backend is built from directly."""
    options._timeout = timeout


def bucket_assignment_by_size(tensors: list[torch.Tensor], limits: list[int],
                              order: list[int] | None = None) -> list[list[int]]:
    """DDP's gradient buckets for ``tensors``: indices per bucket, each cut when it reaches the next
    of ``limits`` bytes (the last one repeating), in ``order`` (tensor indices) if given.

    Needs ``dist._compute_bucket_assignment_by_size``, the function DDP itself sizes its buckets
    with: undying reproduces DDP's layouts exactly (they decide gloo's rounding), and no public API
    returns them."""
    expect_sparse = [False] * len(tensors)
    if order is None:
        indices, _ = dist._compute_bucket_assignment_by_size(tensors, limits, expect_sparse)
    else:
        indices, _ = dist._compute_bucket_assignment_by_size(tensors, limits, expect_sparse, order)
    return [list(bucket) for bucket in indices]


def device_mesh_over_groups(device_type: str, layout: torch.Tensor, dim_names: tuple[str, ...], rank: int,
                            groups: list[dist.ProcessGroup]) -> Any:
    """A torch ``DeviceMesh`` of ``layout`` whose dims are ``groups`` (by their ``group_name``), for the
    given ``rank``: what ``DeviceMesh.from_group`` does, without asking torch's default group.

    Needs ``DeviceMesh(_init_backend=False, _rank=...)``, ``_dim_group_names`` and ``_pg_registry``:
    ``from_group`` asks torch's default group for this rank, which a replacement rank has not joined
    yet when its script builds the model."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device_type, layout, mesh_dim_names=dim_names, _init_backend=False, _rank=rank)
    mesh._dim_group_names = [group.group_name for group in groups]
    for group in groups:
        mesh._pg_registry[group.group_name] = group
    return mesh
