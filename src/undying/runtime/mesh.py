"""The device mesh of a sharded job (FSDP2, HSDP): process groups whose identity outlives generations.

Runs in the worker. ``ft.device_mesh(replicate=R, shard=S)`` returns a torch ``DeviceMesh`` of shape
(R, S), dims ``("replicate", "shard")``: row r is replica r, column c holds shard c, and rank g sits
at (g // S, g % S). FSDP2 and DTensor read a mesh's groups once and keep the objects, while undying
replaces every process group at each recovery; so each dim's group is a ``SwappableGroup``, a torch
``ProcessGroup`` whose name stays fixed and whose collectives go to the current generation's backend
group; after an elastic shrink (whole replicas left) the replicate dim's groups hold fewer ranks.
``Membership.build_group`` builds those (``SwappableMesh.enter``) with the training group, and
``leave_group`` retires them. Every collective of theirs is waited like any other
of undying's: bounded by ``comm_timeout``, given up when the controller aborts the generation
(runtime/pg.py). docs/sharding.md has the design and what it was measured against.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName

from undying._torch_compat.dist import (
    FSDP_GROUP_METHODS,
    device_mesh_over_groups,
    group_over_backend,
    register_named_group,
)
from undying.mesh_rows import incomplete_rows, rows_of
from undying.runtime.pg import CollectiveError, GenerationGroup

DIM_NAMES = ("replicate", "shard")
# The ProcessGroup methods FSDP2, HSDP and DTensor call on a mesh's groups: each is forwarded to the
# current generation's group.
FORWARDED = FSDP_GROUP_METHODS


class MeshDimGroup(GenerationGroup):
    """One mesh dim's group of one generation: a ``GenerationGroup`` (built on its own thread under
    the join timeout and the abort flag; waits bounded) whose group is a full torch ``ProcessGroup``
    with the backend registered, as FSDP calls ProcessGroup methods the bare backend lacks."""

    def __init__(self, name: str, store: dist.Store, prefix: str, generation: int, rank: int, world_size: int,
                 backend: str, comm_timeout: float | None, device: torch.device,
                 should_abort: Callable[[], bool], join_timeout: float) -> None:
        self.name = name
        super().__init__(store, prefix, generation, rank, world_size, backend, comm_timeout, device,
                         should_abort=should_abort, join_timeout=join_timeout)

    def _build(self, backend: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
        inner = super()._build(backend, timeout)
        return group_over_backend(inner, self.store, self.rank, self.world_size, self.device.type, backend,
                                  f"{self.name}/gen{self.generation}")


class BoundedWork(dist.Work):
    """A work of one generation's dim group, as FSDP sees it: ``wait`` is bounded like every other
    wait of undying's, and once the generation is left it returns at once (FSDP's
    ``reset_iter_state`` waits on the failed step's pending all-gather, whose result nobody uses)."""

    def __init__(self, inner: dist.Work, owner: SwappableGroup, dim: MeshDimGroup, op: str) -> None:
        super().__init__()
        self.inner, self.owner, self.dim, self.op = inner, owner, dim, op

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.owner.dim is not self.dim:
            return False
        self.dim.wait_work(self.op, self.inner)
        return True

    def is_completed(self) -> bool:
        return bool(self.inner.is_completed())

    def get_future(self) -> torch.futures.Future:
        return self.inner.get_future()


class SwappableGroup(dist.ProcessGroup):
    """A mesh dim's group for the life of the job: FSDP2 and the DeviceMesh hold this object, and
    ``SwappableMesh.enter`` points it at the next generation's ``MeshDimGroup``. ``members``: the job
    ranks of the group in the current generation, in group-rank order. ``rank()`` and ``size()`` are
    the current generation's: after an elastic shrink the replicate dim's group holds only the
    surviving replicas (FSDP2 reads ``size()`` at every gradient reduction)."""

    def __init__(self, name: str, rank: int, members: list[int]) -> None:
        super().__init__(rank, len(members))  # type: ignore[call-arg]  # the stub lacks this overload
        self._name = GroupName(name)
        self.members = members
        self._rank = rank
        self.dim: MeshDimGroup | None = None
        # Called once a gradient reduce-scatter is in flight (fault injection's ``at=allreduce``).
        self.reduction_started: Callable[[], None] = lambda: None

    @property
    def group_name(self) -> GroupName:
        # torch's own property asks the backend, of which this object has none.
        return self._name

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.members)

    def resize(self, members: list[int], job_rank: int) -> None:
        """This generation's members of the group (``job_rank`` among them)."""
        self.members = members
        self._rank = members.index(job_rank)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "undying"

    def _forward(self, op: str, *args: Any) -> dist.Work:
        dim = self.dim
        if dim is None:
            raise CollectiveError(op, self.rank(), -1, RuntimeError(f"{self._name}: this rank is between "
                                                                    f"generations (left after a fault)"))
        try:
            work = getattr(dim.group, op)(*args)
        except Exception as error:
            raise CollectiveError(op, self.rank(), dim.generation, error) from None
        if "reduce_scatter" in op:  # FSDP2 reduces gradients, and only gradients, by reduce-scatter
            self.reduction_started()
        return BoundedWork(work, self, dim, op)


