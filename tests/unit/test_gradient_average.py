"""DDP's gradient semantics on real gloo groups: ``backward()`` returns with the gradients averaged
over the ranks (so clipping sees the global batch's), overlapped with the backward pass in a fixed
bucket layout; ``no_sync()`` accumulates; every rank issues the same collectives whatever failed.

Ranks are threads of this process, each with its own ``GenerationGroup`` (gloo over a HashStore).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.unit.gloo_ranks import run_ranks
from undying.runtime.ddp import FixedLayoutDDP, commit_vote
from undying.runtime.ddp_layout import complete_order, initial_layout, rebuilt_layout
from undying.runtime.ddp_options import DDPOptions
from undying.runtime.pg import GenerationGroup

RANKS = 2


def deep_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1))


def rank_batch(rank: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * rank + micro))


def local_gradients(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """What one rank's backward passes accumulate, without any averaging."""
    model.zero_grad(set_to_none=True)
    for batch in batches:
        model(batch).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def on_ranks(body: Callable[[int, GenerationGroup], Any]) -> dict[int, Any]:
    """``body(rank, group)`` on RANKS threads with a real gloo group (tests/unit/gloo_ranks.py)."""
    return dict(enumerate(run_ranks(RANKS, lambda group: body(group.rank, group))))


def expected_mean(batches_of: Callable[[int], list[torch.Tensor]]) -> list[torch.Tensor]:
    per_rank = [local_gradients(deep_model(), batches_of(rank)) for rank in range(RANKS)]
    return [sum(grads) / RANKS for grads in zip(*per_rank, strict=True)]  # type: ignore[misc]


def test_backward_returns_averaged_gradients_overlapped_with_the_backward_pass() -> None:
    """Buckets of one parameter each: the first all-reduce starts while earlier layers' gradients
    do not exist yet, and the average equals the plain mean bitwise (two ranks: a + b is exact)."""
    models = [deep_model() for _ in range(RANKS)]  # seeded here: not from two threads at once

    def body(rank: int, group: GenerationGroup) -> tuple[list[torch.Tensor], list[bool]]:
        model = models[rank]
        ddp = FixedLayoutDDP(model, lambda: group, torch.device("cpu"), broadcast=False,
                             options=DDPOptions(first_bucket_bytes=1, bucket_bytes=1))
        # Past the job's first average (one bucket, DDP's first layout): buckets in gradient order.
        ddp.bucket_order.load_state_dict({"ready_order": list(reversed(range(len(list(model.parameters())))))})
        missing_at_start: list[bool] = []
        start = group.start_allreduce

        def recording_start(tensor: torch.Tensor) -> Any:
            missing_at_start.append(any(p.grad is None for p in model.parameters()))
            return start(tensor)

        group.start_allreduce = recording_start  # type: ignore[method-assign]
        ddp.begin_step()
        ddp(rank_batch(rank)).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()], missing_at_start

    results = on_ranks(body)
    expected = expected_mean(lambda rank: [rank_batch(rank)])
    for rank in range(RANKS):
        grads, missing_at_start = results[rank]
        assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True)), f"rank {rank}"
        assert len(missing_at_start) == len(list(models[rank].parameters()))  # one bucket each
        assert missing_at_start[0], "the first bucket's all-reduce must start during the backward pass"


