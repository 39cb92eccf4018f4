"""torch.distributed.checkpoint (DCP) internals: reading a checkpoint without a template state dict
and without a process group, and the pieces of DCP's file reader that undying's parallel reader
reuses. Runs in the worker and wherever checkpoints are read.

Imports DCP when imported (over a second of a worker's start): import this module only where DCP
is used. Known to work with torch 2.13.0.
"""

from __future__ import annotations

import io
from typing import IO, Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index as _narrow_tensor_by_index
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as _FsspecReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as _FsspecWriter
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.checkpoint.utils import _create_file_view

# DCP's planner that rebuilds the saved state dict from the checkpoint's metadata (public planners
# load into a state dict the caller already holds, of the saved shape); ``keys`` limits it to some
# top-level entries. A base class of undying's own planner.
EmptyStateDictLoadPlanner = _EmptyStateDictLoadPlanner
# DCP's reader and writer of a checkpoint behind an fsspec URL: not exported by
# torch.distributed.checkpoint; undying's parallel reader derives from the reader.
FsspecReader = _FsspecReader
FsspecWriter = _FsspecWriter


def load_without_process_group(state: dict[str, Any], reader: StorageReader, planner: LoadPlanner) -> None:
    """Read a checkpoint into ``state`` in this process alone, whatever process groups exist.

    Needs ``state_dict_loader._load_state_dict(no_dist=True)``: the public ``dcp.load`` copies back
    only the keys ``state`` already had, so an empty-state-dict planner's result would be dropped."""
    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)


def file_view(stream: IO[bytes], offset: int, length: int) -> IO[bytes]:
    """A read-only window of ``length`` bytes at ``offset`` of ``stream``, as DCP's reader reads one
    item of a data file. Needs ``checkpoint.utils._create_file_view``: not public."""
    return cast(IO[bytes], _create_file_view(cast(io.IOBase, stream), offset, length))


def narrow_tensor_by_index(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """The chunk of ``tensor`` at ``offsets`` of ``sizes`` (per dim), as DCP's reader narrows a stored
    tensor to the part a read item asks for. Needs ``torch.distributed._shard._utils``: not public."""
    narrowed: torch.Tensor = _narrow_tensor_by_index(tensor, offsets, sizes)
    return narrowed


def set_element(root: Any, path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` (DCP's flattening mapping of a key) in the nested ``root``.
    Needs ``checkpoint._traverse.set_element``: DCP's unflattening, not public."""
    from torch.distributed.checkpoint._traverse import set_element as _set_element

    _set_element(root, path, value)
