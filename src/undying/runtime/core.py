"""The worker runtime behind ``undying.init()``: the user's side of the job, one step at a time.

Runs in every worker process. It reads the environment its agent set (worker_env.py), builds
the worker's parts (the heartbeat client, the membership and its process group, the training
state, the checkpoint engine, the step transaction, the recovery client) and serves the user's
API: ``wrap_model``, ``wrap_optimizer``, ``dataloader``, ``register``, ``log``, ``check`` and
``finish``. ``steps()`` is the step loop (runtime/step_loop.py): it restores the newest verified
checkpoint (runtime/snapshots.py) or, for a replacement rank, recovers first; it runs each step
as a transaction that every rank commits or none does (runtime/step_transaction.py), writes
periodic checkpoints, and hands a failed step to the recovery client (runtime/recovery_client.py)
before re-running it.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from undying import events as ev
from undying._torch_compat.training import compiled_original
from undying.config import JobSpec
from undying.data import ResumableLoader
from undying.inject import decode
from undying.protocol import Phase
from undying.runtime.bad_steps import BadSteps
from undying.runtime.carried_batches import DrawLedger
from undying.runtime.ddp import FixedLayoutDDP
from undying.runtime.ddp_options import parse_ddp_options
from undying.runtime.devices import choose_backend, choose_device, set_numerics_mode
from undying.runtime.generation import Generation
from undying.runtime.injection_points import ALLREDUCE, OPTIMIZER, InjectionPoints
from undying.runtime.loaders import build_loader
from undying.runtime.membership import Membership
from undying.runtime.optim import CommitOptimizer, refuse_zero_redundancy
from undying.runtime.process_exit import install_exit_hooks
from undying.runtime.recovery_client import RecoveryClient
from undying.runtime.reporter import Reporter
from undying.runtime.rng_mirror import MIRROR_TIMEOUT_S, RngMirror
from undying.runtime.run_record import write_result
from undying.runtime.scalars import checked_scalars
from undying.runtime.sharded import ShardedModel, is_sharded, make_mesh, wrap_sharded
from undying.runtime.snapshots import CheckpointEngine, checkpoint_root
from undying.runtime.step_loop import StepLoop
from undying.runtime.step_transaction import StepTransaction
from undying.runtime.step_value import Step
from undying.runtime.training_state import Stateful, TrainingState
from undying.shm import node_dir
from undying.strategy_names import StrategyName
from undying.worker_env import WorkerEnv, worker_env_of_this_process


class Runtime:
    """One worker's membership in the job. Create it with ``undying.init()``.

    It owns the parts and wires them: the ``TrainingState`` (what is trained and restored), the
    ``Membership`` (generation, members, group, store), the ``CheckpointEngine``, the
    ``RecoveryClient`` and the ``StepLoop``, which receive those objects rather than the runtime.
    """

    def __init__(self, env: WorkerEnv | None = None) -> None:
        started = time.time()
        env = worker_env_of_this_process() if env is None else env
        self.spec: JobSpec = env.spec
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.node = env.node
        self.joining = env.joining
        self.run_dir: Path = env.run_dir
        self.backend = choose_backend(self.spec.backend, env.local_world_size)
        self.device = choose_device(self.backend, self.rank, self.local_rank, env.local_world_size)
        set_numerics_mode(self.spec.deterministic)  # before any kernel or NCCL communicator
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # Which generation this worker is in, and whether the controller aborted or ends it: the
        # reporter feeds it from heartbeat replies, the membership moves it, the rest read it.
        generation = Generation(env.generation)
        self.reporter = Reporter(env.controller, env.token, self.rank, self.node, generation,
                                 self.spec.heartbeat_interval, fence_lease=self.spec.commit_fence_lease())
        self.membership = Membership(env, self.backend, self.device, generation)
        if not self.joining:
            self.membership.build_group()
        self.state = TrainingState(holds_state=not self.joining, rank=self.rank)
        root = checkpoint_root(self.spec, self.run_dir)
        self.injections = InjectionPoints(decode(env.injections_text), self.reporter, self.rank, self.node,
                                          self.local_rank,
                                          lambda step: any(c.step == step for c in root.list_committed()),
                                          _node_fault_markers(env), env.local_world_size)
        self.draws = DrawLedger()  # a batch carried into a step in a variable (runtime/carried_batches.py)
        self.finished = False
        # Its own bounded store connection: a mirror write happens every step, and a store whose
        # host froze must not hold the step for ``start_timeout``.
        self.rng_mirror = RngMirror(self.membership.bounded_store(MIRROR_TIMEOUT_S, name="rng mirror store"),
                                    env.store_prefix, self.rank, self.reporter,
                                    backup_address=lambda: self.reporter.mirror_store)
        self.checkpoints = CheckpointEngine(self.spec, self.state, self.membership, self.reporter, self.injections,
                                            root, env.job_id, env.token)
        self.recovery = RecoveryClient(self.spec, self.membership, self.state, self.reporter, self.rng_mirror,
                                       self.injections, self.checkpoints)
        self.transaction = StepTransaction(self.spec, self.state, self.membership, self.reporter, self.rng_mirror,
                                           self.injections, self.device, self.checkpoints.peer)
        self.bad_steps = BadSteps(self.spec, self.state, self.membership, self.reporter)
        self.loop = StepLoop(self.spec, self.state, self.membership, self.reporter, self.transaction, self.checkpoints,
                             self.recovery, self.bad_steps, self.rng_mirror, self.draws, self.device, self.run_dir,
                             self.joining)
        self.reporter.committing = self.checkpoints.committing_step
        self.reporter.emit(ev.WORKER_READY, step=0, seconds=round(time.time() - started, 4),
                           backend=self.backend, pid=os.getpid(), joining=self.joining)

    # ------------------------------------------------------------- user API

    @property
    def is_main(self) -> bool:
        """The first member of the current generation (rank 0 unless an elastic shrink dropped it)."""
        return self.group_rank == 0

    @property
    def group_rank(self) -> int:
        return self.membership.group_rank

    @property
    def replicas(self) -> int:
        """Data-parallel replicas in the current generation (``world_size`` unless shrunk)."""
        return self.membership.replicas

    @property
    def members(self) -> list[int]:
        return self.membership.members

    @property
    def generation(self) -> int:
        return self.membership.generation

    @property
    def committed_step(self) -> int:
        return self.state.committed_step

    @property
    def models(self) -> list[FixedLayoutDDP | ShardedModel]:
        return self.state.models

    @property
    def optimizers(self) -> list[CommitOptimizer]:
        return self.state.optimizers

    @property
    def loaders(self) -> list[ResumableLoader]:
        return self.state.loaders

    def device_mesh(self, replicate: int = 1, shard: int | None = None) -> Any:
        """A torch ``DeviceMesh`` of shape (replicate, shard), dims ``("replicate", "shard")``, over the
        job's ranks, for FSDP2 (``replicate=1``) or HSDP: pass it to ``fully_shard``, then the model to
        ``wrap_model``. Its process groups belong to the current generation: rebuilt at each recovery,
        bounded by ``comm_timeout``, aborted with it (runtime/mesh.py). Call it once, before wrapping."""
        if self.membership.mesh is not None or self.state.models:
            raise ValueError("ft.device_mesh: call it once, before ft.wrap_model")
        peer_copies = self.checkpoints.peer.copies_for(replicate)
        mesh = make_mesh(self.rank, self.world_size, replicate, shard, list(self.spec.recover_strategy),
                         self.backend, self.device, t1_snapshots=self.spec.checkpoint.snapshot_interval != 0,
                         peer_copies=peer_copies)
        mesh.on_gradient_reduction(self._in_gradient_sync)
        self.membership.attach_mesh(mesh)
        self.reporter.mesh_shard, self.reporter.mesh_peer_copies = mesh.shard, peer_copies
        self.reporter.beat_now()
        self.state.sharded = True
        if self.joining and self.membership.group is None:
            self.recovery.join_early()
        return mesh.device_mesh

    def wrap_model(self, model: torch.nn.Module, **ddp_kwargs: Any) -> FixedLayoutDDP | ShardedModel:
        """The model in the step transaction. A plain model gets DDP's semantics (runtime/ddp.py) and
        takes DDP's constructor arguments (``broadcast_buffers``, ``find_unused_parameters``,
        ``bucket_cap_mb``, ...; runtime/ddp_options.py says which, and refuses the others in one line)."""
        wrapped_already = [wrapped.module for wrapped in self.state.models]
        if any(model is module or compiled_original(model) is module for module in wrapped_already):
            raise ValueError(f"ft.wrap_model: this {type(model).__name__} is already wrapped; wrap each model once")
        if self.state.sharded or is_sharded(model):
            if ddp_kwargs:
                raise ValueError(f"ft.wrap_model: {', '.join(ddp_kwargs)}: DDP's arguments are for a data-parallel "
                                 f"model; a fully_shard-ed one takes none")
            sharded = wrap_sharded(model, self.membership.mesh, self.joining)
            self.state.models.append(sharded)
            self._watch_forwards(sharded)
            return sharded
        options = parse_ddp_options(ddp_kwargs, self.device)
        # A replacement rank gets its parameters in the repair step, not by a broadcast
        # the live ranks would not take part in.
        wrapped = FixedLayoutDDP(model.to(self.device), self.membership.current_group, self.device,
                                 broadcast=not self.joining, ready_to_sync=self.transaction.batches_taken,
                                 set_phase=self.transaction.set_phase, options=options,
                                 before_extra_round=self.transaction.agree_to_continue,
                                 in_gradient_sync=self._in_gradient_sync)
        # Which bucket layout the job is at is job state: handed to a replacement, checkpointed, rolled back.
        self.state.register(f"ddp.{len(self.state.models)}.bucket_order", wrapped.bucket_order)
        self.state.models.append(wrapped)
        self.state.apply_members(self.membership, self.spec.elastic_batch)
        self._watch_forwards(wrapped)
        return wrapped

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> CommitOptimizer:
        """The optimizer whose ``step()`` commits the step on every rank or on none. It is a
        ``torch.optim.Optimizer``: build LR schedulers (and GradScaler) on it as on the original."""
        refuse_zero_redundancy(optimizer)
        wrapped = CommitOptimizer(optimizer, self.transaction.commit, self.transaction.set_phase,
                                  self.transaction.fire_raise_injections, self.checkpoints.settle)
        if self.injections.aims_at(OPTIMIZER):
            # Inside the optimizer's own step(), its update done (torch runs post-hooks within step()).
            optimizer.register_step_post_hook(
                lambda _optimizer, _args, _kwargs: self.injections.at_point(OPTIMIZER, self.state.committed_step))
        self.state.optimizers.append(wrapped)
        return wrapped

    def dataloader(self, dataset: Any, batch_size: int | None = None, seed: int = 0, collate_fn: Any = None,
                   num_workers: int = 0, pin_memory: bool = False, persistent_workers: bool = False,
                   prefetch_factor: int | None = None, worker_init_fn: Any = None) -> Any:
        """This rank's batches, their position part of the step transaction.

        A map-style dataset (len and __getitem__) gets a ``ResumableLoader``: one global order per
        epoch, this rank's share of each step, read through a torch DataLoader with these options
        (``pin_memory`` only where the device is CUDA). An iterable with state_dict/load_state_dict
        (torchdata's StatefulDataLoader, a stateful IterableDataset: ``batch_size`` samples per batch,
        or None if it yields batches) is wrapped and registered instead; it has no global order to
        respread, so a job that may shrink (``elastic-training``) refuses it."""
        loader = build_loader(self.state, self.draws, dataset, batch_size, seed, collate_fn,
                              {"num_workers": num_workers, "pin_memory": pin_memory,
                               "persistent_workers": persistent_workers, "prefetch_factor": prefetch_factor,
                               "worker_init_fn": worker_init_fn},
                              rank=self.rank, world_size=self.world_size, device=self.device,
                              elastic=StrategyName.ELASTIC in self.spec.recover_strategy)
        if isinstance(loader, ResumableLoader):
            self.state.apply_members(self.membership, self.spec.elastic_batch)
        return loader

    def register(self, name: str, obj: Stateful) -> None:
        """Make ``obj`` (anything with state_dict/load_state_dict: an EMA, a counter) part of the
        step transaction: checkpointed with the training state, handed to a replacement rank, and
        wound back to the last committed step when a step fails.

        LR schedulers built on a wrapped optimizer (or the optimizer it wraps), a GradScaler and an
        ``AveragedModel`` need no ``register``: ``steps()`` finds those that exist when it starts and registers them itself;
        those it cannot name unambiguously (e.g. two LambdaLR on one optimizer) are left to
        ``register`` and named in one warning at the first step."""
        self.state.register(name, obj)

    def log(self, **scalars: Any) -> None:
        """Report scalars of this rank (``ft.log(loss=loss, lr=lr, grad_norm=norm, tokens_per_s=rate)``):
        each a real number or a one-element tensor. The newest value of each name goes out with the
        next heartbeat, into the event log, ``undying status`` and ``/metrics`` (``undying_train_<name>``).
        A tensor is read with ``.item()`` (on a GPU, a sync: pass a number you already have)."""
        self.reporter.update(scalars=checked_scalars(scalars, self.reporter.scalars))

    def check(self, **values: Any) -> None:
        """Name values of this step to watch (``ft.check(loss=loss)``): numbers or one-element tensors,
        read at ``opt.step()``. One that is not finite (or a ``loss`` above ``loss_spike_factor`` times
        its recent mean) fails the step on every rank before the update, and the step is replayed
        (runtime/bad_steps.py); this rank is named as the cause. The gradient norm is checked without it."""
        self.transaction.check.watch(values)

    def steps(self, max_steps: int, start: int | None = None) -> Iterator[Step]:
        """Yield step numbers from the starting step to ``max_steps - 1``; each yield is one transaction.

        The starting step: the one undying restores whenever it holds one (a restart from node memory
        or its checkpoints, a replacement's repair); else ``start``, the step the script's own
        checkpoint resumes at (nanoGPT's ``init_from='resume'``: pass its ``iter_num``), begun with the
        first rank's weights, optimizer state, loader positions and registered objects, as the script
        loaded them, on every rank; else 0. undying's own state wins over ``start`` (it is complete:
        RNG, loaders, schedulers; and verified); every rank must pass the same ``start``.

        A step whose gradient sync failed (a peer died, a collective timed out, a rank
        voted against it) is not applied by anyone; the runtime then recovers and the
        same step number is yielded again. Schedulers and GradScalers are looked for first
        (``register``): build them before the loop.
        """
        return self.loop.steps(max_steps, start)

    def finish(self, result: dict[str, Any] | None = None) -> None:
        """End of training: rank 0 writes RUN_DIR/result.json; every rank says it is done (with the
        digests of its state, ``state_digests: true``)."""
        digests = self.state.digests() if self.spec.state_digests else {}
        self.checkpoints.close()  # the last checkpoint is committed before the job may end
        self.membership.close()  # torch.distributed's default group, destroyed the ordinary way
        if self.is_main:
            # replicas: copies of the model that trained to the end (a sharded job's: the mesh's rows
            # left, each of several ranks); ranks: the processes that did.
            mesh = self.membership.mesh
            write_result(self.run_dir, {"final_step": self.state.committed_step, "world_size": self.world_size,
                                        "replicas": self.replicas if mesh is None else mesh.replicas,
                                        "ranks": len(self.members), "generation": self.generation,
                                        **(result or {})})
        self.finished = True
        self.reporter.update(phase=Phase.DONE)
        self.reporter.emit(ev.WORKER_DONE, step=self.state.committed_step, **digests)
        self.reporter.close()
        # Interpreter shutdown otherwise spends seconds in a final GC over torch's object graph
        # (measured: ~3 s per worker on these machines); nothing left is garbage worth that.
        gc.freeze()

    def finish_at_exit(self) -> None:
        """At the exit of a worker whose script ran ``ft.steps(n)`` to its end under a controller and
        did not call ``finish()``: finish for it, so that its last checkpoint is committed and the
        controller learns its final step (its heartbeats may be a few steps behind)."""
        if self.loop.ran_to_end and self.reporter.connected:
            self.finish()

    # ------------------------------------------------------------- hooks on the wrapped model

    def _watch_forwards(self, model: torch.nn.Module) -> None:
        """Each call of the wrapped model with gradients enabled (a training forward) is shown to the
        draw ledger: a step's first one must not read a batch carried in from another step."""
        def training_forward(_module: torch.nn.Module, _args: Any) -> None:
            if torch.is_grad_enabled():
                self.draws.forward()

        def training_forward_done(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
            if torch.is_grad_enabled():
                self.transaction.forward_done()

        model.register_forward_pre_hook(training_forward)
        model.register_forward_hook(training_forward_done)
        model.register_forward_hook(self.transaction.poison_output)

    def _in_gradient_sync(self) -> None:
        """The step's gradient averaging is under way (a bucket's all-reduce or FSDP's reduce-scatter
        started): an ``at=allreduce`` injection fires here."""
        self.injections.at_point(ALLREDUCE, self.state.committed_step)


_runtime: Runtime | None = None


def init() -> Runtime:
    """Join the job this process was started in (or a one-process standalone job)."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
        runtime = _runtime
        install_exit_hooks(lambda: runtime.finished, runtime.finish_at_exit)
    return _runtime


def _node_fault_markers(env: WorkerEnv) -> Path | None:
    """Where the node's local ranks mark reaching a node fault's step: in the node's shared-memory
    directory, which its agent removes at the end of the job (node 0's launcher removes the job's
    on its machine; a later job's agent removes one whose owners are all gone), so no marker stays
    in the run directory. None standalone (no node, no node faults)."""
    return node_dir(env.job_id, env.node) / "injections" if env.job_id else None
