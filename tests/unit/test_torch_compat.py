"""Each of torch's internals that undying uses (undying/_torch_compat), exercised on real torch
objects: a torch upgrade that moves one fails the test named after it."""

from __future__ import annotations

import datetime
import io
import mmap
import sys
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

from undying._torch_compat import dist as compat_dist
from undying._torch_compat import fsdp as compat_fsdp
from undying._torch_compat import tensors as compat_tensors
from undying._torch_compat import training as compat_training
from undying.runtime import default_group

TIMEOUT = datetime.timedelta(seconds=30)


@pytest.fixture
def default_pg() -> Iterator[None]:
    """torch's default group (world size 1) for the test; destroying it empties torch's registry."""
    assert not dist.is_initialized() and default_group._installed is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def gloo_group(store: dist.Store, rank: int, world_size: int, name: str) -> dist.ProcessGroup:
    backend = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world_size, TIMEOUT)
    return compat_dist.group_over_backend(backend, dist.PrefixStore(name, store), rank, world_size, "cpu",
                                          "gloo", name)


# dist


def test_fsdp_group_methods_are_process_group_methods() -> None:
    missing = [name for name in compat_dist.FSDP_GROUP_METHODS if not callable(getattr(dist.ProcessGroup, name, None))]
    assert not missing


def test_group_over_backend_runs_collectives_under_its_name() -> None:
    store, sums = dist.HashStore(), [torch.zeros(1), torch.zeros(1)]

    def rank(index: int) -> None:
        group = gloo_group(store, index, 2, "compat/pair")
        assert group.group_name == "compat/pair" and group.rank() == index and group.size() == 2
        sums[index] = torch.tensor([index + 1.0])
        group.allreduce([sums[index]]).wait()

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [float(value) for value in sums] == [3.0, 3.0]


def test_register_named_group_makes_it_known_by_name_and_in_the_world_map(default_pg: None) -> None:
    store = dist.HashStore()
    groups = [gloo_group(store, 0, 1, "compat/replicate"), gloo_group(store, 0, 1, "compat/shard")]
    for group in groups:
        compat_dist.register_named_group(group, group.group_name, "gloo", {0: 0}, f"undying:{group.group_name}")
    assert dist.get_process_group_ranks(groups[0]) == [0]
    assert dist.get_backend(groups[1]) == "gloo"
    mesh = compat_dist.device_mesh_over_groups("cpu", torch.arange(1).view(1, 1), ("replicate", "shard"), 0, groups)
    assert mesh.get_group("replicate") is groups[0] and mesh.get_group("shard") is groups[1]
    # Registering again under the same name replaces the group.
    replacement = gloo_group(store, 0, 1, "compat/shard")
    compat_dist.register_named_group(replacement, "compat/shard", "gloo", {0: 0}, "undying:compat/shard")
    assert mesh.get_group("shard") is replacement


def test_device_mesh_over_groups_places_the_given_rank(default_pg: None) -> None:
    store = dist.HashStore()
    groups = [gloo_group(store, 0, 1, "compat/rows"), gloo_group(store, 0, 1, "compat/columns")]
    for group in groups:
        compat_dist.register_named_group(group, group.group_name, "gloo", {0: 0}, f"undying:{group.group_name}")
    mesh = compat_dist.device_mesh_over_groups("cpu", torch.arange(4).view(2, 2), ("replicate", "shard"), 3, groups)
    assert list(mesh.get_coordinate() or []) == [1, 1] and mesh.mesh_dim_names == ("replicate", "shard")
    assert mesh.get_group(0) is groups[0] and mesh.get_group(1) is groups[1]


def test_default_group_names_lists_the_default_group(default_pg: None, monkeypatch: pytest.MonkeyPatch) -> None:
    names = compat_dist.default_group_names()
    assert names is not None and dist.group.WORLD in names
    monkeypatch.setattr(dist.distributed_c10d, "_world", object())
    assert compat_dist.default_group_names() is None


def test_set_backend_timeout_sets_the_options_timeout() -> None:
    # NCCL's Options and gloo's share the base class that holds the timeout.
    options = dist.ProcessGroupGloo._Options()
    compat_dist.set_backend_timeout(options, datetime.timedelta(seconds=7))
    assert options._timeout == datetime.timedelta(seconds=7)
    if hasattr(dist, "ProcessGroupNCCL"):
        nccl_options = dist.ProcessGroupNCCL.Options()
        compat_dist.set_backend_timeout(nccl_options, datetime.timedelta(seconds=9))
        assert nccl_options._timeout == datetime.timedelta(seconds=9)


