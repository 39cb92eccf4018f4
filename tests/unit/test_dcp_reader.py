"""T2's read path (checkpoint/dcp_reader.py): the same state as DCP's own readers (a directory, a URL), whole tensors
owning exactly their bytes, several data files read at once, live targets filled in place; and a
checkpoint's files verified side by side still report the first bad one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from undying.checkpoint import CorruptCheckpoint, commit, latest_verified, save_object, staging_dir
from undying.checkpoint.dcp_reader import AdoptingPlanner, ParallelFileReader, ParallelFsspecReader
from undying.checkpoint.storage import verify


def varied_state() -> dict[str, Any]:
    """Tensors of several dtypes and shapes (a scalar, a transposed view, an empty one), nested
    dicts, and values DCP stores as bytes."""
    torch.manual_seed(0)
    wide = torch.randn(64, 48)
    return {
        "model": {"weight": torch.randn(256, 32), "bias": torch.randn(32).to(torch.bfloat16),
                  "transposed": wide.t(), "empty": torch.empty(0, 4)},
        "optimizer": {"state": {"weight": {"step": torch.tensor(7.0), "exp_avg": torch.randn(256, 32),
                                           "counts": torch.arange(1000, dtype=torch.int64)}},
                      "param_groups": [{"lr": 0.1, "params": ["weight"]}]},
        "extras": {"position": 12, "names": ["a", "b"]},
    }


def save(path: Path, state: dict[str, Any], thread_count: int) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=thread_count), no_dist=True)


def load(reader: Any, planner: Any, keys: set[str] | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=planner(keys=keys), no_dist=True)
    return state


def assert_same(left: Any, right: Any, where: str = "") -> None:
    if isinstance(left, dict):
        assert isinstance(right, dict) and left.keys() == right.keys(), where
        for key in left:
            assert_same(left[key], right[key], f"{where}.{key}")
    elif isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor), where
        assert left.dtype == right.dtype and left.shape == right.shape, where
        assert torch.equal(left, right), where
    else:
        assert left == right, where


@pytest.mark.parametrize("files", [1, 3])
def test_reads_what_dcps_reader_reads(tmp_path: Path, files: int) -> None:
    save(tmp_path, varied_state(), thread_count=files)
    assert len(list(tmp_path.glob("*.distcp"))) == files
    ours = load(ParallelFileReader(tmp_path), AdoptingPlanner)
    assert_same(load(FileSystemReader(tmp_path), _EmptyStateDictLoadPlanner), ours)
    assert_same(varied_state(), ours)


def test_reads_what_dcps_reader_reads_behind_a_url(url_root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    dcp.save(varied_state(), storage_writer=FsspecWriter(url_root, thread_count=3), no_dist=True)
    ours = load(ParallelFsspecReader(url_root), AdoptingPlanner)
    assert_same(load(FsspecReader(url_root), _EmptyStateDictLoadPlanner), ours)
    assert_same(varied_state(), ours)


def test_an_adopted_tensor_holds_its_own_bytes_only(tmp_path: Path) -> None:
    save(tmp_path, varied_state(), thread_count=2)
    state = load(ParallelFileReader(tmp_path), AdoptingPlanner)
    tensors = [state["model"]["weight"], state["model"]["transposed"], state["optimizer"]["state"]["weight"]["counts"]]
    for tensor in tensors:
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    assert len({tensor.untyped_storage().data_ptr() for tensor in tensors}) == len(tensors)


def test_a_tensor_saved_in_chunks_is_put_together_not_replaced_by_one_chunk() -> None:
    """A tensor a sharded job saved in two chunks: each read item covers half of its placeholder, so
    each chunk is copied into its half; neither becomes the whole value."""
    import threading

    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from undying.checkpoint.dcp_reader import _place

    halves = [ChunkStorageMetadata(offsets=torch.Size([row, 0]), sizes=torch.Size([4, 4])) for row in (0, 4)]
    metadata = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size([8, 4]), chunks=halves)},
        planner_data={"w": ("w",)})
    state: dict[str, Any] = {}
    planner = AdoptingPlanner()
    planner.set_up_planner(state, metadata)
    items = planner.create_local_plan().items
    assert len(items) == 2
    for item in items:
        _place(item, torch.full((4, 4), float(item.dest_offsets[0] + 1)), planner, threading.Lock())
    assert torch.equal(state["w"], torch.cat([torch.full((4, 4), 1.0), torch.full((4, 4), 5.0)]))


def test_keys_select_what_is_read(tmp_path: Path) -> None:
    save(tmp_path, varied_state(), thread_count=2)
    state = load(ParallelFileReader(tmp_path), AdoptingPlanner, keys={"extras"})
    assert state == {"extras": {"position": 12, "names": ["a", "b"]}}


def test_live_targets_are_filled_in_place(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    saved = varied_state()
    save(tmp_path, saved, thread_count=3)
    targets = {"model": {name: torch.zeros_like(tensor) for name, tensor in saved["model"].items()}}
    before = {name: tensor.data_ptr() for name, tensor in targets["model"].items()}
    dcp.load(targets, storage_reader=ParallelFileReader(tmp_path), no_dist=True)
    assert {name: tensor.data_ptr() for name, tensor in targets["model"].items()} == before
    assert_same(saved["model"], targets["model"])


def test_parallel_verify_names_the_first_bad_file_in_manifest_order(tmp_path: Path) -> None:
    staging = staging_dir(tmp_path, 1, 1)
    records = [save_object(staging, f"part_{index}.pt", torch.full((1024,), float(index))) for index in range(6)]
    committed = commit(tmp_path, staging, step=1, generation=1, world_size=1, files=records)
    for index in (2, 4):  # two damaged files: the report is always the earlier one
        path = Path(committed.path) / f"part_{index}.pt"
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    for _ in range(5):
        with pytest.raises(CorruptCheckpoint, match="part_2.pt"):
            verify(committed)
    assert latest_verified(tmp_path) is None
