"""The gradient a shrunk sharded job applies is the mean over the job's whole global batch: a 2 x 2
HSDP job that lost replica 0 trains on as replica 1 (ranks 2 and 3, renumbered 0 and 1), each rank
covering two of the step's four batch slots, in ``accumulate`` and ``grow`` mode. Two processes over
real gloo groups (FSDP needs torch's default group, one per process), the gathered gradient against
the full-batch gradient computed directly: AdamW would hide a wrongly scaled one."""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

from undying.data import ResumableLoader
from undying.runtime.default_group import DefaultGroup
from undying.runtime.mesh import SwappableMesh
from undying.runtime.pg import GenerationGroup
from undying.runtime.sharded import ShardedModel

SLOTS, BATCH = 4, 3  # the full job: 4 ranks x 3 samples per step
MEMBERS = [2, 3]  # replica 1: what is left of the 2 x 2 mesh


class Points:
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(40, 5, generator=generator)
        self.y = torch.randn(40, 4, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 4)


def full_batch_gradient() -> torch.Tensor:
    """The gradient of the mean loss over step 0's 12 samples, as one process computes it."""
    reference = model()
    x, y = next(ResumableLoader(Points(), BATCH * SLOTS, 0, 0, 1))
    torch.nn.functional.mse_loss(reference(x), y).backward()
    return reference.weight.grad.clone()


CASES = [("accumulate", True), ("grow", True), ("accumulate", False)]  # (elastic_batch, set_replica_share)


def shrunk_rank(group_rank: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    rank, cpu = MEMBERS[group_rank], torch.device("cpu")
    store = torch.distributed.TCPStore("127.0.0.1", port, len(MEMBERS), group_rank == 0, wait_for_workers=False)
    group = GenerationGroup(store, "test", 2, group_rank, len(MEMBERS), "gloo", 30, cpu)
    default_group = DefaultGroup(group, lambda: False)
    mesh = SwappableMesh(rank, 2, 2, "gloo", cpu)
    mesh.enter(group, store, "test", lambda: False, 30, MEMBERS)
    gradients = {}
    for mode, share in CASES:
        wrapped = ShardedModel(fully_shard(model(), mesh=mesh.device_mesh), mesh, broadcast=True)
        loader = ResumableLoader(Points(), BATCH, 0, rank, SLOTS)
        loader.set_replicas(group_rank, len(MEMBERS), mode)
        if share:
            wrapped.set_replica_share(loader.slot_count if mode == "grow" else 1, SLOTS)
        for x, y in loader.step_batches():
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
        gradients[mode, share] = wrapped.module.weight.grad.full_tensor()
    if group_rank == 0:
        torch.save({"gradients": gradients, "replicas": mesh.replicas, "group": mesh.groups[0].members}, out)
    torch.distributed.barrier()
    mesh.close()
    default_group.destroy()


def test_the_replica_left_applies_the_full_batch_mean(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "gradients.pt"
    mp.start_processes(shrunk_rank, args=(port, str(out)), nprocs=len(MEMBERS), start_method="spawn")
    shrunk = torch.load(out)
    assert (shrunk["replicas"], shrunk["group"]) == (1, [2])  # job rank 2 alone in its column
    expected = full_batch_gradient()
    for mode in ("accumulate", "grow"):
        assert torch.allclose(shrunk["gradients"][mode, True], expected, rtol=1e-5, atol=1e-7), mode
    # FSDP's own mean over the ranks that trained sums two slots a rank: twice the gradient.
    assert torch.allclose(shrunk["gradients"]["accumulate", False], 2 * expected, rtol=1e-5, atol=1e-7)
