"""Which backend and device a worker uses, and the numerics it computes with.

Runs in the worker, at ``undying.init()``. NCCL refuses two ranks of one communicator on the same
GPU and fails late, inside the first collective, with an error that names neither rank; so the
check is made here, once, with one line that says what does not fit. ``deterministic: true`` sets
torch's flags here too; ``numerics_record`` is what every checkpoint records about them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from undying.worker_env import DETERMINISTIC_ENV, deterministic_environ


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


def set_numerics_mode(deterministic: bool) -> None:
    """``deterministic: true``: fixed reduction orders for this process, before any kernel runs.

    torch's deterministic algorithms with ``warn_only=False``: an op with no deterministic kernel
    raises (``RuntimeError`` naming it) rather than silently breaking bitwise replay; cuDNN without
    autotuning (``benchmark``, which may time a different algorithm in each process) and with its
    deterministic algorithms. The variables of ``DETERMINISTIC_ENV`` come from the agent; a standalone
    run (no agent) gets those it lacks here, where NCCL and cuBLAS have not read them yet provided no
    CUDA work ran before ``undying.init()``. Off: nothing is changed, the user's own settings stay."""
    if not deterministic:
        return
    os.environ.update(deterministic_environ(True, os.environ))
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def numerics_record(deterministic: bool, backend: str, device: torch.device) -> dict[str, Any]:
    """What decides this process's reduction orders, as JSON: the mode, the torch/CUDA/cuDNN/NCCL
    versions, the device model (the GPU's name, or ``cpu`` with its vector ISA and thread count, which
    decide how CPU kernels split a sum) and the variables of deterministic mode as this process sees
    them (``None``: unset). Versions that take no part are ``None`` (CUDA and cuDNN on CPU, NCCL
    under gloo), so a CPU run's record does not depend on which torch build it ran in."""
    on_cpu = device.type == "cpu"
    return {
        "deterministic": deterministic,
        "torch": torch.__version__,
        "backend": backend,
        "device": "cpu" if on_cpu else _device_model(device),
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "nccl": _nccl_version() if backend == "nccl" else None,
        "cpu": {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
        if on_cpu else None,
        "env": {name: os.environ.get(name) for name in DETERMINISTIC_ENV},
    }


def numerics_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The keys on which two numerics records differ, sorted; nested keys dotted (``env.NCCL_ALGO``).
    A key one record lacks (written by another undying version) differs."""
    differing: list[str] = []
    for key in sorted(set(recorded) | set(current)):
        ours, theirs = recorded.get(key), current.get(key)
        if isinstance(ours, Mapping) and isinstance(theirs, Mapping):
            differing += [f"{key}.{inner}" for inner in numerics_differences(ours, theirs)]
        elif key not in recorded or key not in current or ours != theirs:
            differing.append(key)
    return differing


def _device_model(device: torch.device) -> str:
    # torch.cuda, torch.xpu, ... each name their devices; a backend that cannot is known by its type.
    get_name = getattr(getattr(torch, device.type, None), "get_device_name", None)
    return str(get_name(device)) if get_name is not None else device.type


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a torch built without NCCL
        return None
    return ".".join(str(part) for part in version)
