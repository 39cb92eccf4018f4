"""Model, autograd and optimizer internals: torch.compile's original module, autograd's end-of-backward
callback, torch._dynamo's import, an LR scheduler's children, a GradScaler's per-step memory.
Runs in the worker (``import_dynamo`` also in the standby process). Known to work with torch 2.13.0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def compiled_original(module: object) -> torch.nn.Module | None:
    """The module ``torch.compile`` wrapped, if ``module`` is its result; else None.

    Needs ``OptimizedModule._orig_mod``: torch.compile returns a wrapper whose state_dict keys carry an
    ``_orig_mod.`` prefix; undying keeps the plain module's state (loadable either way), and torch
    has no public accessor for the original."""
    original = getattr(module, "_orig_mod", None)
    return original if isinstance(original, torch.nn.Module) else None


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running has finished (on autograd's thread).

    Needs ``Variable._execution_engine.queue_callback``: what DDP uses to finish its gradient
    reduction; no public hook fires at the end of a whole backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def import_dynamo() -> None:
    """Import ``torch._dynamo`` now (the first optimizer a script builds imports it lazily, and keeps
    references to the default process group of the moment while doing so).

    Needs the private module itself: no public module imports it without side effects of its own."""
    import torch._dynamo  # noqa: F401


def child_schedulers(scheduler: object) -> list[Any]:
    """The schedulers a ``SequentialLR`` or ``ChainedScheduler`` drives (none for any other).

    Needs ``_schedulers``: both keep their children only there, and save them in their own
    state_dict, so a checkpoint must not save the children a second time."""
    return list(getattr(scheduler, "_schedulers", None) or [])


def forget_grad_scaler_step(scaler: torch.amp.GradScaler) -> None:
    """Clear what ``scaler`` remembers, per optimizer, of the step in flight (unscaled, stepped):
    after a failed step, ``unscale_`` would refuse the re-run.

    Needs ``_per_optimizer_states``: only ``update()`` clears it, and its state_dict leaves it out."""
    per_optimizer = getattr(scaler, "_per_optimizer_states", None)
    if per_optimizer is not None:
        per_optimizer.clear()
