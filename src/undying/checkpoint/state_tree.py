"""A training state as a tree of dicts, lists and tuples with tensors at the leaves: split into a
picklable skeleton and its tensors, put back together, or copied into live memory.

Runs in the worker: the T1 snapshot (snapshot.py) stores the skeleton and the tensors apart, and
the DCP shard (dcp_format.py) and the restore use the same walk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from undying._torch_compat.tensors import copy_state_dict_metadata


@dataclass(frozen=True)
class TensorRef:
    """Stands for the tensor at ``index`` of a flattened state."""

    index: int


def flatten_state(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split ``state`` into a picklable skeleton (tensors replaced by ``TensorRef``) and its tensors.

    Dicts (their type and ``_metadata``, which ``load_state_dict`` reads, kept), lists and
    tuples are walked; every other value stays in the skeleton as is.
    """
    tensors: list[torch.Tensor] = []

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach())
            return TensorRef(len(tensors) - 1)
        return value

    return _map_leaves(state, leaf), tensors


def unflatten_state(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of ``flatten_state``: the skeleton with each ``TensorRef`` replaced by its tensor."""
    return _map_leaves(skeleton, lambda value: tensors[value.index] if isinstance(value, TensorRef) else value)


def _map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """A copy of the nested dicts (type and ``_metadata`` kept), lists and tuples (named ones too) in
    ``value``, with ``leaf`` applied to every other value."""
    if isinstance(value, dict):
        copied = OrderedDict() if isinstance(value, OrderedDict) else {}
        for key, item in value.items():
            copied[key] = _map_leaves(item, leaf)
        copy_state_dict_metadata(value, copied)
        return copied
    if isinstance(value, list):
        return [_map_leaves(item, leaf) for item in value]
    if isinstance(value, tuple):
        items = [_map_leaves(item, leaf) for item in value]
        return _named_tuple_type(value)._make(items) if hasattr(value, "_fields") else tuple(items)
    return leaf(value)


def copy_into(source: Any, live: Any) -> Any:
    """A private copy of ``source`` (e.g. a snapshot's views) that reuses ``live`` memory: each tensor
    is copied into the tensor at the same place of ``live`` when that one has the same dtype and
    shape (on any device: host-to-device for a GPU job), and cloned otherwise. Restoring into a
    process that already holds its state (or its model's parameters) then allocates nothing for
    those tensors."""
    if isinstance(source, torch.Tensor):
        if (isinstance(live, torch.Tensor) and live.dtype == source.dtype and live.shape == source.shape
                and not live.requires_grad):
            return live.copy_(source)
        return source.clone()
    if isinstance(source, dict):
        copied = OrderedDict() if isinstance(source, OrderedDict) else {}
        for key, item in source.items():
            copied[key] = copy_into(item, live.get(key) if isinstance(live, dict) else None)
        copy_state_dict_metadata(source, copied)
        return copied
    if isinstance(source, (list, tuple)):
        same_shape = isinstance(live, (list, tuple)) and len(live) == len(source)
        items = [copy_into(item, live[index] if same_shape else None) for index, item in enumerate(source)]
        if isinstance(source, list):
            return items
        return _named_tuple_type(source)._make(items) if hasattr(source, "_fields") else tuple(items)
    return source


def _named_tuple_type(value: tuple[Any, ...]) -> Any:
    """The class of a named tuple (checked by the caller: it has ``_fields``), to rebuild one with ``_make``."""
    return cast(Any, type(value))
