"""Replica state between ranks over the process group, in one encoding for every path.

Runs in the worker. A state (nested dicts/lists with tensors: what ``TrainingState.replica_state``
returns) travels as a small pickled skeleton (the structure, every non-tensor value, each
tensor's dtype, shape and whether it lived in host memory) followed by the tensors packed by dtype
into buckets of at most BUCKET_BYTES, each one message with the backend's own send or broadcast: no
serialization of tensor data, and with NCCL the tensors travel on the device. ``broadcast_state``
carries a T2 restore from rank 0 to all; ``send_state``/``recv_state`` carry a repair from the
source replica to the replacement ranks only.

Guarantees: the transfer streams, one bucket at a time at both ends (packed, sent to every
receiver and freed at the source; received and unpacked into its tensors before the next), so
its extra memory is about one bucket besides the state itself (a receiver given ``live`` tensors
copies into them and allocates only the bucket); a tensor that lived on the host at the source
lands on the host, every other on ``device`` (``placement``). Not guaranteed: a receiver's
``live`` tensors hold anything meaningful if the transfer fails half-way.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from undying.checkpoint.state_tree import TensorRef, flatten_state, unflatten_state
from undying.runtime.pg import GenerationGroup

SIZE_TAG = 0  # point-to-point tags: the skeleton's length, the skeleton, then one per bucket
SKELETON_TAG = 1
FIRST_BUCKET_TAG = 2
# Tensors travel packed into buckets of one dtype, each one message: a message per tensor costs a
# round trip each (a few ms with gloo), which for an optimizer's hundreds of tensors was most of a
# repair. The cap is also the transfer's extra memory at each end: one bucket in flight at a time.
BUCKET_BYTES = 64 << 20


class TensorMeta(NamedTuple):
    """What a receiver needs to rebuild one tensor of the state."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    # It lived in host memory at the source, so the receiver keeps it there (see ``placement``).
    on_host: bool


Layout = list[TensorMeta]
# A bucket: a dtype and the indices (in skeleton order) of the tensors packed into it.
Bucket = tuple[torch.dtype, list[int]]


def placement(on_host: bool, device: torch.device | str) -> torch.device:
    """Where a receiver puts a tensor it holds no live counterpart for: in host memory if it lived
    there at the source, else on ``device``. Torch's Adam and AdamW keep each parameter's ``step``
    counter as a host scalar unless the group is ``capturable`` or ``fused``, and their
    ``load_state_dict`` leaves a plain group's ``step`` wherever it is given: one put on the GPU
    would cost every later step a device sync. The source's own placement is the optimizer's."""
    return torch.device("cpu") if on_host else torch.device(device)


def buckets_of(layout: Sequence[tuple[Any, ...]]) -> list[Bucket]:
    """Consecutive tensors of one dtype, up to BUCKET_BYTES each (a larger tensor is a bucket alone).
    Each entry of ``layout`` starts with a tensor's dtype and shape (a ``TensorMeta``)."""
    buckets: list[Bucket] = []
    size = 0
    for index, (dtype, shape, *_) in enumerate(layout):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if buckets and buckets[-1][0] == dtype and size + nbytes <= BUCKET_BYTES:
            buckets[-1][1].append(index)
            size += nbytes
        else:
            buckets.append((dtype, [index]))
            size = nbytes
    return buckets


def layout_of(tensors: Sequence[torch.Tensor]) -> Layout:
    return [TensorMeta(tensor.dtype, tuple(tensor.shape), tensor.device.type == "cpu") for tensor in tensors]


def encode(state: Any) -> tuple[Any, list[torch.Tensor], Layout, bytes]:
    """``state`` as (skeleton, its tensors in skeleton order, their layout, the skeleton and layout
    as bytes)."""
    skeleton, tensors = flatten_state(state)
    layout = layout_of(tensors)
    return skeleton, tensors, layout, pickle.dumps((skeleton, layout), protocol=pickle.HIGHEST_PROTOCOL)


def _decode(payload: torch.Tensor) -> tuple[Any, Layout]:
    # Only bytes this job's own ranks sent over the job's process group.
    return pickle.loads(payload.cpu().numpy().tobytes())  # noqa: S301


def _as_bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


def _numel(layout: Layout, indices: list[int]) -> int:
    return sum(math.prod(layout[index].shape) for index in indices)


def _outgoing(tensors: Sequence[torch.Tensor], layout: Layout, bucket: Bucket, device: torch.device) -> torch.Tensor:
    """One bucket as one flat tensor on ``device``. A lone contiguous tensor already there travels
    as itself (a tensor over BUCKET_BYTES costs no copy); others are copied into a fresh buffer,
    each straight into its slice (no temporary for a strided or host tensor)."""
    dtype, indices = bucket
    if len(indices) == 1:
        tensor = tensors[indices[0]]
        if _on(tensor, device) and tensor.is_contiguous():
            return tensor.detach().reshape(-1)
    packed = torch.empty(_numel(layout, indices), dtype=dtype, device=device)
    offset = 0
    for index in indices:
        numel = math.prod(layout[index].shape)
        packed[offset:offset + numel].view(layout[index].shape).copy_(tensors[index].detach())
        offset += numel
    return packed


def _usable(live: torch.Tensor, meta: TensorMeta) -> bool:
    # A tensor that requires grad (a parameter itself, not its state_dict's detached alias) is not
    # written in place, as copy_into does not.
    return (live.dtype == meta.dtype and tuple(live.shape) == meta.shape
            and not live.requires_grad)


