"""This worker's place in the job now: its generation, the ranks it trains with, their process
group, and its connection to the job's store.

Runs in the worker. The runtime reads it at every step; the recovery client
(runtime/recovery_client.py) is the one that changes it: a new generation, new members, a new
group, or a store that moved after a controller failover.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from undying.client import parse_address
from undying.config import JobSpec
from undying.protocol import Plan
from undying.runtime.bounded_store import BoundedStore, connect_bounded
from undying.runtime.default_group import DefaultGroup
from undying.runtime.generation import Generation
from undying.runtime.gloo_interface import choose_gloo_interface
from undying.runtime.mesh import SwappableMesh
from undying.runtime.pg import GenerationGroup, connect_store
from undying.worker_env import WorkerEnv


class Membership:
    """``rank`` is this process's identity for the life of the job; ``group_rank`` its place in the
    current generation's group and data-parallel split (they differ after an elastic shrink)."""

    def __init__(self, env: WorkerEnv, backend: str, device: torch.device, generation: Generation) -> None:
        self.rank = env.rank
        self.world_size = env.world_size  # the job's ranks (batch slots), whatever the current members
        self.node = env.node
        self.local_rank = env.local_rank
        self.store_prefix = env.store_prefix
        self.backend = backend
        self.device = device
        self._spec: JobSpec = env.spec
        self._generation = generation  # which generation, and whether aborted or ending (runtime/generation.py)
        self.store_address = env.store_address
        choose_gloo_interface(backend, self.store_address)  # before any group is built: gloo reads it then
        self.store: dist.Store = (torch.distributed.HashStore() if self.store_address is None
                                  else connect_store(*self.store_address, self._spec.start_timeout))
        # The ranks of the current generation in process-group order: all of them, or the ones left
        # after an elastic shrink (a job restarted at that size starts with them).
        self.members: list[int] = list(env.members) or list(range(self.world_size))
        self.group: GenerationGroup | None = None
        self._group_store: dist.Store = self.store  # the current generation's connection to the store
        self.default_group: DefaultGroup | None = None  # torch.distributed's default group, same members
        self.mesh: SwappableMesh | None = None  # a sharded job's device mesh (ft.device_mesh), rebuilt with the group

    @property
    def generation(self) -> int:
        """The generation this worker is in."""
        return self._generation.current

    @generation.setter
    def generation(self, generation: int) -> None:
        self._generation.enter(generation)

    @property
    def group_rank(self) -> int:
        return self.members.index(self.rank)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas in the current generation (``world_size`` unless shrunk)."""
        return len(self.members)

    def aborted(self) -> bool:
        """Has the controller told this generation to stop now (a fault elsewhere)?"""
        return self._generation.aborted()

    def ending(self) -> bool:
        """Does the controller end this generation at the next step boundary (an elastic grow)?"""
        return self._generation.ending()

    def current_group(self) -> GenerationGroup:
        if self.group is None:
            raise RuntimeError("no process group: this rank has not joined a generation yet")
        return self.group

    def build_group(self) -> GenerationGroup:
        """Join the current generation's process group (every member builds it together)."""
        # Each generation talks to the store over its own connection: a TCPStore client serializes
        # its calls, and an abandoned generation's rendezvous may still block in one.
        store = self.store if self.store_address is None else connect_store(*self.store_address,
                                                                              self._spec.start_timeout)
        self._group_store = store
        deadline = None if self._spec.watchdog == "off" else self._spec.comm_timeout
        self.group = GenerationGroup(store, self.store_prefix, self.generation, self.group_rank, self.replicas,
                                     self.backend, deadline, self.device, should_abort=self.aborted,
                                     join_timeout=self._spec.start_timeout, ask_controller=self._generation.ask)
        self.default_group = DefaultGroup(self.group, self.aborted)
        if self.mesh is not None:
            self.mesh.enter(self.group, store, self.store_prefix, self.aborted, self._spec.start_timeout,
                            self.members)
        return self.group

    def attach_mesh(self, mesh: SwappableMesh) -> None:
        """From now on build ``mesh``'s groups with every generation's, starting with the current one."""
        self.mesh = mesh
        if self.group is not None:
            mesh.enter(self.group, self._group_store, self.store_prefix, self.aborted, self._spec.start_timeout,
                       self.members)

    def leave_group(self) -> None:
        if self.mesh is not None:
            self.mesh.leave()  # first: a sharded model's pending collectives stop waiting
        if self.default_group is not None:
            self.default_group.drop()
            self.default_group = None
        if self.group is not None:
            self.group.abandon()
            self.group = None

    def close(self) -> None:
        """End of training: destroy torch's default group the ordinary way, and shut the training
        group's communicators down (NCCL), every rank being done with both."""
        if self.mesh is not None:
            self.mesh.close()
        if self.default_group is not None:
            self.default_group.destroy()
            self.default_group = None
        if self.group is not None:
            self.group.shutdown()

    def enter(self, plan: Plan) -> None:
        """Become part of the plan's generation (its group is built next: ``build_group``)."""
        self.generation = plan.generation
        self.members = list(plan.members) if plan.members else list(range(plan.world_size or self.world_size))

    def move_store(self, address: str) -> bool:
        """Use the job's store at ``address`` from now on; False if it is the one in use (or standalone)."""
        if self.store_address is None:
            return False
        host, port = parse_address(address)
        if (host, port) == self.store_address:
            return False
        self.store_address = (host, port)
        self.store = connect_store(host, port, self._spec.start_timeout)
        return True

    def bounded_store(self, timeout: float, name: str) -> BoundedStore:
        """A store connection of its own whose every call returns within ``timeout`` (runtime/bounded_store.py)."""
        if self.store_address is None:
            store = self.store
            return BoundedStore(lambda: store, timeout)
        host, port = self.store_address
        return connect_bounded(host, port, timeout, name=name)
