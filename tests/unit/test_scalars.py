"""``ft.log``'s scalars, checked in the worker: any real number or one-element tensor under a name
that can be part of a metric name; anything else is one clear error naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from undying.events import heartbeat_scalars
from undying.runtime.scalars import MAX_SCALARS, checked_scalars


def test_numbers_and_one_element_tensors_become_floats():
    scalars = checked_scalars({"loss": torch.tensor(2.5), "lr": 1e-3, "tokens_per_s": np.float32(1200.0),
                               "step_count": 7}, logged=())
    assert scalars == {"loss": 2.5, "lr": 1e-3, "tokens_per_s": 1200.0, "step_count": 7.0}
    assert all(type(value) is float for value in scalars.values())


@pytest.mark.parametrize(("values", "message"), [
    ({"phase": 1.0}, "scalar name 'phase'"),
    ({"grad-norm": 1.0}, "scalar name 'grad-norm'"),
    ({"loss": "low"}, "loss: allowed a real number or a one-element tensor (got str 'low')"),
    ({"loss": torch.ones(3)}, "loss: allowed a real number or a one-element tensor (got Tensor"),
    ({"flag": True}, "flag: allowed a real number"),
])
def test_bad_names_and_values_are_one_clear_error(values, message):
    with pytest.raises(ValueError) as error:
        checked_scalars(values, logged=())
    assert message in str(error.value) and str(error.value).startswith("ft.log: ")


def test_none_is_no_news():
    assert checked_scalars({"loss": None, "lr": 0.5}, logged=("loss",)) == {"lr": 0.5}


def test_the_number_of_names_is_bounded():
    logged = [f"s{index}" for index in range(MAX_SCALARS)]
    assert checked_scalars({"s0": 1.0}, logged) == {"s0": 1.0}
    with pytest.raises(ValueError, match=f"at most {MAX_SCALARS} scalar names"):
        checked_scalars({"one_more": 1.0}, logged)


def test_a_heartbeat_event_carries_the_scalars_beside_its_phase():
    assert heartbeat_scalars({"phase": "computing", "loss": 2.0, "lr": 1e-3}) == {"loss": 2.0, "lr": 1e-3}
