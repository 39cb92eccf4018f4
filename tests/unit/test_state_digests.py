"""The per-rank state digests (``state_digests: true``): equal only for bitwise-equal state, whatever
order a dict was built in; and what TrainingState.digests covers."""

from __future__ import annotations

import torch

from undying.runtime.training_state import TrainingState
from undying.utils import tree_sha256


def adam_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_equal_state_has_equal_digests_whatever_the_key_order() -> None:
    state = adam_state()
    reordered = {"optimizer": state["optimizer"], "model": dict(reversed(list(state["model"].items())))}
    assert tree_sha256(state) == tree_sha256(reordered) == tree_sha256(adam_state())


def test_one_flipped_bit_dtype_shape_or_hyperparameter_changes_the_digest() -> None:
    state = adam_state()
    before = tree_sha256(state)
    weight = state["model"]["weight"]
    bits = weight.view(torch.int32)
    bits[0, 0] ^= 1  # the last bit of one float's mantissa
    assert tree_sha256(state) != before
    bits[0, 0] ^= 1
    assert tree_sha256(state) == before
    assert tree_sha256({**state, "model": {**state["model"], "weight": weight.double()}}) != before
    assert tree_sha256({**state, "model": {**state["model"], "weight": weight.reshape(-1)}}) != before
    state["optimizer"]["param_groups"][0]["lr"] = 2e-2
    assert tree_sha256(state) != before


def test_a_list_and_a_tuple_of_the_same_items_differ() -> None:
    assert tree_sha256([1, 2]) != tree_sha256((1, 2)) != tree_sha256([[1], 2])


def test_training_state_digests_cover_parameters_optimizer_and_rng() -> None:
    from undying.runtime.optim import CommitOptimizer

    class Plain(torch.nn.Module):  # what the state reads of a wrapped model: ``module``
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(3, 2)

    state = TrainingState(holds_state=True)
    model = Plain()
    inner = torch.optim.SGD(model.module.parameters(), lr=0.1, momentum=0.9)
    state.models.append(model)  # type: ignore[arg-type]
    state.optimizers.append(CommitOptimizer(inner, lambda: True, lambda phase: None))
    first = state.digests()
    assert set(first) == {"params_sha256", "optimizer_sha256", "rng_sha256"}
    model.module(torch.randn(2, 3)).sum().backward()  # draws from the RNG
    inner.step()
    second = state.digests()
    assert all(first[key] != second[key] for key in first), (first, second)
    assert state.digests() == second
