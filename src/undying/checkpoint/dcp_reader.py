"""T2's read path: DCP's file reader with each data file read on its own thread, and a saved tensor
that a load rebuilds whole handed over as ``torch.load`` returned it instead of copied once more.

Runs in the worker: rank 0 reading the shared shard at a restore (checkpoint/dcp_format.py), every
rank of a sharded job reading its own shards (checkpoint/dcp_sharded.py); a local directory and one
behind an fsspec URL alike, each backend naming its reader (``StorageBackend.dcp_reader``). The files were verified against the manifest before any of this parses
them (checkpoint/committed.py).

DCP's ``FileSystemReader`` reads the files one after the other, each record in plan order, loads
every tensor into fresh memory and copies it into the target the planner resolves: for a restore
into an empty state dict that target is a placeholder of the same size, so every byte is written
twice. Here:

- each data file is read by one of up to ``READ_THREADS`` threads (the reads and ``torch.load``'s
  copies release the GIL), its records in file order;
- with an ``AdoptingPlanner`` (an empty state dict rebuilt from the metadata), a tensor read whole
  replaces its placeholder in the state dict; a part of a tensor, or a target that is live memory
  (a sharded load into the model's own shards), is copied as DCP does;
- the planner is called under one lock (its state dict is shared); the reads and copies are not.

Guarantees: the same state as ``FileSystemReader`` with the same planner (tests/unit/test_dcp_reader.py).
Not guaranteed: anything about a file that was not verified first. Imports
torch.distributed.checkpoint (seconds): import this module where a read happens, never at a
worker's start.
"""

from __future__ import annotations

import functools
import io
import threading
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from undying._torch_compat.dcp import (
    EmptyStateDictLoadPlanner,
    FsspecReader,
    file_view,
    narrow_tensor_by_index,
    set_element,
)
from undying.checkpoint.side_by_side import side_by_side

READ_THREADS = 4  # data files read at once: a shared shard has one or two, a sharded checkpoint one per rank


class AdoptingPlanner(EmptyStateDictLoadPlanner):
    """Rebuilds the saved state dict from the metadata (DCP's empty-state-dict planner) and takes a
    tensor read whole as the value itself, in place of the placeholder it allocated for it."""

    def adopt(self, read_item: ReadItem, tensor: torch.Tensor) -> bool:
        """Take ``tensor`` as the value ``read_item`` names, if it is the whole of it (not one chunk of
        a tensor saved in several) with its dtype and owns exactly its own bytes; False: copy it."""
        placeholder = self.lookup_tensor(read_item.dest_index)
        owned = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        if placeholder.size() != tensor.size() or placeholder.dtype != tensor.dtype or not owned:
            return False
        fqn = read_item.dest_index.fqn
        self.state_dict[fqn] = tensor
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], tensor)
        return True


class ParallelReads:
    """DCP's ``read_data`` with the data files on threads (see the module docstring), for a reader
    class of DCP's that has ``storage_data``, ``fs``, ``path`` and ``transforms``."""

    storage_data: dict[Any, Any]
    fs: Any
    path: Any
    transforms: Any

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for read_item in plan.items:
            per_file.setdefault(self.storage_data[read_item.storage_index].relative_path, []).append(read_item)
        lock = threading.Lock()
        side_by_side([functools.partial(self._read_file, relative_path, items, planner, lock)
                      for relative_path, items in per_file.items()], READ_THREADS, "undying-t2-read")
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_file(self, relative_path: str, items: list[ReadItem], planner: LoadPlanner,
                   lock: threading.Lock) -> None:
        items = sorted(items, key=lambda read_item: self.storage_data[read_item.storage_index].offset)
        with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
            for read_item in items:
                stored = self.storage_data[read_item.storage_index]
                view = file_view(stream, stored.offset, stored.length)
                source = self.transforms.transform_load_stream(read_item, stored.transform_descriptors or (), view)
                if read_item.type == LoadItemType.BYTE_IO:
                    data = io.BytesIO(source.read(-1))
                    with lock:
                        planner.load_bytes(read_item, data)
                    continue
                if not source.seekable():  # torch.load seeks
                    source = io.BytesIO(source.read(-1))
                loaded = torch.load(source, map_location="cpu", weights_only=True)
                _place(read_item, narrow_tensor_by_index(loaded, read_item.storage_offsets, read_item.lengths),
                       planner, lock)


class ParallelFileReader(ParallelReads, FileSystemReader):
    """``FileSystemReader`` reading its data files on threads (``LocalBackend.dcp_reader``)."""


class ParallelFsspecReader(ParallelReads, FsspecReader):
    """DCP's fsspec reader reading its data files on threads (``UrlBackend.dcp_reader``)."""


def _place(read_item: ReadItem, tensor: torch.Tensor, planner: LoadPlanner, lock: threading.Lock) -> None:
    """Hand ``tensor`` (what ``read_item`` names) to the planner: adopted where an ``AdoptingPlanner``
    takes it, else copied into the target the planner resolves, as DCP does."""
    with lock:
        target = planner.resolve_tensor(read_item).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"read item {read_item.storage_index}: sizes differ, {target.size()} vs {tensor.size()}")
        if isinstance(planner, AdoptingPlanner) and planner.adopt(read_item, tensor):
            return
    target.copy_(tensor)
    with lock:
        planner.commit_tensor(read_item, target)