def live_counterparts(skeleton: Any, live: Any, count: int) -> list[torch.Tensor | None]:
    """For each of the ``count`` tensors of ``skeleton``, the tensor at the same place of ``live`` (a
    state of the same structure: the receiver's own model and optimizer state), or None."""
    found: list[torch.Tensor | None] = [None] * count

    def walk(node: Any, live_node: Any) -> None:
        if isinstance(node, TensorRef):
            if isinstance(live_node, torch.Tensor):
                found[node.index] = live_node
        elif isinstance(node, dict):
            for key, item in node.items():
                walk(item, live_node.get(key) if isinstance(live_node, dict) else None)
        elif isinstance(node, (list, tuple)):
            same_length = isinstance(live_node, (list, tuple)) and len(live_node) == len(node)
            for index, item in enumerate(node):
                walk(item, live_node[index] if same_length else None)

    if live is not None:
        walk(skeleton, live)
    return found


def _receive_bucket(receive: Callable[[torch.Tensor], None], layout: Layout, bucket: Bucket,
                    live: list[torch.Tensor | None], device: torch.device) -> list[torch.Tensor]:
    """The bucket's tensors: each its live counterpart where one fits (filled in place), else a new
    tensor where ``placement`` says. Only the bucket's buffer is extra, and it is freed on return; a
    lone tensor that can arrive in place (a contiguous live one, or a new one on ``device``) has none."""
    dtype, indices = bucket
    numel = _numel(layout, indices)
    targets = []
    for index in indices:
        live_tensor, meta = live[index], layout[index]
        if live_tensor is not None and _usable(live_tensor, meta):
            targets.append(live_tensor)
        else:
            targets.append(torch.empty(meta.shape, dtype=dtype, device=placement(meta.on_host, device)))
    if numel == 0:
        return targets
    if len(indices) == 1 and _on(targets[0], device) and targets[0].is_contiguous():
        receive(targets[0].view(-1))
        return targets
    packed = torch.empty(numel, dtype=dtype, device=device)
    receive(packed)
    offset = 0
    for index, target in zip(indices, targets, strict=True):
        size = math.prod(layout[index].shape)
        target.copy_(packed[offset:offset + size].view(layout[index].shape))
        offset += size
    return targets


def broadcast_state(group: GenerationGroup, state: Any, src: int, device: torch.device, live: Any = None) -> Any:
    """``state`` from group rank ``src`` to every rank of ``group`` (the others pass None); the source
    gets its own tensors back where they are. ``live``: a receiver's state of the same structure,
    whose matching tensors (same dtype and shape) are filled in place instead of allocated."""
    if group.rank == src:
        skeleton, tensors, layout, skeleton_bytes = encode(state)
        size = torch.tensor([len(skeleton_bytes)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    group.broadcast(size, src)
    if group.rank == src:
        payload = _as_bytes_tensor(skeleton_bytes, device)
        group.broadcast(payload, src)
        for bucket in buckets_of(layout):
            outgoing = _outgoing(tensors, layout, bucket, device)
            if outgoing.numel():
                group.broadcast(outgoing, src)
            del outgoing  # before the next is packed: one bucket at a time
        return unflatten_state(skeleton, tensors)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.broadcast(payload, src)
    skeleton, layout = _decode(payload)
    live_tensors = live_counterparts(skeleton, live, len(layout))
    received: list[torch.Tensor] = []  # buckets hold consecutive tensors: skeleton order
    for bucket in buckets_of(layout):
        received += _receive_bucket(lambda tensor: group.broadcast(tensor, src), layout, bucket, live_tensors, device)
    return unflatten_state(skeleton, received)


def send_state(group: GenerationGroup, state: Any, destinations: Sequence[int], device: torch.device) -> None:
    """``state`` to each group rank in ``destinations`` (each calls ``recv_state``), bucket by bucket:
    each bucket is packed once, sent to every destination, and freed before the next."""
    _, tensors, layout, skeleton_bytes = encode(state)
    size = torch.tensor([len(skeleton_bytes)], dtype=torch.int64, device=device)
    payload = _as_bytes_tensor(skeleton_bytes, device)
    for destination in destinations:
        group.send(size, destination, SIZE_TAG)
        group.send(payload, destination, SKELETON_TAG)
    for index, bucket in enumerate(buckets_of(layout)):
        outgoing = _outgoing(tensors, layout, bucket, device)
        if outgoing.numel():
            for destination in destinations:
                group.send(outgoing, destination, FIRST_BUCKET_TAG + index)
        del outgoing


def recv_state(group: GenerationGroup, src: int, device: torch.device, live: Any = None) -> Any:
    """The state group rank ``src`` sends with ``send_state``: host tensors of the source on the
    host, the others on ``device``. ``live``: this rank's state of the same structure (its
    model's parameters, its optimizer's state once it has stepped), whose matching tensors (same
    dtype and shape) are filled in place and returned instead of new ones."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    group.recv(size, src, SIZE_TAG)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.recv(payload, src, SKELETON_TAG)
    skeleton, layout = _decode(payload)
    live_tensors = live_counterparts(skeleton, live, len(layout))
    received: list[torch.Tensor] = []  # buckets hold consecutive tensors: skeleton order
    for index, bucket in enumerate(buckets_of(layout)):
        def receive(tensor: torch.Tensor, tag: int = FIRST_BUCKET_TAG + index) -> None:
            group.recv(tensor, src, tag)

        received += _receive_bucket(receive, layout, bucket, live_tensors, device)
    return unflatten_state(skeleton, received)
