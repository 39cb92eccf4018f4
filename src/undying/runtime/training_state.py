"""Everything a worker trains and must get back after a fault, in one object.

Runs in the worker. ``Runtime`` owns one ``TrainingState`` and hands it to the checkpoint engine
(runtime/snapshots.py) and the recovery client (runtime/recovery_client.py): they read and load
state through it, never through the runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from undying.data import ResumableLoader, replica_slots
from undying.runtime.ddp import FixedLayoutDDP
from undying.runtime.optim import CommitOptimizer
from undying.runtime.rng import capture_rng, restore_rng

if TYPE_CHECKING:
    from undying.runtime.membership import Membership


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainingState:
    """The wrapped models and optimizers, the resumable loaders, user-registered state, the committed
    step, and what a rollback to that step needs beyond the (unchanged) model.

    Two parts, as a checkpoint stores them: the *replica* state every data-parallel replica holds
    alike (``replica_state``), and each rank's own (``rank_state``: its RNG and registered objects).
    Both are as of the last commit boundary (``mark_commit_boundary``): the step in flight excluded.
    """

    def __init__(self, holds_state: bool) -> None:
        self.models: list[FixedLayoutDDP] = []
        self.optimizers: list[CommitOptimizer] = []
        self.loaders: list[ResumableLoader] = []
        self.statefuls: dict[str, Stateful] = {}
        self.committed_step = 0
        # False in a replacement rank until its repair: it holds no training state worth keeping yet.
        self.holds_state = holds_state
        self.commit_rng: dict[str, Any] = {}
        self.commit_loaders: list[dict[str, Any]] = []

    def register(self, name: str, obj: Stateful) -> None:
        if name in self.statefuls:
            raise ValueError(f"register: name {name!r} is taken")
        self.statefuls[name] = obj

    # ------------------------------------------------------------- commit boundary and rollback

    def mark_commit_boundary(self) -> dict[str, Any]:
        """Remember the RNG and loader positions of the committed step; returns the RNG state (to mirror)."""
        self.commit_rng = capture_rng()
        self.commit_loaders = [loader.state_dict() for loader in self.loaders]
        return self.commit_rng

    def roll_back_step_in_flight(self) -> dict[str, Any]:
        """Put the loaders back at the committed step; returns the RNG state to restore with them."""
        for loader, state in zip(self.loaders, self.commit_loaders, strict=True):
            loader.load_state_dict(state)
        return self.commit_rng

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------- the two parts of a checkpoint

    def replica_state(self) -> dict[str, Any]:
        """Everything a replica shares, as of the last committed step: what a newcomer receives, what
        a dump writes, and the shared file of a periodic checkpoint."""
        return {
            "committed_step": self.committed_step,
            "models": [model.module.state_dict() for model in self.models],
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "loaders": self.commit_loaders,
            "statefuls": self._stateful_states(),
        }

    def load_replica_state(self, state: dict[str, Any]) -> None:
        for model, model_state in zip(self.models, state["models"], strict=True):
            model.module.load_state_dict(model_state)
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        for loader, loader_state in zip(self.loaders, state["loaders"], strict=True):
            loader.load_state_dict(loader_state)
        self._load_stateful_states(state.get("statefuls", {}))
        self.committed_step = state["committed_step"]

    def rank_state(self) -> dict[str, Any]:
        """This rank's own part of a snapshot, as of the last commit boundary."""
        return {"rng": self.commit_rng or capture_rng(), "statefuls": self._stateful_states()}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if state.get("rng"):
            restore_rng(state["rng"])
        self._load_stateful_states(state.get("statefuls", {}))

    def _stateful_states(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.statefuls.items()}

    def _load_stateful_states(self, states: dict[str, Any]) -> None:
        for name, stateful_state in states.items():
            if name in self.statefuls:
                self.statefuls[name].load_state_dict(stateful_state)

    # ------------------------------------------------------------- elastic membership

    def apply_members(self, membership: Membership, elastic_batch: str) -> None:
        """Give the models and loaders this rank's share of the step for the current members: the
        whole job's global batch is kept when there are fewer replicas (elastic training)."""
        slots, replicas, group_rank = membership.world_size, membership.replicas, membership.group_rank
        shrunk = replicas < slots
        _, slot_count = replica_slots(group_rank, replicas, slots)
        for loader in self.loaders:
            if shrunk:
                loader.set_replicas(group_rank, replicas, elastic_batch)
            else:
                loader.reshard(membership.rank, slots)
        for model in self.models:
            if shrunk:
                model.set_replica_share(slot_count if elastic_batch == "grow" else 1, slots)
            else:
                model.set_replica_share(1, None)
