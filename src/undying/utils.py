"""Small helpers shared by every process: parameter digests and time formatting."""

from __future__ import annotations

import hashlib

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
