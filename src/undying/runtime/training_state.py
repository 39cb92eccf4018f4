"""Everything a worker trains and must get back after a fault, in one object.

Runs in the worker. ``Runtime`` owns one ``TrainingState`` and hands it to the checkpoint engine
(runtime/snapshots.py) and the recovery client (runtime/recovery_client.py): they read and load
state through it, never through the runtime.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Protocol

import torch

from undying._torch_compat.training import forget_grad_scaler_step
from undying.data import ACCUMULATE, ResumableLoader, replica_slots
from undying.runtime.ddp import FixedLayoutDDP
from undying.runtime.optim import CommitOptimizer, search_loop_state
from undying.runtime.rng import CUDA_KEY, capture_rng, restore_rng
from undying.runtime.sharded import (
    ShardedModel,
    load_local_optimizer_state,
    load_local_tensors,
    local_optimizer_state,
    local_tensors,
)
from undying.runtime.slot_rng import RngState, SlotStreams
from undying.utils import tree_sha256

if TYPE_CHECKING:
    from undying.runtime.membership import Membership


_IMMUTABLE = frozenset({int, float, bool, complex, str, bytes, type(None)})


def copy_state(state: Any) -> Any:
    """A copy of a state_dict that shares nothing with it: tensors cloned (detached), plain
    containers rebuilt, anything else deep-copied."""
    if type(state) in _IMMUTABLE:
        return state  # what deepcopy returns for these too, without its dispatch (a scheduler's lr, every step)
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if type(state) is dict:
        return {key: copy_state(value) for key, value in state.items()}
    if type(state) in (list, tuple):
        return type(state)(copy_state(value) for value in state)
    return copy.deepcopy(state)  # also subclasses (OrderedDict, namedtuple): deepcopy clones their tensors


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group without its parameters: what a scheduler changes (lr, momentum, ...)."""
    return {key: value for key, value in group.items() if key != "params"}


def restore_hyperparameters(group: dict[str, Any], committed: dict[str, Any]) -> None:
    for key, value in committed.items():
        current = group.get(key)
        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
            current.copy_(value)  # in place: a fused or captured optimizer holds this tensor
        else:
            group[key] = copy_state(value)