def test_bucket_assignment_by_size_cuts_at_each_limit_in_the_given_order() -> None:
    tensors = [torch.zeros(256) for _ in range(4)]  # 1 KiB each
    assert compat_dist.bucket_assignment_by_size(tensors, [2048]) == [[0, 1], [2, 3]]
    assert compat_dist.bucket_assignment_by_size(tensors, [1024, 2048]) == [[0], [1, 2], [3]]
    assert compat_dist.bucket_assignment_by_size(tensors, [2048], [3, 2, 1, 0]) == [[3, 2], [1, 0]]
    assert compat_dist.bucket_assignment_by_size(tensors, [sys.maxsize]) == [[0, 1, 2, 3]]


# fsdp


def sharded_linear() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    return fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh=init_device_mesh("cpu", (1,)))


def weight_gradient(model: torch.nn.Module) -> torch.Tensor:
    grad = model[0].weight.grad
    assert grad is not None
    return grad.to_local()


def test_fsdp_meshes_are_what_the_module_was_sharded_over(default_pg: None) -> None:
    model = sharded_linear()
    meshes = compat_fsdp.fsdp_meshes(model)
    assert len(meshes) == 1 and meshes[0].size() == 1 and meshes[0].device_type == "cpu"
    assert compat_fsdp.fsdp_meshes(torch.nn.Linear(2, 2)) == []


def test_forget_unsharded_gradients_drops_what_a_backward_left(default_pg: None) -> None:
    """A backward without gradient sync leaves its gradient on the unsharded parameters; the next
    synced step adds to it unless it is forgotten."""
    x = torch.ones(2, 4)
    reference = sharded_linear()
    reference(x).sum().backward()
    one_step = weight_gradient(reference).clone()
    for forget in (False, True):
        model = sharded_linear()
        model.set_requires_gradient_sync(False)
        model(x).sum().backward()
        if forget:
            for module in model.modules():
                compat_fsdp.forget_unsharded_gradients(module)
        model.set_requires_gradient_sync(True)
        model(x).sum().backward()
        assert torch.equal(weight_gradient(model), one_step if forget else 2 * one_step)


# training


def test_compiled_original_is_the_module_torch_compile_wrapped() -> None:
    module = torch.nn.Linear(2, 2)
    assert compat_training.compiled_original(torch.compile(module)) is module
    assert compat_training.compiled_original(module) is None


def test_queue_backward_callback_runs_once_every_gradient_is_in() -> None:
    first, second = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    seen: list[bool] = []

    def queue(grad: torch.Tensor) -> torch.Tensor:
        compat_training.queue_backward_callback(lambda: seen.append(first.grad is not None and second.grad is not None))
        return grad

    first.register_hook(queue)
    (first * 2 + second * 3).sum().backward()
    assert seen == [True]


def test_import_dynamo_imports_it() -> None:
    compat_training.import_dynamo()
    assert "torch._dynamo" in sys.modules


def test_child_schedulers_are_a_sequential_or_chained_schedulers_children() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    children = [torch.optim.lr_scheduler.ConstantLR(optimizer), torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9)]
    sequential = torch.optim.lr_scheduler.SequentialLR(optimizer, children, milestones=[2])
    chained = torch.optim.lr_scheduler.ChainedScheduler(children)
    assert compat_training.child_schedulers(sequential) == children
    assert compat_training.child_schedulers(chained) == children
    assert compat_training.child_schedulers(children[0]) == []


