"""DDP's public surface on a wrapped model, on real gloo groups (ranks as threads): buffers broadcast
from rank 0 at every commit and wound back with a failed step, ``broadcast_buffers=False``,
torch's stock comm hooks summed in the buckets with DDP's arithmetic, DDP's constructor arguments
accepted or refused in one line, and ``SyncBatchNorm`` refused on CPU."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests.unit.gloo_ranks import run_ranks
from undying.runtime.ddp import FixedLayoutDDP, commit_vote
from undying.runtime.ddp_options import parse_ddp_options
from undying.runtime.pg import GenerationGroup

RANKS = 2
CPU = torch.device("cpu")


def bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 1))


def batch(rank: int, step: int = 0) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * rank + step))


def one_step(ddp: FixedLayoutDDP, group: GenerationGroup, rank: int, step: int = 0) -> None:
    """A step as the transaction runs it: begin, forward + backward, then the commit's collectives."""
    ddp.begin_step()
    ddp(batch(rank, step)).square().mean().backward()
    ddp.sync_gradients()
    ddp.sync_buffers()
    assert commit_vote(group, True, CPU)


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_buffers_are_rank_0s_at_the_commit_unless_broadcast_buffers_is_off(broadcast_buffers: bool) -> None:
    models = [bn_model() for _ in range(RANKS)]

    def body(group: GenerationGroup) -> dict[str, torch.Tensor]:
        options = parse_ddp_options({"broadcast_buffers": broadcast_buffers}, CPU)
        ddp = FixedLayoutDDP(models[group.rank], lambda: group, CPU, options=options)
        one_step(ddp, group, group.rank)
        return {name: buffer.clone() for name, buffer in ddp.module.named_buffers()}

    results = run_ranks(RANKS, body)
    means_equal = torch.equal(results[0]["1.running_mean"], results[1]["1.running_mean"])
    assert means_equal == broadcast_buffers
    own = bn_model()  # rank 0's own statistics: what DDP keeps on rank 0 either way
    own.train()
    own(batch(0))
    assert torch.equal(results[0]["1.running_mean"], own[1].running_mean)


def test_a_failed_step_puts_the_buffers_back_as_they_were_at_the_commit() -> None:
    """BatchNorm's kernels update the running statistics in place (without bumping their version
    counter); the failed step's forward changed them, the rollback puts the boundary's back."""
    models = [bn_model() for _ in range(RANKS)]

    def body(group: GenerationGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ddp = FixedLayoutDDP(models[group.rank], lambda: group, CPU)
        one_step(ddp, group, group.rank, 0)
        ddp.mark_commit_boundary()
        committed = ddp.module[1].running_var.clone()
        ddp.begin_step()
        ddp(batch(group.rank, 1)).square().mean().backward()  # the step then fails
        changed = ddp.module[1].running_var.clone()
        ddp.forget_failed_step()
        return committed, changed, ddp.module[1].running_var.clone()

    for committed, changed, rolled_back in run_ranks(RANKS, body):
        assert not torch.equal(changed, committed)
        assert torch.equal(rolled_back, committed)
        assert int(models[0][1].num_batches_tracked) == 1


@pytest.mark.parametrize("hook, wire", [(default_hooks.fp16_compress_hook, torch.float16),
                                        (default_hooks.bf16_compress_hook, torch.bfloat16),
                                        (default_hooks.allreduce_hook, None)])
def test_stock_comm_hooks_sum_as_torch_defines_them(hook, wire) -> None:  # type: ignore[no-untyped-def]
    """Each bucket cast to 16 bits and divided by the world, summed in 16 bits, copied back (the
    compress hooks); divided, then summed (allreduce_hook): the bits of DDP's hook, two ranks."""
    models = [bn_model() for _ in range(RANKS)]

    def body(group: GenerationGroup) -> list[torch.Tensor]:
        ddp = FixedLayoutDDP(models[group.rank], lambda: group, CPU)
        ddp.register_comm_hook(None, hook)
        ddp.begin_step()
        ddp(batch(group.rank)).square().mean().backward()
        return [p.grad.clone() for p in ddp.module.parameters()]

    results = run_ranks(RANKS, body)
    local = []
    for rank in range(RANKS):
        model = bn_model()
        model(batch(rank)).square().mean().backward()
        local.append([p.grad for p in model.parameters()])
    for index, (a, b) in enumerate(zip(*local, strict=True)):
        expected = (a.to(wire) / 2 + b.to(wire) / 2).float() if wire else a / 2 + b / 2
        assert torch.equal(results[0][index], expected), index
        assert torch.equal(results[1][index], expected), index


def test_other_comm_hooks_a_state_and_a_second_registration_are_refused() -> None:
    group = GenerationGroup(torch.distributed.HashStore(), "hooks", 1, 0, 1, "gloo", 20.0, CPU)
    ddp = FixedLayoutDDP(bn_model(), lambda: group, CPU, broadcast=False)
    with pytest.raises(ValueError, match="is not supported; undying runs torch's stock hooks"):
        ddp.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(ValueError, match="state must be None"):
        ddp.register_comm_hook(object(), default_hooks.fp16_compress_hook)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with pytest.raises(RuntimeError, match="only be registered once"):
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)


