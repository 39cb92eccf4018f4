"""Which backend and device a worker uses: one GPU per rank per host, checked at start.

Runs in the worker, at ``undying.init()``. NCCL refuses two ranks of one communicator on the same
GPU and fails late, inside the first collective, with an error that names neither rank; so the
check is made here, once, with one line that says what does not fit.
"""

from __future__ import annotations

import torch


class DeviceError(RuntimeError):
    """This rank cannot have a GPU of its own on its host."""


def choose_backend(requested: str, local_world_size: int = 1) -> str:
    """``auto`` is NCCL only when every local rank of this host gets its own GPU, else gloo."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available() and local_world_size <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def choose_device(backend: str, rank: int, local_rank: int, local_world_size: int) -> torch.device:
    """``cuda:LOCAL_RANK`` for NCCL, after checking that it exists and is this rank's alone; CPU for gloo.

    Raises DeviceError (one line naming the rank, its local rank and the device count) when the host
    has fewer GPUs than local ranks. Not detected: two simulated nodes on one host, each with local
    ranks from 0 (their agents do not know of each other); NCCL then refuses the duplicate GPU.
    """
    if backend != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= count or local_world_size > count:
        raise DeviceError(f"backend nccl needs one GPU per rank: rank {rank} (local rank {local_rank} of "
                          f"{local_world_size} on this host) sees {count} CUDA device(s)")
    return torch.device("cuda", local_rank)
