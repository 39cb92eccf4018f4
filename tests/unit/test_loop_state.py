"""The loop's own state (LR schedulers, GradScaler, EMA, counters) is part of the step transaction:
captured at each commit boundary, wound back when a step fails, and what leaves the process is the
boundary's. The wrapped optimizer is an Optimizer to LR schedulers, and its commit survives them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR, LinearLR, SequentialLR

from undying.runtime.optim import CommitOptimizer, search_loop_state
from undying.runtime.training_state import TrainingState


def loop_state(optimizers: list[CommitOptimizer], registered: list[object]) -> tuple[dict[str, Any], list[str]]:
    """The schedulers and GradScalers ``search_loop_state`` finds: (by name, ambiguous)."""
    search = search_loop_state(optimizers, registered, ())
    return search.found, search.ambiguous


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


class Ema:
    """Keeps the tensors it is given, as many EMA implementations do."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    def update(self, model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            self.shadow[name].mul_(0.5).add_(p.detach(), alpha=0.5)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = state["shadow"]


class Loop:
    """A model, an AdamW behind a CommitOptimizer whose vote the test decides, and a TrainingState."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2)
        self.commits = True
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.opt = CommitOptimizer(self.inner, lambda: self.commits, lambda phase: None)
        self.state = TrainingState(holds_state=True)
        self.state.optimizers.append(self.opt)

    def backward(self) -> None:
        self.model(torch.ones(3, 4)).sum().backward()

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def warmup(step: int) -> float:
    return (step + 1) / 10


def test_the_wrapped_optimizer_is_an_optimizer_to_lr_schedulers() -> None:
    loop = Loop()
    assert isinstance(loop.opt, torch.optim.Optimizer)
    scheduler = LambdaLR(loop.opt, warmup)
    assert loop.opt.param_groups is loop.inner.param_groups and loop.opt.state is loop.inner.state
    assert loop.opt.defaults is loop.inner.defaults
    assert loop.inner.param_groups[0]["lr"] == pytest.approx(1e-3)
    loop.backward()
    loop.opt.step()
    scheduler.step()
    assert loop.inner.state[next(loop.model.parameters())]["step"] == 1
    assert loop.inner.param_groups[0]["lr"] == pytest.approx(2e-3)


def test_a_step_that_does_not_commit_advances_nothing_even_through_a_scheduler() -> None:
    loop = Loop()
    scheduler = LambdaLR(loop.opt, warmup)  # replaces opt.step with its counting wrapper
    loop.state.register("scheduler", scheduler)
    loop.state.mark_commit_boundary()
    before = loop.params()
    loop.commits = False
    loop.backward()
    assert loop.opt.step() is None
    scheduler.step()  # the loop steps its scheduler whether or not the step committed
    assert all(torch.equal(a, b) for a, b in zip(before, loop.params(), strict=True))
    assert not loop.inner.state, "the inner optimizer must not have stepped"
    loop.state.roll_back_step_in_flight()
    assert scheduler.last_epoch == 0 and scheduler.get_last_lr() == [pytest.approx(1e-3)]
    assert loop.inner.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_registered_state_is_captured_at_the_boundary_and_rolled_back() -> None:
    loop = Loop()
    scheduler = LambdaLR(loop.opt, warmup)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    counter = Counter()
    for name, obj in [("scheduler", scheduler), ("scaler", scaler), ("counter", counter)]:
        loop.state.register(name, obj)
    loop.state.mark_commit_boundary()

    def one_step() -> None:
        scaler.scale(loop.model(torch.ones(3, 4)).sum()).backward()
        scaler.unscale_(loop.opt)
        scaler.step(loop.opt)
        scaler.update()
        scheduler.step()
        counter.count += 1
        loop.opt.zero_grad()

    one_step()  # commits
    loop.state.mark_commit_boundary()
    committed = {"epoch": scheduler.last_epoch, "lr": loop.inner.param_groups[0]["lr"],
                 "scale": scaler.get_scale(), "params": loop.params()}
    loop.commits = False
    one_step()  # fails: nothing applied, but the loop's objects moved on
    assert (scheduler.last_epoch, counter.count) == (committed["epoch"] + 1, 2)
    assert scaler.get_scale() != committed["scale"]

    shared = loop.state.replica_state()  # what a replacement would receive now
    assert shared["statefuls"]["scheduler"]["last_epoch"] == committed["epoch"]
    assert shared["statefuls"]["scaler"]["scale"] == committed["scale"]
    assert shared["statefuls"]["counter"] == {"count": 1}
    assert shared["optimizers"][0]["param_groups"][0]["lr"] == committed["lr"]
    assert loop.state.rank_state()["statefuls"]["counter"] == {"count": 1}

    loop.state.roll_back_step_in_flight()
    assert scheduler.last_epoch == committed["epoch"] and counter.count == 1
    assert loop.inner.param_groups[0]["lr"] == committed["lr"]
    assert scaler.get_scale() == committed["scale"]
    loop.commits = True
    one_step()  # the re-run: unscale_ must not refuse it for the failed step's unscale
    assert scheduler.last_epoch == committed["epoch"] + 1 and counter.count == 2


def test_a_replacement_receives_the_boundary_state() -> None:
    source, newcomer = Loop(), Loop()
    schedulers = [LambdaLR(loop.opt, warmup) for loop in (source, newcomer)]
    for loop, scheduler in zip((source, newcomer), schedulers, strict=True):
        loop.state.register("scheduler", scheduler)
    source.backward()
    source.opt.step()
    schedulers[0].step()
    source.state.mark_commit_boundary()
    source.commits = False
    source.opt.step()
    schedulers[0].step()  # the failed step's
    newcomer.state.load_replica_state(source.state.replica_state())
    assert schedulers[1].last_epoch == 1
    assert newcomer.inner.param_groups[0]["lr"] == pytest.approx(2e-3)
    assert newcomer.inner.state[next(newcomer.model.parameters())]["step"] == 1


def test_the_boundary_copy_shares_no_tensor_with_the_object() -> None:
    loop = Loop()
    ema = Ema(loop.model)
    loop.state.register("ema", ema)
    loop.state.mark_commit_boundary()
    committed = {name: t.clone() for name, t in ema.shadow.items()}
    with torch.no_grad():
        loop.model.weight.add_(1.0)
    ema.update(loop.model)  # in place, in a step that then fails
    assert not torch.equal(ema.shadow["weight"], committed["weight"])
    assert torch.equal(loop.state.replica_state()["statefuls"]["ema"]["shadow"]["weight"], committed["weight"])
    loop.state.roll_back_step_in_flight()
    assert torch.equal(ema.shadow["weight"], committed["weight"])
    ema.update(loop.model)  # the object now holds tensors the boundary does not share
    loop.state.roll_back_step_in_flight()
    assert torch.equal(ema.shadow["weight"], committed["weight"])


def test_before_the_first_boundary_the_objects_own_state_is_given() -> None:
    loop = Loop()
    counter = Counter()
    counter.count = 7
    loop.state.register("counter", counter)
    assert loop.state.replica_state()["statefuls"]["counter"] == {"count": 7}
    assert loop.state.replica_state()["optimizers"][0]["param_groups"][0]["lr"] == pytest.approx(1e-2)


def test_schedulers_and_a_grad_scaler_are_found_without_register() -> None:
    loop, other = Loop(), Loop()
    on_wrapper = LambdaLR(loop.opt, warmup)
    on_inner = [LinearLR(other.inner, start_factor=0.5, total_iters=4),
                LambdaLR(other.inner, warmup)]
    chained = SequentialLR(other.inner, on_inner, milestones=[2])
    scaler = torch.amp.GradScaler("cpu")
    found, left_out = loop_state([loop.opt, other.opt], registered=[])
    assert found == {"lr_scheduler.0.LambdaLR": on_wrapper, "lr_scheduler.1.SequentialLR": chained,
                     "grad_scaler": scaler}
    assert left_out == []
    found, _ = loop_state([loop.opt, other.opt], registered=[on_wrapper, scaler])
    assert found == {"lr_scheduler.1.SequentialLR": chained}


def test_schedulers_that_cannot_be_named_apart_are_left_to_register() -> None:
    loop = Loop()
    first, second = LambdaLR(loop.opt, warmup), LambdaLR(loop.opt, warmup)
    found, left_out = loop_state([loop.opt], registered=[])
    assert "lr_scheduler.0.LambdaLR" not in found
    assert left_out == ["2 x lr_scheduler.0.LambdaLR"]
    loop.state.register("warmup", first)
    assert loop.state.register_loop_state() == []
    assert loop.state.statefuls["lr_scheduler.0.LambdaLR"] is second


def test_a_grad_scaler_forgets_a_step_that_raised_after_unscale() -> None:
    loop = Loop()
    scaler = torch.amp.GradScaler("cpu")
    loop.state.register("scaler", scaler)
    loop.state.mark_commit_boundary()
    scaler.scale(loop.model(torch.ones(3, 4)).sum()).backward()
    scaler.unscale_(loop.opt)  # ... and then the step raised: no scaler.step(), no update()
    loop.state.roll_back_step_in_flight()
    loop.opt.zero_grad()
    scaler.scale(loop.model(torch.ones(3, 4)).sum()).backward()
    scaler.unscale_(loop.opt)  # the re-run
    scaler.step(loop.opt)
    scaler.update()
    assert loop.inner.state[next(loop.model.parameters())]["step"] == 1


def test_an_optimizer_over_the_model_that_is_not_wrapped_is_named() -> None:
    """Its step() would change the model outside the step's commit: ft.steps refuses to start."""
    model = torch.nn.Linear(3, 2)
    wrapped = CommitOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), lambda: True, lambda _: None)
    assert search_loop_state([wrapped], (), model.parameters()).strays == []
    stray = torch.optim.AdamW(model.parameters())
    assert search_loop_state([wrapped], (), model.parameters()).strays == ["AdamW"]
    other_model = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())  # not over the wrapped model
    assert search_loop_state([wrapped], (), model.parameters()).strays == ["AdamW"]
    del stray, other_model
