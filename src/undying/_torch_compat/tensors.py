"""Tensor and serialization internals: pytree mapping, the fused copy, page-locking host memory, a
state_dict's ``_metadata``, torch.save's per-record checksums. Runs in the worker (the checkpoint
code). Known to work with torch 2.13.0.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map_only


def map_tensors(transform: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` (nested lists, tuples, dicts, named tuples, dataclasses torch registers) with every
    tensor replaced by ``transform(tensor)``.

    Needs ``torch.utils._pytree.tree_map_only``: torch 2.13 has no public pytree module (its other
    one, ``_cxx_pytree``, is private too and needs optree, which torch does not install)."""
    return tree_map_only(torch.Tensor, transform, tree)


def foreach_copy(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy each source into its destination in one fused call (tensors of one device).

    Needs ``torch._foreach_copy_``: the public equivalent is one ``copy_`` per tensor, a Python
    loop with a dispatch each, for state dicts of hundreds of tensors."""
    torch._foreach_copy_(list(destinations), list(sources))


def pin_host_range(address: int, size: int) -> None:
    """Page-lock ``size`` bytes of host memory at ``address`` for CUDA (an existing mapping, e.g. a
    shared-memory slot), as torch.distributed.checkpoint's stager does. CUDA builds only.

    Needs ``torch.cuda._pin_memory_utils.pin_memory``: public pinning (``Tensor.pin_memory``)
    allocates new pinned memory and copies; it cannot lock memory that is already mapped."""
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.pin_memory(address, size)


def unpin_host_range(address: int) -> None:
    """Undo ``pin_host_range`` at ``address``. Needs ``torch.cuda._pin_memory_utils.unpin_memory``."""
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.unpin_memory(address)


def copy_state_dict_metadata(source: object, target: object) -> None:
    """Give ``target`` (a copy of the dict ``source``) the ``_metadata`` that ``Module.state_dict()``
    attaches (each submodule's state version, which ``load_state_dict`` passes to
    ``_load_from_state_dict``).

    Needs the ``_metadata`` attribute: it is how torch keeps that version; a copied dict loses it."""
    metadata = getattr(source, "_metadata", None)
    if metadata is not None:
        target._metadata = metadata  # type: ignore[attr-defined]


_crc_skips: list[Callable[[], bool]] = []
_crc_lock = threading.Lock()


def skip_record_crcs_when(skip: Callable[[], bool]) -> None:
    """Make ``torch.save`` leave out its per-record CRC-32 in an archive opened while ``skip()`` is
    true (on the calling thread); everywhere else it asks torch's own setting. Once per ``skip``;
    where torch has no such setting, nothing changes (each record keeps its CRC).

    Needs ``torch.serialization.get_crc32_options`` to be what ``torch.save`` reads, through the
    module, when it opens an archive: the public ``set_crc32_options`` switches the CRCs off for the
    whole process, the training script's own saves included."""
    import torch.serialization as serialization

    with _crc_lock:
        if skip not in _crc_skips:
            _crc_skips.append(skip)
        original = getattr(serialization, "get_crc32_options", None)
        if original is None or getattr(original, "undying_wrapped", False):
            return

        def get_crc32_options() -> bool:
            return False if any(skipping() for skipping in _crc_skips) else bool(original())

        get_crc32_options.undying_wrapped = True  # type: ignore[attr-defined]
        serialization.get_crc32_options = get_crc32_options