def test_forget_grad_scaler_step_lets_the_step_unscale_again() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(param.sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(optimizer)
    compat_training.forget_grad_scaler_step(scaler)
    scaler.unscale_(optimizer)


# tensors


class Pair(NamedTuple):
    left: Any
    right: Any


def test_map_tensors_reaches_tensors_in_nested_containers() -> None:
    tree = {"a": [torch.ones(1), 3], "b": Pair(torch.ones(1), "x")}
    mapped = compat_tensors.map_tensors(lambda tensor: tensor * 2, tree)
    assert float(mapped["a"][0]) == 2.0 and mapped["a"][1] == 3
    assert isinstance(mapped["b"], Pair) and float(mapped["b"].left) == 2.0 and mapped["b"].right == "x"


def test_foreach_copy_copies_each_tensor() -> None:
    sources, destinations = [torch.arange(3.0), torch.ones(2, 2)], [torch.zeros(3), torch.zeros(2, 2)]
    compat_tensors.foreach_copy(destinations, sources)
    assert all(torch.equal(copied, source) for copied, source in zip(destinations, sources, strict=True))


def test_pin_host_range_locks_a_mapping() -> None:
    from torch.cuda import _pin_memory_utils

    assert callable(_pin_memory_utils.pin_memory) and callable(_pin_memory_utils.unpin_memory)
    if not torch.cuda.is_available():
        pytest.skip("page-locking needs CUDA")
    mapping = mmap.mmap(-1, 1 << 20)
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    compat_tensors.pin_host_range(address, 1 << 20)
    compat_tensors.unpin_host_range(address)


def test_copy_state_dict_metadata_keeps_the_module_versions() -> None:
    state = torch.nn.BatchNorm1d(2).state_dict()
    copied: OrderedDict[str, Any] = OrderedDict(state)
    compat_tensors.copy_state_dict_metadata(state, copied)
    assert copied._metadata[""]["version"] == torch.nn.BatchNorm1d._version  # type: ignore[attr-defined]
    plain: dict[str, Any] = {}
    compat_tensors.copy_state_dict_metadata({}, plain)
    assert not hasattr(plain, "_metadata")


def test_skip_record_crcs_when_leaves_them_out_of_that_threads_saves_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.serialization as serialization

    monkeypatch.setattr(serialization, "get_crc32_options", serialization.get_crc32_options)  # restored after
    monkeypatch.setattr(compat_tensors, "_crc_skips", [])
    skipping = threading.local()
    compat_tensors.skip_record_crcs_when(lambda: getattr(skipping, "on", False))

    def record_crcs() -> list[int]:
        buffer = io.BytesIO()
        torch.save({"a": torch.arange(10)}, buffer)
        assert torch.equal(torch.load(io.BytesIO(buffer.getvalue()))["a"], torch.arange(10))
        return [info.CRC for info in zipfile.ZipFile(buffer).infolist()]

    assert all(crc != 0 for crc in record_crcs())
    skipping.on = True
    assert all(crc == 0 for crc in record_crcs())


# dcp


def test_load_without_process_group_rebuilds_a_saved_state(tmp_path: Path, default_pg: None) -> None:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, save

    from undying._torch_compat import dcp as compat_dcp

    saved = {"weight": torch.arange(6.0).view(2, 3), "step": 7}
    save(saved, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    loaded: dict[str, Any] = {}
    compat_dcp.load_without_process_group(loaded, FileSystemReader(tmp_path),
                                          compat_dcp.EmptyStateDictLoadPlanner(keys={"weight"}))
    assert set(loaded) == {"weight"} and torch.equal(loaded["weight"], saved["weight"])


def test_fsspec_reader_reads_what_the_fsspec_writer_wrote(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import save

    from undying._torch_compat import dcp as compat_dcp

    url = f"file://{tmp_path}/ckpt"
    save({"bias": torch.ones(3)}, storage_writer=compat_dcp.FsspecWriter(url), no_dist=True)
    loaded: dict[str, Any] = {}
    compat_dcp.load_without_process_group(loaded, compat_dcp.FsspecReader(url), compat_dcp.EmptyStateDictLoadPlanner())
    assert torch.equal(loaded["bias"], torch.ones(3))


def test_file_view_is_a_window_of_the_stream() -> None:
    from undying._torch_compat import dcp as compat_dcp

    view = compat_dcp.file_view(io.BytesIO(b"0123456789"), 3, 4)
    assert view.read() == b"3456"


def test_narrow_tensor_by_index_takes_the_chunk() -> None:
    from undying._torch_compat import dcp as compat_dcp

    chunk = compat_dcp.narrow_tensor_by_index(torch.arange(12).view(3, 4), torch.Size([1, 1]), torch.Size([2, 2]))
    assert chunk.tolist() == [[5, 6], [9, 10]]


def test_set_element_puts_a_value_at_a_nested_path() -> None:
    from undying._torch_compat import dcp as compat_dcp

    root: dict[str, Any] = {"optimizer": {"state": {}}}
    compat_dcp.set_element(root, ("optimizer", "state", "lr"), 0.5)
    assert root == {"optimizer": {"state": {"lr": 0.5}}}


# the boundary

TORCH_NAMES = {"torch", "dist", "distributed_c10d"}  # how undying's modules name torch and its packages


def private_torch_uses(path: Path) -> list[str]:
    """``path``'s imports of torch's private modules or names, and its ``torch.x._y`` attribute chains."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [*(node.module or "").split("."), *(alias.name for alias in node.names)]
            if any(name.startswith("_") and not name.startswith("__") for name in names):
                found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.Import):
            if any(part.startswith("_") for alias in node.names if alias.name.startswith("torch.")
                   for part in alias.name.split(".")):
                found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in TORCH_NAMES:
                found.append(f"{path.name}:{node.lineno}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in {"_orig_mod", "_world", "_get_fsdp_state", "_metadata", "_schedulers"}):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_only_the_compat_package_touches_torch_internals() -> None:
    package = Path(compat_dist.__file__).parent.parent
    offenders = [use for path in sorted(package.rglob("*.py")) if "_torch_compat" not in path.parts
                 for use in private_torch_uses(path)]
    assert offenders == []
    assert private_torch_uses(Path(compat_dist.__file__))  # the check does see them where they are