def forward_collectives(cls: type) -> None:
    """Give ``cls`` (a ProcessGroup subclass with ``_forward(op, *args)``) every FORWARDED method."""
    def forwarder(op: str) -> Callable[..., dist.Work]:
        def forward(self: Any, *args: Any) -> dist.Work:
            return self._forward(op, *args)
        forward.__name__ = op
        return forward

    for op in FORWARDED:
        setattr(cls, op, forwarder(op))


forward_collectives(SwappableGroup)


class SwappableMesh:
    """This rank's (replicate, shard) mesh: its two swappable groups and the torch DeviceMesh over
    them. The DeviceMesh keeps the job's shape and each rank its shard column for the life of the
    job; after an elastic shrink (whole replicas left, ``surviving_replicas``) the replicate dim's
    groups hold the surviving replicas only, renumbered in replica order."""

    def __init__(self, rank: int, replicate: int, shard: int, backend: str, device: torch.device) -> None:
        self.rank, self.replicate, self.shard = rank, replicate, shard
        self.backend, self.device = backend, device
        row, column = divmod(rank, shard)
        self.groups = (
            SwappableGroup(f"undying-replicate{column}", row, [column + shard * r for r in range(replicate)]),
            SwappableGroup(f"undying-shard{row}", column, [row * shard + c for c in range(shard)]),
        )
        self.generation = 0
        self.members = list(range(replicate * shard))  # the job ranks of the current generation
        self.device_mesh = self._device_mesh()
        self.register()

    def _device_mesh(self) -> Any:
        layout = torch.arange(self.replicate * self.shard, dtype=torch.int).view(self.replicate, self.shard)
        # What DeviceMesh.from_group does, but with this rank given: from_group asks torch's default
        # group for it, which a replacement rank has not joined yet when its script builds the model.
        return device_mesh_over_groups(self.device.type, layout, DIM_NAMES, self.rank, list(self.groups))

    def on_gradient_reduction(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever a gradient reduce-scatter of FSDP's has been started (the
        runtime's ``at=allreduce`` injection point)."""
        for group in self.groups:
            group.reduction_started = callback

    def replica_peers(self, rank: int) -> list[int]:
        """The ranks that hold ``rank``'s shard (itself included), replica by replica."""
        column = rank % self.shard
        return [column + self.shard * row for row in range(self.replicate)]

    @property
    def replicas(self) -> int:
        """Replicas training in the current generation (``replicate`` unless shrunk)."""
        return self.groups[0].size()

    def enter(self, training: GenerationGroup, store: dist.Store, prefix: str, should_abort: Callable[[], bool],
              join_timeout: float, members: list[int] | None = None) -> None:
        """Build the training group's generation for both dims (every rank builds replicate first, then
        shard: one order everywhere, so no two groups wait on each other) and point the mesh at them.
        ``members``: the generation's job ranks in training-group order (all of them if not given);
        they must be whole replicas."""
        self.leave()
        self.take_members(members or list(range(self.replicate * self.shard)))
        for group in self.groups:
            dim = MeshDimGroup(group.group_name, store, f"{prefix}/mesh/{group.group_name}", training.generation,
                               group.rank(), group.size(), self.backend, training.comm_timeout_s, self.device,
                               should_abort, join_timeout)
            group.dim = dim
            training.abort_also(dim.abort_backend)
        self.generation = training.generation
        self.register()

    def take_members(self, members: list[int]) -> None:
        """The generation's job ranks (whole replicas, in training-group order): the replicate dim's
        groups hold the replicas among them, renumbered in replica order; a shard dim's group is its
        replica, the same in every generation the replica trains in."""
        rows = surviving_replicas(members, self.replicate, self.shard)
        self.members = list(members)
        column = self.rank % self.shard
        self.groups[0].resize([column + self.shard * row for row in rows], self.rank)

    def leave(self) -> None:
        """Retire this generation's dim groups (their pending works stop waiting) and drop them
        without blocking (runtime/pg.py ``abandon``)."""
        for group in self.groups:
            dim, group.dim = group.dim, None
            if dim is not None:
                dim.abandon()

    def close(self) -> None:
        """End of training: shut the dim groups' communicators down (NCCL)."""
        for group in self.groups:
            if group.dim is not None:
                group.dim.shutdown()

    def register(self) -> None:
        """Make the groups known to torch as ``new_group`` would: by name (the DeviceMesh, DTensor's
        functional collectives) and in its world map (``get_process_group_ranks``, c10d's logging of a
        failed collective). torch empties both when its default group is destroyed, which undying
        does at every recovery (runtime/default_group.py): called again after each rebuild."""
        for group in self.groups:
            # Keyed by the rank in torch's default group, which is the rank's place among the members.
            ranks = {self.members.index(rank): index for index, rank in enumerate(group.members)}
            register_named_group(group, group.group_name, self.backend, ranks, f"undying:{group.group_name}")


def surviving_replicas(members: list[int], replicate: int, shard: int) -> list[int]:
    """The replicas (mesh rows) ``members`` consists of, in order; raises unless every one of them is
    whole (all ``shard`` columns present): a shard's rank has no stand-in within its replica."""
    rows, broken = rows_of(members, shard), incomplete_rows(members, shard)
    if broken or not rows or rows[-1] >= replicate:
        raise ValueError(f"mesh: the generation's ranks {sorted(members)} are not whole replicas of the "
                         f"{replicate} x {shard} mesh (incomplete replica(s) {broken or rows})")
    return rows
