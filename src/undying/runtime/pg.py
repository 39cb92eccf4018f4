"""One process-group generation: a backend group built on a fresh store prefix.

Runs in the worker. Instead of re-initialising torch's global default group, each
generation g builds its own group object on ``PrefixStore(f"{job}/gen{g}", store)``
(as TorchFT does), so a later recovery can drop it and build g+1 without touching
the model. Collectives are issued async and waited with ``comm_timeout``: nothing
interrupts a gloo collective that already blocks the calling thread, but a
bounded ``wait`` does return.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed or timed out; carries where it happened."""

    def __init__(self, op: str, rank: int, generation: int, cause: BaseException) -> None:
        super().__init__(f"{op} failed on rank {rank} in generation {generation}: {cause}")
        self.op = op
        self.rank = rank
        self.generation = generation


def connect_store(host: str, port: int, timeout: float) -> dist.Store:
    """A client connection to the controller's TCPStore."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def choose_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


class GenerationGroup:
    """The collectives of one generation; build a new object for the next one."""

    def __init__(self, store: dist.Store, prefix: str, generation: int, rank: int, world_size: int,
                 backend: str, comm_timeout: float, device: torch.device) -> None:
        self.store = dist.PrefixStore(f"{prefix}/gen{generation}", store)
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.comm_timeout = datetime.timedelta(seconds=comm_timeout)
        self.group = self._build(backend)

    def _build(self, backend: str) -> dist.ProcessGroup:
        if backend == "gloo":
            return dist.ProcessGroupGloo(self.store, self.rank, self.world_size, self.comm_timeout)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.comm_timeout
            return dist.ProcessGroupNCCL(self.store, self.rank, self.world_size, options)
        raise ValueError(f"backend {backend!r}: allowed gloo, nccl")

    def _wait(self, op: str, work: dist.Work) -> None:
        try:
            work.wait(self.comm_timeout)
        except Exception as error:
            raise CollectiveError(op, self.rank, self.generation, error) from error

    def allreduce_sum(self, tensor: torch.Tensor) -> None:
        """In-place sum over the generation's ranks."""
        if self.world_size == 1:
            return
        try:
            work = self.group.allreduce([tensor])
        except Exception as error:
            raise CollectiveError("allreduce", self.rank, self.generation, error) from error
        self._wait("allreduce", work)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        if self.world_size == 1:
            return
        options = dist.BroadcastOptions()
        options.rootRank = root
        try:
            work = self.group.broadcast([tensor], options)
        except Exception as error:
            raise CollectiveError("broadcast", self.rank, self.generation, error) from error
        self._wait("broadcast", work)

    def gather_objects(self, key: str, value: bytes) -> list[bytes] | None:
        """Every rank hands ``value`` to rank 0 through the store; rank 0 gets them all (in rank order)."""
        self.store.set(f"{key}/{self.rank}", value)
        if self.rank != 0:
            return None
        keys = [f"{key}/{rank}" for rank in range(self.world_size)]
        self.store.wait(keys, self.comm_timeout)
        return [self.store.get(k) for k in keys]

    def publish(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def read(self, key: str) -> bytes:
        self.store.wait([key], self.comm_timeout)
        return self.store.get(key)

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - a broken group may fail to shut down; it is dropped either way
                pass


def flat_views(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` laid out like ``tensors`` in order (shape of each tensor)."""
    views, offset = [], 0
    for tensor in tensors:
        views.append(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return views