def test_no_sync_accumulates_and_the_last_backward_averages() -> None:
    models = [deep_model() for _ in range(RANKS)]

    def body(rank: int, group: GenerationGroup) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ddp = FixedLayoutDDP(models[rank], lambda: group, torch.device("cpu"), broadcast=False)
        ddp.begin_step()
        with ddp.no_sync():
            ddp(rank_batch(rank, 0)).square().mean().backward()
        after_first = [p.grad.clone() for p in models[rank].parameters()]
        ddp(rank_batch(rank, 1)).square().mean().backward()
        return after_first, [p.grad.clone() for p in models[rank].parameters()]

    results = on_ranks(body)
    expected = expected_mean(lambda rank: [rank_batch(rank, 0), rank_batch(rank, 1)])
    for rank in range(RANKS):
        after_first, final = results[rank]
        local = local_gradients(deep_model(), [rank_batch(rank, 0)])
        assert all(torch.equal(g, e) for g, e in zip(after_first, local, strict=True)), "no_sync averaged"
        assert all(torch.allclose(g, e, rtol=1e-6, atol=1e-7) for g, e in zip(final, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def test_require_backward_grad_sync_set_directly_accumulates_as_under_ddp() -> None:
    """nanoGPT's accumulation: ``model.require_backward_grad_sync = (micro == last)`` before each
    micro-batch's forward; only the last backward averages, and the result is no_sync's."""
    models = [deep_model() for _ in range(RANKS)]

    def body(rank: int, group: GenerationGroup) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ddp = FixedLayoutDDP(models[rank], lambda: group, torch.device("cpu"), broadcast=False)
        ddp.begin_step()
        grads = []
        for micro in range(3):
            ddp.require_backward_grad_sync = micro == 2
            ddp(rank_batch(rank, micro)).square().mean().backward()
            grads.append([p.grad.clone() for p in models[rank].parameters()])
        return grads[1], grads[2]

    results = on_ranks(body)
    expected = expected_mean(lambda rank: [rank_batch(rank, micro) for micro in range(3)])
    for rank in range(RANKS):
        before_last, final = results[rank]
        local = local_gradients(deep_model(), [rank_batch(rank, 0), rank_batch(rank, 1)])
        assert all(torch.equal(g, e) for g, e in zip(before_last, local, strict=True)), "averaged too early"
        assert all(torch.allclose(g, e, rtol=1e-6, atol=1e-7) for g, e in zip(final, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def test_no_sync_toggles_require_backward_grad_sync_and_the_forward_decides() -> None:
    """As DDP's: ``no_sync()`` sets the attribute to False and puts it back; a forward run inside
    ``no_sync()`` and its backward outside do not average (DDP arms its reducer in the forward)."""
    models = [deep_model() for _ in range(RANKS)]

    def body(rank: int, group: GenerationGroup) -> tuple[list[bool], list[torch.Tensor]]:
        ddp = FixedLayoutDDP(models[rank], lambda: group, torch.device("cpu"), broadcast=False)
        seen = [ddp.require_backward_grad_sync]
        ddp.begin_step()
        with ddp.no_sync():
            seen.append(ddp.require_backward_grad_sync)
            loss = ddp(rank_batch(rank, 0)).square().mean()
        seen.append(ddp.require_backward_grad_sync)
        loss.backward()  # outside no_sync, but its forward was inside: local
        return seen, [p.grad.clone() for p in models[rank].parameters()]

    results = on_ranks(body)
    for rank in range(RANKS):
        seen, grads = results[rank]
        assert seen == [True, False, True]
        local = local_gradients(deep_model(), [rank_batch(rank, 0)])
        assert all(torch.equal(g, e) for g, e in zip(grads, local, strict=True))


def test_a_backward_before_the_last_micro_batch_does_not_average() -> None:
    """``ready_to_sync`` false (the step's loader has micro-batches left): gradients stay local until
    ``sync_gradients``, which averages them the same way."""
    models = [deep_model() for _ in range(RANKS)]

    def body(rank: int, group: GenerationGroup) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ddp = FixedLayoutDDP(models[rank], lambda: group, torch.device("cpu"), broadcast=False,
                             ready_to_sync=lambda: False)
        ddp.begin_step()
        ddp(rank_batch(rank)).square().mean().backward()
        local = [p.grad.clone() for p in models[rank].parameters()]
        ddp.sync_gradients()
        return local, [p.grad.clone() for p in models[rank].parameters()]

    results = on_ranks(body)
    expected = expected_mean(lambda rank: [rank_batch(rank)])
    for rank in range(RANKS):
        local, final = results[rank]
        assert all(torch.equal(g, e) for g, e in zip(local, local_gradients(deep_model(), [rank_batch(rank)]),
                                                     strict=True))
        assert all(torch.equal(g, e) for g, e in zip(final, expected, strict=True))


def test_several_averaged_backward_passes_each_average_into_grad_as_under_ddp() -> None:
    """DDP allows it: each averaged backward averages what ``.grad`` holds, so the step ends with the
    first backward's average plus the second's. Before the second, every rank agrees to go on."""
    models = [deep_model() for _ in range(RANKS)]

    def body(rank: int, group: GenerationGroup) -> tuple[list[torch.Tensor], int]:
        agreed = []

        def agree() -> bool:
            agreed.append(True)
            return commit_vote(group, True, torch.device("cpu"))

        ddp = FixedLayoutDDP(models[rank], lambda: group, torch.device("cpu"), broadcast=False,
                             before_extra_round=agree)
        ddp.begin_step()
        ddp(rank_batch(rank, 0)).square().mean().backward()
        ddp(rank_batch(rank, 1)).square().mean().backward()
        ddp.sync_gradients()  # nothing left to average: no collective
        assert commit_vote(group, True, torch.device("cpu"))
        return [p.grad.clone() for p in models[rank].parameters()], len(agreed)

    results = on_ranks(body)
    first, second = expected_mean(lambda rank: [rank_batch(rank, 0)]), expected_mean(lambda rank: [rank_batch(rank, 1)])
    for rank in range(RANKS):
        grads, agreements = results[rank]
        assert agreements == 1
        assert all(torch.allclose(g, a + b, rtol=1e-6, atol=1e-7) for g, a, b in zip(grads, first, second, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0], strict=True))


def test_a_rank_that_gives_up_between_two_averaged_backwards_is_heard_before_the_second() -> None:
    """Rank 1 raises after the first averaged backward (retry): its commit (no round left, its no
    vote) pairs with rank 0's agreement before the second round; both learn the step is refused
    and no collective is left unmatched."""
    models = [deep_model() for _ in range(RANKS)]

    def body(rank: int, group: GenerationGroup) -> tuple[bool, bool]:
        ddp = FixedLayoutDDP(models[rank], lambda: group, torch.device("cpu"), broadcast=False,
                             before_extra_round=lambda: commit_vote(group, True, torch.device("cpu")))
        ddp.begin_step()
        ddp(rank_batch(rank, 0)).square().mean().backward()
        if rank == 1:
            ddp.sync_gradients()
            return commit_vote(group, False, torch.device("cpu")), False
        before = [p.grad.clone() for p in models[rank].parameters()]
        ddp(rank_batch(rank, 1)).square().mean().backward()  # the agreement says no: accumulates locally
        local = local_gradients(deep_model(), [rank_batch(rank, 1)])
        kept_local = all(torch.equal(g, b + extra) for g, b, extra in
                         zip([p.grad for p in models[rank].parameters()], before, local, strict=True))
        return ddp._refused, kept_local

    assert on_ranks(body) == {0: (True, True), 1: (False, False)}


def test_in_accumulate_mode_a_second_round_still_averages_over_the_slots() -> None:
    """A shrunk job (``accumulate``): two replicas over four slots, weight one each. A second
    averaged backward sums every replica's ``.grad``, which holds the first average once per replica:
    the correction adds the two missing copies, so the step ends at first average + second average."""
    models = [deep_model() for _ in range(RANKS)]

    def body(rank: int, group: GenerationGroup) -> list[torch.Tensor]:
        ddp = FixedLayoutDDP(models[rank], lambda: group, torch.device("cpu"), broadcast=False,
                             before_extra_round=lambda: commit_vote(group, True, torch.device("cpu")))
        ddp.set_replica_share(1, 4, weights_total=2)
        ddp.begin_step()
        with ddp.no_sync():  # this replica's first slot
            ddp(rank_batch(rank, 0)).square().mean().backward()
        ddp(rank_batch(rank + 2, 0)).square().mean().backward()  # its second slot: averages
        ddp(rank_batch(rank, 1)).square().mean().backward()  # a second averaged backward
        return [p.grad.clone() for p in models[rank].parameters()]

    results = on_ranks(body)
    slots = [local_gradients(deep_model(), [rank_batch(slot, 0)]) for slot in range(4)]
    first = [sum(grads) / 4 for grads in zip(*slots, strict=True)]
    seconds = [local_gradients(deep_model(), [rank_batch(rank, 1)]) for rank in range(RANKS)]
    second = [sum(grads) / 4 for grads in zip(*seconds, strict=True)]
    for rank in range(RANKS):
        assert all(torch.allclose(g, a + b, rtol=1e-5, atol=1e-7)
                   for g, a, b in zip(results[rank], first, second, strict=True))


def test_a_rank_that_failed_before_its_backward_still_matches_its_peers_collectives() -> None:
    """Rank 0 averages in backward and votes yes; rank 1 raised before its backward: it completes
    the average with zeros and votes no. Nobody hangs and both see the step refused."""
    models = [deep_model() for _ in range(RANKS)]

    def body(rank: int, group: GenerationGroup) -> bool:
        ddp = FixedLayoutDDP(models[rank], lambda: group, torch.device("cpu"), broadcast=False)
        ddp.begin_step()
        if rank == 0:
            ddp(rank_batch(rank)).square().mean().backward()
        ddp.sync_gradients()
        return commit_vote(group, rank == 0, torch.device("cpu"))

    assert on_ranks(body) == {0: False, 1: False}


def test_the_job_first_average_uses_ddp_first_layout_then_the_recorded_gradient_order() -> None:
    """DDP's two layouts: its first averaged backward in one bucket, parameters in registration
    order; the later ones rebuilt from the order that backward produced them in. The order is job
    state (``bucket_order``): recorded in the first round (rank 0's), then every round uses it."""
    models = [deep_model() for _ in range(RANKS)]

    def body(rank: int, group: GenerationGroup) -> tuple[list[list[int]], list[int] | None, list[list[int]]]:
        model = models[rank]
        ddp = FixedLayoutDDP(model, lambda: group, torch.device("cpu"), broadcast=False,
                             options=DDPOptions(first_bucket_bytes=8 * 8 * 4, bucket_bytes=8 * 8 * 4))
        index = {id(p): i for i, p in enumerate(model.parameters())}
        first = [[index[id(p)] for p in bucket.params] for bucket in ddp._buckets]
        ddp.begin_step()
        ddp(rank_batch(rank)).square().mean().backward()
        ddp.begin_step()
        ddp(rank_batch(rank)).square().mean().backward()
        return first, ddp.bucket_order.ready_order, [[index[id(p)] for p in bucket.params] for bucket in ddp._buckets]

    params = list(deep_model().parameters())
    for first, order, later in on_ranks(body).values():
        assert first == [list(range(len(params)))]
        assert order is not None and sorted(order) == list(range(len(params)))
        assert later == rebuilt_layout(params, order, 8 * 8 * 4, 8 * 8 * 4)
        assert [i for bucket in later for i in bucket] == order
    assert initial_layout(params, False, 1, 1) == [list(range(len(params)))]
    assert complete_order([3, 1], 4) == [0, 2, 3, 1]  # without a gradient: first, as DDP marks them


def test_a_compiled_model_trains_compiled_and_keeps_plain_state_keys() -> None:
    """torch.compile'd: forward goes through the compiled module, gradients are still averaged in
    backward, and the state (checkpoints, repair) has the plain module's keys."""
    plain = deep_model()
    compiled = torch.compile(plain, backend="aot_eager")
    group = GenerationGroup(torch.distributed.HashStore(), "compiled", 1, 0, 1, "gloo", 20.0, torch.device("cpu"))
    ddp = FixedLayoutDDP(compiled, lambda: group, torch.device("cpu"), broadcast=False)
    assert ddp.module is plain
    assert list(ddp.module.state_dict()) == list(deep_model().state_dict())
    ddp.begin_step()
    ddp(rank_batch(0)).square().mean().backward()
    expected = local_gradients(deep_model(), [rank_batch(0)])
    assert all(torch.allclose(p.grad, e) for p, e in zip(plain.parameters(), expected, strict=True))
    assert ddp._rounds == 1 and not ddp._round_open, "the backward of the compiled model must have run the average"


def test_a_model_wrapped_twice_is_refused() -> None:
    group = GenerationGroup(torch.distributed.HashStore(), "twice", 1, 0, 1, "gloo", 20.0, torch.device("cpu"))
    ddp = FixedLayoutDDP(deep_model(), lambda: group, torch.device("cpu"), broadcast=False)
    with pytest.raises(ValueError, match="already wrapped by FixedLayoutDDP"):
        FixedLayoutDDP(ddp, lambda: group, torch.device("cpu"), broadcast=False)
