"""The gradient an elastic (shrunk) world applies is the mean over the job's whole global batch,
in both ``accumulate`` and ``grow`` mode: two replicas covering four batch slots, in threads of
one process over a real gloo group, against the full-batch gradient computed directly. AdamW
hides a wrongly scaled gradient, so this is checked here, on the gradient itself."""

from __future__ import annotations

import pytest
import torch

from tests.unit.gloo_ranks import run_ranks
from undying.data import ResumableLoader
from undying.runtime.ddp import FixedLayoutDDP
from undying.runtime.pg import GenerationGroup

SLOTS, BATCH = 4, 3  # the fixed job: 4 ranks x 3 samples per step


class Points:
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(40, 5, generator=generator)
        self.y = torch.randn(40, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 1)


def full_batch_gradient(dataset: Points) -> torch.Tensor:
    """The gradient of the mean loss over step 0's 12 samples, as one process computes it."""
    loader = ResumableLoader(dataset, BATCH * SLOTS, 0, 0, 1)
    reference = model()
    x, y = next(loader)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    return reference.weight.grad.clone()


@pytest.mark.parametrize("mode", ["accumulate", "grow"])
def test_two_replicas_covering_four_slots_apply_the_full_batch_mean(mode: str) -> None:
    dataset = Points()
    models = [model(), model()]  # built here: seeding the global RNG from two threads would race

    def replica(group: GenerationGroup) -> torch.Tensor:
        index = group.rank
        wrapped = FixedLayoutDDP(models[index], lambda: group, torch.device("cpu"), broadcast=False)
        loader = ResumableLoader(dataset, BATCH, 0, index, SLOTS)
        loader.set_replicas(index, 2, mode)
        wrapped.set_replica_share(loader.slot_count if mode == "grow" else 1, SLOTS)
        for x, y in loader.step_batches():
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
        wrapped.sync_gradients()
        return wrapped.module.weight.grad.clone()

    gradients = dict(enumerate(run_ranks(2, replica)))
    expected = full_batch_gradient(dataset)
    assert torch.allclose(gradients[0], expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(gradients[0], gradients[1])
