"""Every kind of torch object a training loop holds rolls back with a failed step: each LR scheduler
of torch.optim.lr_scheduler (ReduceLROnPlateau, SequentialLR, ChainedScheduler, OneCycleLR,
CyclicLR, ... and swa_utils' SWALR), a GradScaler enabled or not, and an AveragedModel (SWA, or an
EMA through ``get_ema_multi_avg_fn``). Each is found by ``ft.steps()``'s search (no ``register``),
a step fails after the loop moved it, the step is rolled back and re-run, and the loop ends in the
state of a twin that never failed: parameters, optimizer state and hyperparameters, the object's own
state_dict."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as sched
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn

from undying.runtime.optim import CommitOptimizer
from undying.runtime.training_state import TrainingState

STEPS = 9
# A failure at the first step (before any commit), two in a row at one step, one late.
FAILURES = {0: 1, 3: 2, 7: 1}


@dataclass
class Loop:
    """A model, an SGD with momentum (CyclicLR and OneCycleLR cycle it) behind a CommitOptimizer
    whose vote the test decides, and the TrainingState of a worker."""

    model: torch.nn.Module
    inner: torch.optim.Optimizer
    opt: CommitOptimizer
    state: TrainingState
    commits: list[bool] = field(default_factory=lambda: [True])


def make_loop() -> Loop:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    commits = [True]
    opt = CommitOptimizer(inner, lambda: commits[0], lambda phase: None)
    state = TrainingState(holds_state=True)
    state.optimizers.append(opt)
    return Loop(model, inner, opt, state, commits)


# Each kind: how to build it on the wrapped optimizer, and how the loop steps it after opt.step().
Kind = tuple[Callable[[CommitOptimizer], Any], Callable[[Any, float], None]]


def plain_step(scheduler: Any, loss: float) -> None:
    scheduler.step()


SCHEDULERS: dict[str, Kind] = {
    "LambdaLR": (lambda opt: sched.LambdaLR(opt, lambda step: 1 / (step + 1)), plain_step),
    "MultiplicativeLR": (lambda opt: sched.MultiplicativeLR(opt, lambda step: 0.9), plain_step),
    "StepLR": (lambda opt: sched.StepLR(opt, step_size=2, gamma=0.5), plain_step),
    "MultiStepLR": (lambda opt: sched.MultiStepLR(opt, milestones=[2, 4, 7], gamma=0.5), plain_step),
    "ConstantLR": (lambda opt: sched.ConstantLR(opt, factor=0.5, total_iters=4), plain_step),
    "LinearLR": (lambda opt: sched.LinearLR(opt, start_factor=0.2, total_iters=6), plain_step),
    "ExponentialLR": (lambda opt: sched.ExponentialLR(opt, gamma=0.8), plain_step),
    "PolynomialLR": (lambda opt: sched.PolynomialLR(opt, total_iters=8, power=2.0), plain_step),
    "CosineAnnealingLR": (lambda opt: sched.CosineAnnealingLR(opt, T_max=5), plain_step),
    "CosineAnnealingWarmRestarts": (lambda opt: sched.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2),
                                    plain_step),
    "SequentialLR": (lambda opt: sched.SequentialLR(
        opt, [sched.LinearLR(opt, start_factor=0.1, total_iters=3), sched.ExponentialLR(opt, gamma=0.7)],
        milestones=[3]), plain_step),
    "ChainedScheduler": (lambda opt: sched.ChainedScheduler(
        [sched.ConstantLR(opt, factor=0.5, total_iters=3), sched.ExponentialLR(opt, gamma=0.9)]), plain_step),
    # A loss that never improves: the rate is cut every other step.
    "ReduceLROnPlateau": (lambda opt: sched.ReduceLROnPlateau(opt, patience=1, factor=0.5),
                          lambda scheduler, loss: scheduler.step(1.0)),
    "CyclicLR": (lambda opt: sched.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2,
                                            mode="exp_range", gamma=0.9), plain_step),
    "OneCycleLR": (lambda opt: sched.OneCycleLR(opt, max_lr=0.2, total_steps=STEPS + 2), plain_step),
    "SWALR": (lambda opt: SWALR(opt, swa_lr=0.05, anneal_epochs=3, anneal_strategy="cos"), plain_step),
}


def comparable(value: Any) -> Any:
    """A state_dict as plain values: tensors as lists, functions by name, NaN as a string."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(key): comparable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [comparable(item) for item in value]
    if callable(value):
        return getattr(value, "__qualname__", type(value).__qualname__)
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def train(loop: Loop, step_body: Callable[[Loop, int], None], failures: dict[int, int]) -> None:
    """``STEPS`` committed steps; the steps in ``failures`` fail that many times first: the body runs
    in full (the loop's objects move on), no rank applies the update, and the state is rolled back."""
    left = dict(failures)
    loop.state.mark_commit_boundary()
    step = 0
    while step < STEPS:
        fails = left.get(step, 0) > 0
        loop.commits[0] = not fails
        step_body(loop, step)
        if fails:
            left[step] -= 1
            loop.state.forget_failed_step()
            loop.state.roll_back_step_in_flight()
            continue
        loop.state.mark_commit_boundary()
        step += 1