@pytest.mark.parametrize("kwargs, message", [
    ({"process_group": object()}, "process_group is not supported: undying averages over each generation's own group"),
    ({"device_mesh": object()}, "device_mesh is not supported"),
    ({"mixed_precision": object()}, "mixed_precision is not supported: DDP's experimental parameter casting"),
    ({"bucket_cap_mb_list": [1, 2]}, "bucket_cap_mb_list is not supported: per-bucket caps"),
    ({"check_reduction": True}, "check_reduction is not supported: deprecated by torch"),
    ({"device_ids": [0]}, r"device_ids=\[0\] is for a CUDA model \(as under DDP\); this rank's device is cpu"),
    ({"output_device": 0}, "output_device=0: the output stays on this rank's device, cpu"),
    ({"dim": 1}, "dim=1 is not supported"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a number of MiB > 0, got 0"),
    ({"find_unused_parameters": "yes"}, "find_unused_parameters must be True or False, got 'yes'"),
    ({"bucket_size": 3}, "'bucket_size' is not an argument of DistributedDataParallel; allowed: device_ids"),
])
def test_ddp_arguments_without_a_meaning_are_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        parse_ddp_options(kwargs, CPU)
    assert "\n" not in str(raised.value)


def test_ddp_arguments_with_a_meaning_are_taken() -> None:
    options = parse_ddp_options({"device_ids": None, "process_group": None, "find_unused_parameters": True,
                                 "static_graph": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 2,
                                 "broadcast_buffers": False, "init_sync": True}, CPU)
    assert options.find_unused_parameters and options.static_graph and options.gradient_as_bucket_view
    assert options.bucket_bytes == options.first_bucket_bytes == 2 * 1024 * 1024  # DDP: no 1 MiB first bucket then
    assert not options.broadcast_buffers and not options.init_sync_buffers  # DDP's broadcast_buffers=False
    forward_only = parse_ddp_options({"forward_sync_buffers": False}, CPU)  # torch 2.13's: still synced at wrap
    assert not forward_only.broadcast_buffers and forward_only.init_sync_buffers
    assert parse_ddp_options({}, CPU).first_bucket_bytes == 1024 * 1024


def test_find_unused_parameters_leaves_a_gradient_no_rank_produced_untouched() -> None:
    """As DDP's: a parameter no rank used keeps ``grad is None`` (AdamW then leaves it alone)."""
    models = [torch.nn.ModuleDict({"used": torch.nn.Linear(3, 1), "unused": torch.nn.Linear(3, 1)})
              for _ in range(RANKS)]

    def body(group: GenerationGroup) -> list[bool]:
        ddp = FixedLayoutDDP(models[group.rank], lambda: group, CPU, broadcast=False,
                             options=parse_ddp_options({"find_unused_parameters": True}, CPU))
        ddp.begin_step()
        ddp.module["used"](torch.ones(2, 3)).sum().backward()
        ddp.sync_gradients()
        return [p.grad is None for p in ddp.module.parameters()]

    assert run_ranks(RANKS, body) == [[False, False, True, True]] * RANKS


def test_gradient_as_bucket_view_makes_the_gradients_views_of_their_bucket() -> None:
    group = GenerationGroup(torch.distributed.HashStore(), "views", 1, 0, 1, "gloo", 20.0, CPU)
    ddp = FixedLayoutDDP(bn_model(), lambda: group, CPU, broadcast=False,
                         options=parse_ddp_options({"gradient_as_bucket_view": True}, CPU))
    ddp.begin_step()
    ddp(batch(0)).square().mean().backward()
    flats = {bucket.flat.untyped_storage().data_ptr() for bucket in ddp._buckets}
    assert all(p.grad.untyped_storage().data_ptr() in flats for p in ddp.module.parameters())


def test_sync_batchnorm_is_refused_on_cpu_and_with_a_group_of_its_own() -> None:
    group = GenerationGroup(torch.distributed.HashStore(), "sbn", 1, 0, 1, "gloo", 20.0, CPU)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(bn_model())
    with pytest.raises(ValueError, match=r"SyncBatchNorm \(1\) needs a GPU: torch has no CPU kernels"):
        FixedLayoutDDP(model, lambda: group, CPU, broadcast=False)
    with pytest.raises(ValueError, match=r"SyncBatchNorm \(1\) was given a process group"):
        from undying.runtime.ddp_options import check_sync_batchnorm
        model[1].process_group = object()  # type: ignore[assignment]
        check_sync_batchnorm(model, torch.device("cuda", 0))


def test_ddp_attributes_scripts_read() -> None:
    group = GenerationGroup(torch.distributed.HashStore(), "attrs", 1, 0, 1, "gloo", 20.0, CPU)
    plain = bn_model()
    ddp = FixedLayoutDDP(plain, lambda: group, CPU, broadcast=False)
    assert ddp.module is plain and ddp.device == CPU and ddp.device_ids is None and ddp.output_device is None
    assert ddp.require_backward_grad_sync and ddp.broadcast_buffers and not ddp.find_unused_parameters
    assert list(ddp.state_dict()) == [f"module.{key}" for key in plain.state_dict()]  # DDP's keys
    ddp.broadcast_buffers = False
    assert not ddp.options.broadcast_buffers
