"""The optimizer wrapper that makes ``opt.step()`` the commit point of a step, and the finding of the
LR schedulers, GradScalers and averaged models (EMA, SWA) a loop built around it.

Runs in the worker. ``step()`` first averages the gradients of every wrapped model
(with each rank's vote folded into that all-reduce), and applies the update only
if every rank's step succeeded. The heartbeat phase moves computing -> updating
-> updated around it, so the controller knows which ranks hold a clean copy of
which step.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.swa_utils import AveragedModel

from undying._torch_compat.training import child_schedulers
from undying.protocol import Phase

GRAD_SCALER_NAME = "grad_scaler"
AVERAGED_MODEL_NAME = "averaged_model"


class CommitOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer; everything but ``step`` is the wrapped optimizer's own.

    Guarantees: ``step()`` changes nothing (parameters, optimizer state, its step counts) unless
    every rank's step succeeded. It is a ``torch.optim.Optimizer`` whose ``param_groups``,
    ``state`` and ``defaults`` are the wrapped optimizer's very objects, so LR schedulers (and
    GradScaler) may be built on it or on the original optimizer alike. An LR scheduler replaces
    this object's ``step`` with a wrapper that counts calls and then calls this class's ``step``:
    the commit decision stays here. Not guaranteed: that a scheduler stepped in a step that did not
    commit is wound back by this object; the runtime does that (``TrainingState``'s commit boundary).
    """

    # Optimizer.__init__ is not called: there are no parameters of this object's own to group.
    def __init__(self, optimizer: torch.optim.Optimizer, sync_gradients: Callable[[], bool],
                 set_phase: Callable[[Phase], None], before_step: Callable[[], None] = lambda: None,
                 before_update: Callable[[], None] = lambda: None) -> None:
        self.optimizer = optimizer
        self._sync_gradients = sync_gradients
        self._set_phase = set_phase
        self._before_step = before_step
        self._before_update = before_update  # e.g. wait for an overlapped snapshot's copy

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Apply the update iff every rank's step succeeded; otherwise apply nothing and return None.

        A failed step raises nothing here: the runtime's ``steps()`` sees it at the end of
        the loop body, recovers, and yields the same step again. Keyword arguments (e.g. the
        ``grad_scaler`` a GradScaler passes to fused optimizers) go to the wrapped ``step``.
        """
        self._before_step()
        if not self._sync_gradients():
            return None
        self._before_update()
        self._set_phase(Phase.UPDATING)
        result = self.optimizer.step(closure, **kwargs)
        self._set_phase(Phase.UPDATED)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    # Plain attributes on torch.optim.Optimizer; here views of the wrapped optimizer's.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this object lacks (e.g. the hook registries Optimizer.__init__
        # would have made): they are the wrapped optimizer's, so hooks fire on a committed update.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)


@dataclass(frozen=True)
class LoopStateSearch:
    """What one search of the live objects found (``search_loop_state``)."""

    found: dict[str, Any]  # LR schedulers, GradScalers and averaged models to register, by name
    ambiguous: list[str]  # those that could not be named, for the user to ``register``
    strays: list[str]  # class names of optimizers over the model that are not wrapped


def search_loop_state(optimizers: list[CommitOptimizer], registered: Iterable[object],
                      params: Iterable[torch.Tensor]) -> LoopStateSearch:
    """The loop's state that exists now, in one pass over the objects the garbage collector tracks
    (~30 ms with torch loaded, once); a collection and a second pass only where something looks
    wrong (a name that is ambiguous, a stray optimizer), since a dead object kept by a reference
    cycle may be the cause: a full collection over torch's objects costs ~0.1 s, and a replacement
    rank searches on its way to its recovery's check-in.

    LR schedulers, GradScalers and averaged models (``torch.optim.swa_utils.AveragedModel``: an EMA or
    SWA average) not in ``registered``, by name: a scheduler counts when built on one of
    ``optimizers`` (the wrapper or the optimizer it wraps); the children of a SequentialLR or
    ChainedScheduler come with their parent. The names depend only on what the script built
    (``lr_scheduler.<optimizer index>.<class>``, ``grad_scaler``, ``averaged_model``), so every rank, a
    replacement and a restarted job choose the same ones. Where that would be ambiguous (two
    top-level schedulers of one class on one optimizer, two GradScalers, two averaged models)
    nothing is taken and ``ambiguous`` says what.
    Strays: optimizers over any of ``params`` that are neither one of ``optimizers`` nor the optimizer
    one wraps; their ``step()`` would change the model outside the step's commit. Objects created
    after this call are not seen.
    """
    optimizer_index: dict[int, int] = {}
    for index, wrapped in enumerate(optimizers):
        optimizer_index[id(wrapped)] = optimizer_index[id(wrapped.optimizer)] = index
    taken = {id(obj) for obj in registered}
    trained = {id(param) for param in params}
    by_name, strays = _search(optimizer_index, taken, trained)
    if strays or any(len(objs) > 1 for objs in by_name.values()):
        del by_name  # our own references would keep the dead ones alive through the collection
        gc.collect()
        by_name, strays = _search(optimizer_index, taken, trained)
    found = {name: objs[0] for name, objs in by_name.items() if len(objs) == 1}
    ambiguous = [f"{len(objs)} x {name}" for name, objs in sorted(by_name.items()) if len(objs) > 1]
    return LoopStateSearch(found, ambiguous, strays)


def _search(optimizer_index: dict[int, int], taken: set[int], trained: set[int]
            ) -> tuple[dict[str, list[Any]], list[str]]:
    """One pass: every live LR scheduler on one of the optimizers, every GradScaler and every
    averaged model not in ``taken``, by name; and the class names of unwrapped optimizers over
    ``trained`` parameters."""
    schedulers, scalers, averaged, strays = [], [], [], []
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which some module-level objects
        # (deprecated torch aliases) answer with a warning.
        kind = type(obj)
        if issubclass(kind, LRScheduler) and id(obj.optimizer) in optimizer_index:
            schedulers.append(obj)
        elif issubclass(kind, torch.amp.GradScaler):
            scalers.append(obj)
        elif issubclass(kind, AveragedModel):
            averaged.append(obj)
        elif issubclass(kind, torch.optim.Optimizer) and id(obj) not in optimizer_index and any(
                id(param) in trained for group in obj.param_groups for param in group["params"]):
            strays.append(kind.__name__)
    children = {id(child) for scheduler in schedulers for child in child_schedulers(scheduler)}
    by_name: dict[str, list[Any]] = {}
    for scheduler in schedulers:
        if id(scheduler) not in taken and id(scheduler) not in children:
            name = f"lr_scheduler.{optimizer_index[id(scheduler.optimizer)]}.{type(scheduler).__name__}"
            by_name.setdefault(name, []).append(scheduler)
    for name, objs in ((GRAD_SCALER_NAME, scalers), (AVERAGED_MODEL_NAME, averaged)):
        free = [obj for obj in objs if id(obj) not in taken]
        if free:
            by_name[name] = free
    return by_name, sorted(strays)


def refuse_zero_redundancy(optimizer: torch.optim.Optimizer) -> None:
    """One line for torch's ZeroRedundancyOptimizer (ZeRO-1 for DDP): its state differs per rank while
    undying repairs a data-parallel rank from any peer's copy, and it keeps the process group of its
    construction, which a recovery replaces. FSDP2 shards the optimizer state in a way undying
    tracks per rank (docs/sharding.md)."""
    # Looked up, never imported: importing torch.distributed.optim after the default group exists
    # leaves references to that group in module state, and a dropped group must have none left (its
    # connections, which the peers of a failed generation wait on, close only with its last one).
    # A script that built one has imported it already.
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    zero = getattr(module, "ZeroRedundancyOptimizer", None)
    if zero is not None and isinstance(optimizer, zero):
        raise ValueError("ft.wrap_optimizer: ZeroRedundancyOptimizer is not supported (its state differs per "
                         "rank and it keeps the process group it was built with); shard the optimizer state "
                         "with FSDP2 instead: ft.device_mesh(...) and fully_shard(module, mesh=mesh, "
                         "reshard_after_forward=False), which keeps the parameters whole through a step as ZeRO-2 does")