def forget_step_in_flight(obj: object) -> None:
    """A GradScaler remembers per optimizer that this step unscaled or stepped it until its
    ``update()``; a step that failed before that must not leave it behind (``unscale_`` would
    refuse the re-run). Its state_dict does not hold this, so loading one does not clear it. A
    disabled GradScaler (``enabled=False``, what fp32 and bf16 scripts build) never makes that
    memory: it has nothing to forget."""
    if isinstance(obj, torch.amp.GradScaler):
        forget_grad_scaler_step(obj)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainingState:
    """The wrapped models and optimizers, the resumable loaders, user-registered state, the committed
    step, and what a rollback to that step needs beyond the (unchanged) model.

    Two parts, as a checkpoint stores them: the *replica* state every data-parallel replica holds
    alike (``replica_state``), and each rank's own (``rank_state``: its RNG and registered objects).
    Both are as of the last commit boundary (``mark_commit_boundary``): the step in flight excluded.

    The loop's own state is part of the transaction: at each commit boundary a copy is kept of every
    registered object's state (LR schedulers, GradScaler, EMA, counters), of each optimizer's
    hyperparameters (the ``lr`` a scheduler writes into its param_groups), and of the RNG and loader
    positions. A step that fails is wound back to that copy (``roll_back_step_in_flight``), and what
    leaves this process (``replica_state``, ``rank_state``) is that copy, never the step in flight.
    """

    def __init__(self, holds_state: bool, rank: int = 0) -> None:
        self.models: list[FixedLayoutDDP | ShardedModel] = []
        self.optimizers: list[CommitOptimizer] = []
        self.loaders: list[ResumableLoader] = []
        self.statefuls: dict[str, Stateful] = {}
        self.committed_step = 0
        # False in a replacement rank until its repair: it holds no training state worth keeping yet.
        self.holds_state = holds_state
        # A sharded job (ft.device_mesh): each rank holds its own shard of the models and optimizers,
        # which are then part of its rank state, not of the replica state.
        self.sharded = False
        self.commit_rng: dict[str, Any] = {}
        # While an elastic job is shrunk: the RNG streams of the batch slots this rank covers for others.
        self.slot_rng = SlotStreams(rank)
        self.commit_loaders: list[dict[str, Any]] = []
        # Empty until the first boundary: before it, the objects' own states are the committed ones.
        self.commit_statefuls: dict[str, Any] = {}
        self.commit_hyperparameters: list[list[dict[str, Any]]] = []

    def register(self, name: str, obj: Stateful) -> None:
        if name in self.statefuls:
            raise ValueError(f"register: name {name!r} is taken")
        self.statefuls[name] = obj

    def register_loop_state(self) -> list[str]:
        """Register the LR schedulers and GradScalers built so far that the user did not
        (runtime/optim.py ``search_loop_state``); returns a description of each one left out. Raises
        if an optimizer over a wrapped model's parameters is not wrapped."""
        search = search_loop_state(self.optimizers, self.statefuls.values(),
                                   [param for model in self.models for param in model.parameters()])
        if search.strays:
            raise ValueError(f"ft.steps: an optimizer over the wrapped model's parameters is not wrapped: "
                             f"{', '.join(search.strays)}; pass it through ft.wrap_optimizer (its step() would "
                             f"change the model outside the step's commit)")
        left_out = search.ambiguous
        for name, obj in search.found.items():
            if name in self.statefuls:
                left_out.append(f"{name} (a registered object has that name)")
            else:
                self.statefuls[name] = obj
        return left_out

    # ------------------------------------------------------------- commit boundary and rollback

    def mark_commit_boundary(self) -> dict[int, RngState]:
        """Remember what the committed step holds beyond the model and optimizer state: RNG, loader
        positions, registered objects, optimizer hyperparameters. Returns the RNG states to mirror, by
        the slot whose stream each is (``rng_to_mirror``).

        Cost per step: a copy of each registered state_dict. A scheduler's, GradScaler's or
        counter's is a few numbers (measured: ~20 us for all three, on top of ~45 us for the RNG);
        an EMA costs a clone of its tensors every step, i.e. one more model copy in memory (on the
        EMA's device) and its copy bandwidth (measured: 34 ms for a 67 MB EMA on a shared CPU)."""
        self.commit_rng = capture_rng()
        for model in self.models:
            if isinstance(model, FixedLayoutDDP):
                model.mark_commit_boundary()  # its buffers (runtime/ddp_buffers.py)
        self.slot_rng.mark_commit_boundary()
        self.commit_loaders = [loader.state_dict() for loader in self.loaders]
        self.commit_statefuls = {name: copy_state(obj.state_dict()) for name, obj in self.statefuls.items()}
        self.commit_hyperparameters = [[copy_state(hyperparameters(group)) for group in optimizer.param_groups]
                                       for optimizer in self.optimizers]
        return self.slot_rng.mirrored(self.commit_rng, committed=True)

    def rng_to_mirror(self) -> dict[int, RngState]:
        """The RNG states a replay of the next step starts from, by slot: this rank's own (unless another
        rank covers its slot) and, while shrunk, the streams of the slots it covers for others."""
        return self.slot_rng.mirrored(capture_rng(), committed=False)

    def roll_back_step_in_flight(self) -> dict[str, Any]:
        """Put the loaders, registered objects, optimizer hyperparameters and slot streams back as they
        were at the committed step; returns the RNG state to restore with them."""
        self.slot_rng.roll_back()
        for loader, state in zip(self.loaders, self.commit_loaders, strict=True):
            loader.load_state_dict(state)
        # strict=False: an optimizer or param group added since the boundary has nothing to go back to.
        for optimizer, groups in zip(self.optimizers, self.commit_hyperparameters, strict=False):
            for group, committed in zip(optimizer.param_groups, groups, strict=False):
                restore_hyperparameters(group, committed)
        for name, state in self.commit_statefuls.items():
            obj = self.statefuls[name]
            # A copy: an object may keep the tensors it is given, and the boundary's stay untouched.
            obj.load_state_dict(copy_state(state))
            forget_step_in_flight(obj)
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
            "models": [] if self.sharded else [model.module.state_dict() for model in self.models],
            "optimizers": [] if self.sharded else [self._committed_optimizer_state(index)
                                                   for index in range(len(self.optimizers))],
            "loaders": self.commit_loaders,
            "statefuls": self._stateful_states(),
        }

    def load_replica_state(self, state: dict[str, Any]) -> None:
        if not self.sharded:
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
        state = {"rng": self.commit_rng or capture_rng(), "statefuls": self._stateful_states(),
                 "slot_rng": self.slot_rng.state_dict()}
        if self.sharded:
            state["shards"] = self.shard_state()
        return state

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if state.get("rng"):
            restore_rng(state["rng"])
        if "slot_rng" in state:
            self.slot_rng.load_state_dict(state["slot_rng"])
        self._load_stateful_states(state.get("statefuls", {}))
        if self.sharded and "shards" in state:  # a T1 snapshot's; a T2 checkpoint keeps them in DCP files
            self.load_shard_state(state["shards"])

    def shard_state(self) -> dict[str, Any]:
        """This rank's shard of every model and optimizer, as of the last commit boundary: what a rank
        holding the same shard in another replica would have (a replacement's repair sends it)."""
        return {"models": [local_tensors(model.module) for model in self.models],
                "optimizers": [local_optimizer_state(self._committed_optimizer_state(index))
                               for index in range(len(self.optimizers))]}

    def load_shard_state(self, state: dict[str, Any]) -> None:
        for model, model_state in zip(self.models, state["models"], strict=True):
            load_local_tensors(model.module, model_state)
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"], strict=True):
            load_local_optimizer_state(optimizer, optimizer_state)

    def forget_failed_step(self) -> None:
        """Drop what a failed step left: the gradients, and a sharded model's per-step state."""
        for model in self.models:
            model.forget_failed_step()  # a data-parallel model's buffers, a sharded one's per-step state
        self.zero_grad()

    def _stateful_states(self) -> dict[str, Any]:
        """As of the commit boundary; an object registered since then, as it is now."""
        return {name: self.commit_statefuls[name] if name in self.commit_statefuls else obj.state_dict()
                for name, obj in self.statefuls.items()}

    def _committed_optimizer_state(self, index: int) -> dict[str, Any]:
        """The optimizer's state_dict with the hyperparameters of the commit boundary: its tensors
        change only in a committed ``step()``, but a scheduler may have set the ``lr`` since."""
        state = self.optimizers[index].state_dict()
        if index < len(self.commit_hyperparameters):
            for packed, committed in zip(state["param_groups"], self.commit_hyperparameters[index], strict=False):
                packed.update(committed)
        return state

    def _load_stateful_states(self, states: dict[str, Any]) -> None:
        for name, stateful_state in states.items():
            if name in self.statefuls:
                self.statefuls[name].load_state_dict(stateful_state)

    def digests(self) -> dict[str, str]:
        """SHA-256 digests of what this rank holds now (``state_digests: true``, at the end of a run):
        its models' parameters and buffers, its optimizers' state (a sharded model's: this rank's
        shards, no collective) and its torch RNG (and own CUDA device's) state."""
        models = [local_tensors(model.module) if isinstance(model, ShardedModel) else model.module.state_dict()
                  for model in self.models]
        rng = capture_rng()
        return {"params_sha256": tree_sha256(models),
                "optimizer_sha256": tree_sha256([optimizer.state_dict() for optimizer in self.optimizers]),
                "rng_sha256": tree_sha256({key: rng[key] for key in ("torch", CUDA_KEY) if key in rng})}

    # ------------------------------------------------------------- elastic membership

    def apply_members(self, membership: Membership, elastic_batch: str) -> None:
        """Give the models and loaders this rank's share of the step for the current members: the
        whole job's global batch is kept when there are fewer replicas (elastic training)."""
        slots, replicas, group_rank = membership.world_size, membership.replicas, membership.group_rank
        shrunk = replicas < slots
        first_slot, slot_count = replica_slots(group_rank, replicas, slots)
        self.slot_rng.set_layout(first_slot, slot_count, per_slot=shrunk and elastic_batch == ACCUMULATE)
        for loader in self.loaders:
            loader.slot_draws = self.slot_rng.drawing_for
            if shrunk:
                loader.set_replicas(group_rank, replicas, elastic_batch)
            else:
                loader.reshard(membership.rank, slots)
        for model in self.models:
            if shrunk:
                if isinstance(model, FixedLayoutDDP) and elastic_batch != "grow":
                    model.set_replica_share(1, slots, weights_total=replicas)  # one weight per replica
                else:
                    model.set_replica_share(slot_count if elastic_batch == "grow" else 1, slots)
            else:
                model.set_replica_share(1, None)