def final_state(loop: Loop, objects: dict[str, Any]) -> dict[str, Any]:
    """What the twins must agree on, as plain values: parameters, optimizer state and
    hyperparameters, and each loop object's state_dict."""
    return {"params": comparable(list(loop.model.parameters())), "optimizer": comparable(loop.opt.state_dict()),
            **{name: comparable(obj.state_dict()) for name, obj in objects.items()}}


def backward(loop: Loop) -> torch.Tensor:
    loss = loop.model(torch.ones(3, 4)).pow(2).sum()
    loss.backward()
    return loss


def scheduler_run(kind: str, failures: dict[int, int]) -> dict[str, Any]:
    build, step_scheduler = SCHEDULERS[kind]
    loop = make_loop()
    scheduler = build(loop.opt)
    assert loop.state.register_loop_state() == []
    assert list(loop.state.statefuls.values()) == [scheduler], "found without register"

    def body(loop: Loop, step: int) -> None:
        loss = backward(loop)
        loop.opt.step()
        step_scheduler(scheduler, loss.item())
        loop.opt.zero_grad()

    train(loop, body, failures)
    return final_state(loop, {kind: scheduler})


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_every_lr_scheduler_rolls_back_with_a_failed_step(kind: str) -> None:
    assert scheduler_run(kind, FAILURES) == scheduler_run(kind, {})


def scaler_run(enabled: bool, failures: dict[int, int]) -> dict[str, Any]:
    loop = make_loop()
    scaler = torch.amp.GradScaler("cpu", enabled=enabled, init_scale=2.0**8, growth_interval=2)
    assert loop.state.register_loop_state() == []
    assert loop.state.statefuls == {"grad_scaler": scaler}

    def body(loop: Loop, step: int) -> None:
        scaler.scale(loop.model(torch.ones(3, 4)).pow(2).sum()).backward()
        scaler.unscale_(loop.opt)
        torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 1.0)
        scaler.step(loop.opt)
        scaler.update()
        loop.opt.zero_grad()

    train(loop, body, failures)
    return final_state(loop, {"scaler": scaler}) | {"scale": scaler.get_scale()}


@pytest.mark.parametrize("enabled", [False, True])
def test_a_grad_scaler_enabled_or_not_rolls_back(enabled: bool) -> None:
    """``GradScaler(enabled=False)`` is what fp32 and bf16 scripts build (nanoGPT:
    ``GradScaler(enabled=(dtype == 'float16'))``); its rollback must not need the memory an enabled
    one keeps of the step. Each step unscales for clipping, as such scripts do."""
    assert scaler_run(enabled, FAILURES) == scaler_run(enabled, {})


def averaged_run(average: str, failures: dict[int, int]) -> dict[str, Any]:
    swa_start = 4
    loop = make_loop()
    objects: dict[str, Any] = {}
    if average == "swa":
        objects["averaged_model"] = AveragedModel(loop.model)
        objects["lr_scheduler.0.CosineAnnealingLR"] = sched.CosineAnnealingLR(loop.opt, T_max=STEPS)
        objects["lr_scheduler.0.SWALR"] = SWALR(loop.opt, swa_lr=0.05, anneal_epochs=2)
    else:
        objects["averaged_model"] = AveragedModel(loop.model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    assert loop.state.register_loop_state() == []
    assert loop.state.statefuls == objects, "found without register"
    averaged = objects["averaged_model"]

    def body(loop: Loop, step: int) -> None:
        backward(loop)
        loop.opt.step()
        loop.opt.zero_grad()
        if average == "ema":
            averaged.update_parameters(loop.model)
        elif step >= swa_start:
            averaged.update_parameters(loop.model)
            objects["lr_scheduler.0.SWALR"].step()
        else:
            objects["lr_scheduler.0.CosineAnnealingLR"].step()

    train(loop, body, failures)
    assert int(averaged.n_averaged) > 0
    return final_state(loop, objects)


@pytest.mark.parametrize("average", ["swa", "ema"])
def test_an_averaged_model_rolls_back_with_a_failed_step(average: str) -> None:
    """SWA (an AveragedModel with a SWALR after ``swa_start``) and an EMA (``get_ema_multi_avg_fn``):
    the average taken in a failed step is undone, with its ``n_averaged``; both found without
    register."""
    assert averaged_run(average, FAILURES) == averaged_run(average, {})


def test_two_averaged_models_are_left_to_register() -> None:
    loop = make_loop()
    ema = AveragedModel(loop.model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    swa = AveragedModel(loop.model)
    assert loop.state.register_loop_state() == ["2 x averaged_model"]
    loop.state.register("ema", ema)
    assert loop.state.register_loop_state() == []
    assert loop.state.statefuls == {"ema": ema, "averaged_model": swa}
