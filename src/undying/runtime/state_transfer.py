"""Replica state between ranks over the process group, in one encoding for every path.

Runs in the worker. A state (nested dicts/lists with tensors: what ``TrainingState.replica_state``
returns) travels as a small pickled skeleton (the structure, every non-tensor value, each
tensor's dtype and shape) followed by the tensors packed by dtype into a few buckets, each one
message with the backend's own send or broadcast: no serialization of tensor data, and with NCCL
the tensors stay on the device. ``broadcast_state`` carries a T2 restore from rank 0 to all;
``send_state``/``recv_state`` carry a repair from the source replica to the replacement ranks only.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from typing import Any

import torch

from undying.checkpoint.state_tree import flatten_state, unflatten_state
from undying.runtime.pg import GenerationGroup

SIZE_TAG = 0  # point-to-point tags: the skeleton's length, the skeleton, then one per bucket
SKELETON_TAG = 1
FIRST_BUCKET_TAG = 2
# Tensors travel packed into buckets of one dtype, each one message: a message per tensor costs a
# round trip each (a few ms with gloo), which for an optimizer's hundreds of tensors was most of a repair.
BUCKET_BYTES = 64 << 20

Layout = list[tuple[torch.dtype, tuple[int, ...]]]
# A bucket: a dtype and the indices (in skeleton order) of the tensors packed into it.
Bucket = tuple[torch.dtype, list[int]]


def buckets_of(layout: Layout) -> list[Bucket]:
    """Consecutive tensors of one dtype, up to BUCKET_BYTES each (a larger tensor is a bucket alone)."""
    buckets: list[Bucket] = []
    size = 0
    for index, (dtype, shape) in enumerate(layout):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if buckets and buckets[-1][0] == dtype and size + nbytes <= BUCKET_BYTES:
            buckets[-1][1].append(index)
            size += nbytes
        else:
            buckets.append((dtype, [index]))
            size = nbytes
    return buckets


def encode(state: Any) -> tuple[Any, list[torch.Tensor], bytes]:
    """``state`` as (skeleton, its tensors in skeleton order, the skeleton and layout as bytes)."""
    skeleton, tensors = flatten_state(state)
    layout: Layout = [(tensor.dtype, tuple(tensor.shape)) for tensor in tensors]
    return skeleton, tensors, pickle.dumps((skeleton, layout), protocol=pickle.HIGHEST_PROTOCOL)


def _decode(payload: torch.Tensor) -> tuple[Any, Layout]:
    # Only bytes this job's own ranks sent over the job's process group.
    return pickle.loads(payload.cpu().numpy().tobytes())  # noqa: S301


def _as_bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _packed(tensors: Sequence[torch.Tensor], buckets: list[Bucket], device: torch.device) -> list[torch.Tensor]:
    """Each bucket's tensors, flattened and concatenated on ``device``."""
    return [torch.cat([tensors[index].detach().reshape(-1).to(device) for index in indices])
            for _, indices in buckets]


def _empty_buckets(layout: Layout, buckets: list[Bucket], device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(sum(math.prod(layout[index][1]) for index in indices), dtype=dtype, device=device)
            for dtype, indices in buckets]


def _unpacked(packed: list[torch.Tensor], layout: Layout, buckets: list[Bucket]) -> list[torch.Tensor]:
    """The tensors back out of their buckets, each its own (cloned) storage, in skeleton order."""
    tensors: list[torch.Tensor | None] = [None] * len(layout)
    for bucket, (_, indices) in zip(packed, buckets, strict=True):
        offset = 0
        for index in indices:
            shape = layout[index][1]
            numel = math.prod(shape)
            tensors[index] = bucket[offset:offset + numel].view(shape).clone()
            offset += numel
    return [tensor for tensor in tensors if tensor is not None]


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
    skeleton_received, layout = _decode(payload)
    buckets = buckets_of(layout)
    if group.rank == src:
        packed = _packed(tensors, buckets, device)
    else:
        skeleton = skeleton_received
        packed = _empty_buckets(layout, buckets, device)
    for bucket in packed:
        if bucket.numel():
            group.broadcast(bucket, src)
    if group.rank == src:
        return unflatten_state(skeleton, [tensor.to(device) for tensor in tensors])
    return unflatten_state(skeleton, _unpacked(packed, layout, buckets))


def send_state(group: GenerationGroup, state: Any, destinations: Sequence[int], device: torch.device) -> None:
    """``state`` to each group rank in ``destinations``, one after the other (each calls ``recv_state``)."""
    _, tensors, skeleton_bytes = encode(state)
    layout: Layout = [(tensor.dtype, tuple(tensor.shape)) for tensor in tensors]
    buckets = buckets_of(layout)
    size = torch.tensor([len(skeleton_bytes)], dtype=torch.int64, device=device)
    payload = _as_bytes_tensor(skeleton_bytes, device)
    packed = _packed(tensors, buckets, device)
    for destination in destinations:
        group.send(size, destination, SIZE_TAG)
        group.send(payload, destination, SKELETON_TAG)
        for index, bucket in enumerate(packed):
            if bucket.numel():
                group.send(bucket, destination, FIRST_BUCKET_TAG + index)


def recv_state(group: GenerationGroup, src: int, device: torch.device) -> Any:
    """The state group rank ``src`` sends with ``send_state``; its tensors on ``device``."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    group.recv(size, src, SIZE_TAG)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.recv(payload, src, SKELETON_TAG)
    skeleton, layout = _decode(payload)
    buckets = buckets_of(layout)
    packed = _empty_buckets(layout, buckets, device)
    for index, bucket in enumerate(packed):
        if bucket.numel():
            group.recv(bucket, src, FIRST_BUCKET_TAG + index)
    return unflatten_state(skeleton, _unpacked(packed, layout, buckets))
