"""A bucket's gather is DDP's arithmetic whichever way each gradient takes into it: a large one
multiplied into its place by a call of its own, the small ones copied together and scaled by span.
"""

from __future__ import annotations

import pytest
import torch

from undying.runtime.ddp_buckets import FUSED_MIN_ELEMENTS, Bucket, CommHook, copied_spans

BIG = FUSED_MIN_ELEMENTS["cpu"]


def mixed_params() -> list[torch.nn.Parameter]:
    """Small and large parameters interleaved, as in a transformer (norms and biases between matrices)."""
    shapes = [(7,), (BIG + 3,), (5, 3), (4,), (2, BIG), (9,)]
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]


def test_spans_cover_each_run_of_copied_parameters_end_to_end() -> None:
    assert copied_spans([7, 100, 15, 4, 200, 9], [False, True, False, False, True, False]) == \
        [(0, 7), (107, 126), (326, 335)]
    assert copied_spans([3, 4], [True, True]) == []
    assert copied_spans([3, 0, 4], [False, False, False]) == [(0, 7)]


@pytest.mark.parametrize(("weight", "divisor"), [(1, 4), (1, 3), (2, 3), (1, 1)])
def test_gather_puts_in_the_bits_of_ddps_product_per_gradient(weight: int, divisor: int) -> None:
    """DDP's reducer: ``mul_out(bucket_view, grad, weight / divisor)`` for each gradient, zeros for a
    parameter without one. 1/3 is not exact in float32, so any second rounding would show."""
    params = mixed_params()
    generator = torch.Generator().manual_seed(7)
    for index, param in enumerate(params):
        if index != 3:  # one parameter has no gradient this step
            param.grad = torch.randn(param.shape, generator=generator) * 1e3
    bucket = Bucket(params, torch.device("cpu"))
    assert bucket.fused == [False, True, False, False, True, False]
    bucket.flat.fill_(float("nan"))  # whatever a slot held before
    bucket.gather(CommHook.NONE, weight, divisor)
    for param, view in zip(params, bucket.views, strict=True):
        expected = torch.zeros_like(param) if param.grad is None else torch.mul(param.grad, weight / divisor)
        assert torch.equal(view, expected)


def test_a_stock_hook_gathers_the_gradients_times_the_weight_only() -> None:
    """With a hook the bucket is divided by the hook (``allreduce_hook``), not on the way in."""
    params = mixed_params()
    for param in params:
        param.grad = torch.full(param.shape, 3.0)
    bucket = Bucket(params, torch.device("cpu"))
    bucket.gather(CommHook.ALLREDUCE, 2, 4)
    assert torch.equal(bucket.flat, torch.full_like(bucket.flat, 6.0))
