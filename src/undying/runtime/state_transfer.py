"""Replica state between ranks over the process group, in one encoding for every path.

Runs in the worker. A state (nested dicts/lists with tensors: what ``TrainingState.replica_state``
returns) travels as a small pickled skeleton (the structure, every non-tensor value, each
tensor's dtype and shape) followed by each tensor with the backend's own send or broadcast: no
serialization of tensor data, and with NCCL the tensors stay on the device. ``broadcast_state``
carries a T2 restore from rank 0 to all; ``send_state``/``recv_state`` carry a repair from the
source replica to the replacement ranks only.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch

from undying.checkpoint.state_tree import flatten_state, unflatten_state
from undying.runtime.pg import GenerationGroup

SIZE_TAG = 0  # point-to-point tags: the skeleton's length, the skeleton, then one per tensor
SKELETON_TAG = 1
FIRST_TENSOR_TAG = 2

Layout = list[tuple[torch.dtype, tuple[int, ...]]]


def encode(state: Any) -> tuple[Any, list[torch.Tensor], bytes]:
    """``state`` as (skeleton, its tensors in skeleton order, the skeleton and layout as bytes)."""
    skeleton, tensors = flatten_state(state)
    layout: Layout = [(tensor.dtype, tuple(tensor.shape)) for tensor in tensors]
    return skeleton, tensors, pickle.dumps((skeleton, layout), protocol=pickle.HIGHEST_PROTOCOL)


def _skeleton_and_buffers(payload: torch.Tensor, device: torch.device) -> tuple[Any, list[torch.Tensor]]:
    """The receiving side: the skeleton, and an empty tensor for each tensor that will arrive."""
    # Only bytes this job's own ranks sent over the job's process group.
    skeleton, layout = pickle.loads(payload.cpu().numpy().tobytes())  # noqa: S301
    return skeleton, [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in layout]


def _as_bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _on_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    return [tensor.to(device).contiguous() for tensor in tensors]


def broadcast_state(group: GenerationGroup, state: Any, src: int, device: torch.device) -> Any:
    """``state`` from group rank ``src`` to every rank of ``group`` (the others pass None)."""
    if group.rank == src:
        skeleton, tensors, skeleton_bytes = encode(state)
        size = torch.tensor([len(skeleton_bytes)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    group.broadcast(size, src)
    if group.rank == src:
        payload = _as_bytes_tensor(skeleton_bytes, device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.broadcast(payload, src)
    if group.rank == src:
        tensors = _on_device(tensors, device)
    else:
        skeleton, tensors = _skeleton_and_buffers(payload, device)
    for tensor in tensors:
        if tensor.numel():
            group.broadcast(tensor, src)
    return unflatten_state(skeleton, tensors)


def send_state(group: GenerationGroup, state: Any, destinations: Sequence[int], device: torch.device) -> None:
    """``state`` to each group rank in ``destinations``, one after the other (each calls ``recv_state``)."""
    _, tensors, skeleton_bytes = encode(state)
    size = torch.tensor([len(skeleton_bytes)], dtype=torch.int64, device=device)
    payload = _as_bytes_tensor(skeleton_bytes, device)
    tensors = _on_device(tensors, device)
    for destination in destinations:
        group.send(size, destination, SIZE_TAG)
        group.send(payload, destination, SKELETON_TAG)
        for index, tensor in enumerate(tensors):
            if tensor.numel():
                group.send(tensor, destination, FIRST_TENSOR_TAG + index)


def recv_state(group: GenerationGroup, src: int, device: torch.device) -> Any:
    """The state group rank ``src`` sends with ``send_state``; its tensors on ``device``."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    group.recv(size, src, SIZE_TAG)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.recv(payload, src, SKELETON_TAG)
    skeleton, tensors = _skeleton_and_buffers(payload, device)
    for index, tensor in enumerate(tensors):
        if tensor.numel():
            group.recv(tensor, src, FIRST_TENSOR_TAG + index)
    return unflatten_state(skeleton, tensors)
