"""The optimizer wrapper that makes ``opt.step()`` the commit point of a step.

Runs in the worker. ``step()`` first averages the gradients of every wrapped model
(with each rank's vote folded into that all-reduce), and applies the update only
if every rank's step succeeded. The heartbeat phase moves computing -> updating
-> updated around it, so the controller knows which ranks hold a clean copy of
which step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from undying.protocol import Phase


class CommitOptimizer:
    """Wraps a torch optimizer; everything but ``step`` is the wrapped optimizer's own.

    Give LR schedulers the original optimizer object: they act on its param_groups,
    which this wrapper shares.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, sync_gradients: Callable[[], bool],
                 set_phase: Callable[[str], None], before_step: Callable[[], None] = lambda: None,
                 before_update: Callable[[], None] = lambda: None) -> None:
        self.optimizer = optimizer
        self._sync_gradients = sync_gradients
        self._set_phase = set_phase
        self._before_step = before_step
        self._before_update = before_update  # e.g. wait for an overlapped snapshot's copy

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply the update iff every rank's step succeeded; otherwise apply nothing and return None.

        A failed step raises nothing here: the runtime's ``steps()`` sees it at the end of
        the loop body, recovers, and yields the same step again.
        """
        self._before_step()
        if not self._sync_gradients():
            return None
        self._before_update()
        self._set_phase(Phase.UPDATING)
        result = self.optimizer.step(closure)
        self._set_phase(Phase.UPDATED)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
