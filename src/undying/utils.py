"""Small helpers shared by every process: digests of parameters and of any state tree."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def param_sha256(module: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer of ``module`` in ``state_dict`` order.

    Two models have the same digest only if every value is bitwise equal; this is
    how tests prove a recovered run ends where a fault-free run ends. A sharded model's (FSDP2)
    parameters are gathered whole first: a collective, so every rank of the mesh must call this.
    """
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        if hasattr(tensor, "full_tensor"):  # a DTensor
            tensor = tensor.full_tensor()
        data = tensor.detach().to("cpu").contiguous()
        digest.update(str(data.dtype).encode())
        digest.update(str(tuple(data.shape)).encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")  # 0-dim: num_batches_tracked
    return digest.hexdigest()


def tree_sha256(tree: Any) -> str:
    """SHA-256 over a nested state (dicts, lists, tuples, tensors, plain values) as this process
    holds it: a DTensor counts as its local shard (no collective), a dict in the order of its keys'
    text, a plain value by its ``repr``. Two trees have the same digest only if every tensor is
    bitwise equal (same dtype and shape) and every other value prints the same."""
    digest = hashlib.sha256()
    _update(digest, tree)
    return digest.hexdigest()


def _update(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        if hasattr(value, "to_local"):  # a DTensor: this rank's shard
            value = value.to_local()
        data = value.detach().to("cpu").contiguous()
        digest.update(f"tensor {data.dtype} {tuple(data.shape)};".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    elif isinstance(value, dict):
        digest.update(f"dict {len(value)};".encode())
        for key in sorted(value, key=str):
            digest.update(f"{key!r}=".encode())
            _update(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__} {len(value)};".encode())
        for item in value:
            _update(digest, item)
    else:
        digest.update(f"{value!r};".encode())
