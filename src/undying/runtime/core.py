"""The worker runtime behind ``undying.init()``: joins the job, runs steps as transactions, recovers.

Runs in every worker process. It reads the environment its agent set, connects to
the job's store, builds this generation's process group, and then serves the
user's loop: ``steps()`` restores the newest verified checkpoint (or, for a
replacement rank, receives the state from a live replica), fires injected faults,
commits each step, writes periodic checkpoints, and, when a step fails, leaves
it, takes part in the controller's recovery plan and re-runs it.
"""

from __future__ import annotations

import atexit
import functools
import gc
import io
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import torch

from undying import events as ev
from undying.checkpoint import Location, commit, root_location, save_object, staging_dir
from undying.checkpoint.dcp_format import write_shared_shard
from undying.client import parse_address
from undying.config import JobSpec, spec_from_json
from undying.data import ResumableLoader, replica_slots
from undying.inject import Injection, decode, fire
from undying.protocol import (
    ENV_CONTROLLER,
    ENV_GENERATION,
    ENV_INJECT,
    ENV_JOINING,
    ENV_NODE,
    ENV_RUN_DIR,
    ENV_SPEC,
    ENV_STORE_PREFIX,
    ENV_TOKEN,
    Phase,
    Plan,
    PlanAction,
)
from undying.runtime.bounded_store import BoundedStore, connect_bounded
from undying.runtime.ddp import FixedLayoutDDP
from undying.runtime.optim import CommitOptimizer
from undying.runtime.pg import CollectiveError, GenerationGroup, choose_backend, connect_store, reapers_alive
from undying.runtime.reporter import Reporter
from undying.runtime.rng import capture_rng, restore_rng, rng_to_bytes
from undying.runtime.rng_mirror import MIRROR_TIMEOUT_S, RngMirror
from undying.runtime.snapshots import CheckpointEngine, rank_state_file

RESULT_FILE = "result.json"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes, device: torch.device | str = "cpu") -> Any:
    # Only ever bytes this job's own ranks produced (store or process group), never user files.
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)


class Step(int):
    """A step number that can also guard the step's body: ``with step: ...``.

    Inside the guard, an exception raised by the step (e.g. a transient error) does not
    kill the process when ``retry`` is enabled: this rank votes against the step, no
    rank applies it, and everyone re-runs it in the same processes.
    """

    _runtime: Runtime

    def __new__(cls, value: int, runtime: Runtime) -> Step:
        step = super().__new__(cls, value)
        step._runtime = runtime
        return step

    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        return self._runtime._step_raised(exc)


class Runtime:
    """One worker's membership in the job. Create it with ``undying.init()``."""

    def __init__(self) -> None:
        started = time.time()
        env = os.environ
        self.rank = int(env.get("RANK", "0"))
        self.world_size = int(env.get("WORLD_SIZE", "1"))
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.node = int(env.get(ENV_NODE, env.get("GROUP_RANK", "0")))
        self.generation = int(env.get(ENV_GENERATION, "1"))
        self.joining = env.get(ENV_JOINING) == "1"
        self.run_dir = Path(env.get(ENV_RUN_DIR, "runs/standalone"))
        self.spec: JobSpec = spec_from_json(env[ENV_SPEC]) if ENV_SPEC in env else JobSpec()
        self.injections: list[Injection] = decode(env.get(ENV_INJECT))
        self.backend = choose_backend(self.spec.backend)
        self.device = (torch.device("cuda", self.local_rank) if self.backend == "nccl"
                       else torch.device("cpu"))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        controller = env.get(ENV_CONTROLLER)
        self.reporter = Reporter(controller, env.get(ENV_TOKEN, ""), self.rank, self.node, self.generation,
                                 self.spec.heartbeat_interval)
        if controller:
            self._store_address = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
            self.store = connect_store(*self._store_address, self.spec.start_timeout)
        else:
            self._store_address = None
            self.store = torch.distributed.HashStore()
        self.store_prefix = env.get(ENV_STORE_PREFIX, "undying/standalone")
        # The ranks of the current generation in process-group order: all of them, or the ones
        # left after an elastic shrink. ``rank`` stays this process's identity; ``group_rank`` is
        # its place in the group and in the data-parallel split.
        self.members: list[int] = list(range(self.world_size))
        self.group: GenerationGroup | None = None
        if not self.joining:
            self.group = self._build_group(self.generation)
        self.committed_step = 0
        self.models: list[FixedLayoutDDP] = []
        self.optimizers: list[CommitOptimizer] = []
        self.loaders: list[ResumableLoader] = []
        self.statefuls: dict[str, Stateful] = {}
        self._resumed_from: int | None = None
        self.finished = False
        self._has_state = not self.joining  # a replacement holds no training state until repaired
        self._step_failure: str | None = None
        self._voted = False
        self._updated = False
        self._commit_rng: dict[str, Any] = {}
        self._commit_loaders: list[dict[str, Any]] = []
        self.rng_mirror = RngMirror(self._mirror_store(), self.store_prefix, self.rank, self.reporter,
                                    backup_address=lambda: self.reporter.mirror_store)
        self.reporter.emit(ev.WORKER_READY, step=0, seconds=round(time.time() - started, 4),
                           backend=self.backend, pid=os.getpid(), joining=self.joining)

    # ------------------------------------------------------------- user API

    @property
    def is_main(self) -> bool:
        """The first member of the current generation (rank 0 unless an elastic shrink dropped it)."""
        return self.group_rank == 0

    @property
    def group_rank(self) -> int:
        return self.members.index(self.rank)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas in the current generation (``world_size`` unless shrunk)."""
        return len(self.members)

    def wrap_model(self, model: torch.nn.Module) -> FixedLayoutDDP:
        # A replacement rank gets its parameters in the repair step, not by a broadcast
        # the live ranks would not take part in.
        wrapped = FixedLayoutDDP(model.to(self.device), self._current_group, self.device,
                                 broadcast=not self.joining)
        self.models.append(wrapped)
        self._apply_members()
        return wrapped

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> CommitOptimizer:
        wrapped = CommitOptimizer(optimizer, self._sync_all_gradients, self._set_phase,
                                  self._fire_raise_injections_now, self._settle_snapshot)
        self.optimizers.append(wrapped)
        return wrapped

    def dataloader(self, dataset: Any, batch_size: int, seed: int = 0, collate_fn: Any = None) -> ResumableLoader:
        loader = ResumableLoader(dataset, batch_size, seed, self.rank, self.world_size, collate_fn)
        self.loaders.append(loader)
        self._apply_members()
        return loader

    def register(self, name: str, obj: Stateful) -> None:
        """Checkpoint ``obj`` (anything with state_dict/load_state_dict) with the training state."""
        if name in self.statefuls:
            raise ValueError(f"register: name {name!r} is taken")
        self.statefuls[name] = obj

    def log(self, loss: float | None = None) -> None:
        self.reporter.update(loss=loss)

    def steps(self, max_steps: int) -> Iterator[Step]:
        """Yield step numbers from the restored step to ``max_steps - 1``; each yield is one transaction.

        A step whose gradient sync failed (a peer died, a collective timed out, a rank
        voted against it) is not applied by anyone; the runtime then recovers and the
        same step number is yielded again.
        """
        if self.joining:
            self._recover("joining as a replacement rank")
        else:
            self._restore()
        self._mark_commit_boundary()
        step = self.committed_step
        first = True
        while step < max_steps:
            self._begin_step(step)
            yield Step(step, self)
            if self._step_failure is None and not self._updated and self._aborted():
                self._step_failure = "the controller aborted this generation"
            if self._step_failure is not None:
                self._recover(self._step_failure)
                step = self.committed_step
                first = True
                continue
            self.committed_step = step + 1
            if self.spec.sample_log:
                self._log_samples(step)
            self._mark_commit_boundary()
            self.reporter.update(step=self.committed_step, phase=Phase.UPDATED)
            if first and self._resumed_from is not None:
                self.reporter.emit(ev.FIRST_STEP, step=self.committed_step, resumed_from=self._resumed_from)
            first = False
            # T1 snapshot every snapshot_interval steps; T2 every checkpoint.interval, in the background.
            self.checkpoints.at_commit(self.committed_step)
            step += 1
            if self._aborted():
                # The generation ended after every rank had applied this step (e.g. an elastic grow
                # began): the step stands, and the regrouping starts from it.
                self._recover("the controller ended this generation at a step boundary")
                step = self.committed_step
                first = True

    def finish(self, result: dict[str, Any] | None = None) -> None:
        """End of training: rank 0 writes RUN_DIR/result.json; every rank says it is done."""
        if "checkpoints" in self.__dict__:
            self.checkpoints.close()  # the last checkpoint is committed before the job may end
        if self.is_main:
            payload = {"final_step": self.committed_step, "world_size": self.world_size, "replicas": self.replicas,
                       "generation": self.generation, **(result or {})}
            path = self.run_dir / RESULT_FILE
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
            os.replace(tmp, path)
        self.finished = True
        self.reporter.update(phase=Phase.DONE)
        self.reporter.emit(ev.WORKER_DONE, step=self.committed_step)
        self.reporter.close()
        # Interpreter shutdown otherwise spends seconds in a final GC over torch's object graph
        # (measured: ~3 s per worker on these machines); nothing left is garbage worth that.
        gc.freeze()

    # ------------------------------------------------------------- the step transaction

    def _begin_step(self, step: int) -> None:
        self._step_failure = None
        self._voted = False
        self._updated = False
        for loader in self.loaders:
            loader.begin_step()
        self._set_phase(Phase.COMPUTING)
        for injection in self.injections:
            if injection.kind != "raise" and injection.at == "step" and self._claim(injection, step):
                fire(injection)

    def _fire_point_injections(self, point: str, step: int) -> None:
        """Faults aimed at a recovery phase (``at=recovery``, ``at=dump``) rather than a training step."""
        for injection in self.injections:
            if injection.at == point and self._claim(injection, step):
                fire(injection)

    def _fire_raise_injections_now(self) -> None:
        """Called by opt.step(): a ``raise`` injection fires inside the step body even unguarded."""
        step = self.committed_step
        for injection in self.injections:
            if injection.kind == "raise" and injection.at == "step" and self._claim(injection, step):
                fire(injection)

    def _claim(self, injection: Injection, step: int) -> bool:
        if not injection.targets(self.rank, self.node, self.local_rank, step):
            return False
        if not self.reporter.claim_injection(injection.index, step):
            return False
        self.reporter.emit(ev.INJECTION, step=step, spec=injection.text())
        return True

    def _sync_all_gradients(self, vote_ok: bool = True) -> bool:
        """The commit vote: True iff every rank's step succeeded and the gradients are averaged."""
        if self._voted:
            return self._step_failure is None
        incomplete = [loader for loader in self.loaders if loader.step_incomplete()]
        if incomplete and vote_ok:
            loader = incomplete[0]
            raise RuntimeError(
                f"loader: this step took fewer than its {loader.micro_batches} micro-batches; with "
                f"elastic_batch=accumulate a shrunk replica covers several batch slots, so iterate "
                f"`for batch in loader.step_batches():` (or set elastic_batch: grow)")
        self._voted = True
        self._set_phase(Phase.SYNCING)
        if vote_ok:
            self._mirror_rng(self.committed_step + 1)
        try:
            all_ok = all([model.sync_gradients(vote_ok) for model in self.models])
        except CollectiveError as error:
            self._fail_step(f"gradient all-reduce failed: {error}")
            return False
        if not all_ok:
            self._fail_step("a rank voted against this step")
            return False
        self._updated = True
        return True

    def _step_raised(self, error: BaseException | None) -> bool:
        """The ``with step:`` guard saw the body end; True suppresses its exception (the step retries)."""
        if error is None or not isinstance(error, Exception):
            return False
        if self._updated or "retry" not in self.spec.recover_strategy:
            return False
        self._fail_step(f"exception in step: {error!r}")
        if not self._voted:
            # Vote no in the all-reduce the other ranks are waiting in, so nobody applies this step.
            self._sync_all_gradients(vote_ok=False)
        return True

    def _fail_step(self, reason: str) -> None:
        if self._step_failure is None:
            self._step_failure = reason

    def _aborted(self) -> bool:
        return self.reporter.abort_generation >= self.generation

    def _mark_commit_boundary(self) -> None:
        """Remember what a rollback to this committed step needs beyond the (unchanged) model."""
        self._commit_rng = capture_rng()
        self._commit_loaders = [loader.state_dict() for loader in self.loaders]
        self._mirror_rng(self.committed_step, self._commit_rng)

    def _mirror_rng(self, step: int, state: dict[str, Any] | None = None) -> None:
        """Keep this rank's RNG state for ``step`` where a replacement finds it even when this
        process and its node are gone (a few KB per step; runtime/rng_mirror.py)."""
        self.rng_mirror.write(step, rng_to_bytes(state if state is not None else capture_rng()))

    # ------------------------------------------------------------- recovery

    def _build_group(self, generation: int) -> GenerationGroup:
        # Each generation talks to the store over its own connection: a TCPStore client serializes
        # its calls, and an abandoned generation's rendezvous may still block in one.
        store = self.store if self._store_address is None else connect_store(*self._store_address,
                                                                                self.spec.start_timeout)
        return GenerationGroup(store, self.store_prefix, generation, self.group_rank, self.replicas,
                               self.backend, self._collective_deadline(), self.device,
                               should_abort=self._aborted, join_timeout=self.spec.start_timeout)

    def _collective_deadline(self) -> float | None:
        return None if self.spec.watchdog == "off" else self.spec.comm_timeout

    def _current_group(self) -> GenerationGroup:
        if self.group is None:
            raise RuntimeError("no process group: this rank has not joined a generation yet")
        return self.group

    def _recover(self, reason: str) -> None:
        """Leave the failed step, follow the controller's plan, and return at a committed step."""
        started = time.time()
        self._settle_snapshot()  # a repair rewrites the state an overlapped snapshot may still be copying
        self._set_phase(Phase.RECOVERING)
        if self._has_state:
            self.reporter.emit(ev.STEP_FAILED, step=self.committed_step, reason=reason)
        while True:
            if self.group is not None:
                self.group.abandon()
                self.group = None
            plan = self.reporter.wait_for_plan(self.generation, self.committed_step, reason,
                                               newcomer=not self._has_state)
            planned = time.time()
            if plan.action == PlanAction.DUMP:
                self._fire_point_injections("dump", plan.target_step)
                self._dump(plan)
            if plan.action != PlanAction.RESUME:
                self._park(plan)
            if plan.store:
                self._follow_store(plan.store)
            self.generation = plan.generation
            self.reporter.generation = plan.generation
            self.members = list(plan.members) if plan.members else list(range(plan.world_size or self.world_size))
            self._apply_members()
            try:
                self._fire_point_injections("recovery", plan.target_step)
                self.group = self._build_group(plan.generation)
                rebuilt = time.time()
                self._repair(plan)
                break
            except CollectiveError as error:
                reason = f"recovery of generation {plan.generation} failed: {error}"
                self.reporter.emit(ev.STEP_FAILED, step=self.committed_step, reason=reason)
        self._resumed_from = self.committed_step
        self.reporter.update(step=self.committed_step, phase=Phase.COMPUTING)
        self.reporter.emit(ev.RECOVERED, step=self.committed_step, strategy=plan.strategy, pid=os.getpid(),
                           source_rank=plan.source_rank, received=self.rank in plan.receivers,
                           wait_for_plan=round(planned - started, 4), rebuild=round(rebuilt - planned, 4),
                           repair=round(time.time() - rebuilt, 4), total=round(time.time() - started, 4))

    def _mirror_store(self) -> BoundedStore:
        """The RNG mirror's own store connection, every call bounded: a mirror write happens every
        step, and a store whose host froze must not hold the step for ``start_timeout``."""
        if self._store_address is None:
            store = self.store
            return BoundedStore(lambda: store, MIRROR_TIMEOUT_S)
        host, port = self._store_address
        return connect_bounded(host, port, MIRROR_TIMEOUT_S, name="rng mirror store")

    def _follow_store(self, address: str) -> None:
        """Meet the next generation in the store the plan names: after a controller failover it
        is the new controller's (the old one died with its node)."""
        if self._store_address is None:
            return
        host, port = parse_address(address)
        if (host, port) == self._store_address:
            return
        self._store_address = (host, port)
        self.store = connect_store(host, port, self.spec.start_timeout)
        self.rng_mirror.use_store(self._mirror_store())
        self.checkpoints.store_moved()
        self.reporter.emit(ev.STORE_MOVED, step=self.committed_step, store=address)

    def _apply_members(self) -> None:
        """Give the models and loaders this rank's share of the step for the current members: the
        whole job's global batch is kept when there are fewer replicas (elastic training)."""
        slots = self.world_size
        mode = self.spec.elastic_batch
        shrunk = self.replicas < slots
        _, slot_count = replica_slots(self.group_rank, self.replicas, slots)
        for loader in self.loaders:
            if shrunk:
                loader.set_replicas(self.group_rank, self.replicas, mode)
            else:
                loader.reshard(self.rank, slots)
        for model in self.models:
            if shrunk:
                model.set_replica_share(slot_count if mode == "grow" else 1, slots)
            else:
                model.set_replica_share(1, None)

    def _log_samples(self, step: int) -> None:
        """Append the sample indices this rank used in committed ``step`` (``sample_log: true``)."""
        directory = self.run_dir / "samples"
        directory.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"step": step, "rank": self.rank, "group_rank": self.group_rank,
                           "replicas": self.replicas, "generation": self.generation, "time": time.time(),
                           "loss": self.reporter.loss,
                           "loaders": [{"epoch": loader.step_epoch, "indices": loader.step_indices,
                                        "slots": loader.slot_count} for loader in self.loaders]})
        with open(directory / f"rank{self.rank:05d}.jsonl", "a") as log:
            log.write(line + "\n")

    def _park(self, plan: Plan) -> None:
        """Nothing left for this process to do: the controller stops it (job restart or exit)."""
        self.reporter.update(phase=Phase.RECOVERING)
        while True:
            time.sleep(1.0)

    def _repair(self, plan: Plan) -> None:
        """Make this rank hold the state of ``plan.target_step``: from the source replica if listed
        as a receiver, else by rolling back its own step in flight."""
        group = self._current_group()
        if self.rank == plan.source_rank:
            blob = _to_bytes(self._replica_state())
            for receiver in plan.receivers:
                group.send_bytes(blob, self.members.index(receiver))
        if self.rank in plan.receivers:
            received = group.recv_bytes(self.members.index(plan.source_rank))
            self._load_replica_state(_from_bytes(received, self.device))
            self._has_state = True
            rng = self.rng_mirror.read(plan.target_step, fallbacks=plan.rng_stores)
        else:
            for loader, state in zip(self.loaders, self._commit_loaders, strict=True):
                loader.load_state_dict(state)
            rng = self._commit_rng
        if rng:
            restore_rng(rng)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.committed_step = plan.target_step
        self._mark_commit_boundary()

    def _replica_state(self) -> dict[str, Any]:
        """Everything a replica shares, as of the last committed step (the step in flight excluded):
        what a newcomer receives, what a dump writes, and the shared file of a periodic checkpoint."""
        return {
            "committed_step": self.committed_step,
            "models": [model.module.state_dict() for model in self.models],
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "loaders": self._commit_loaders,
            "statefuls": {name: obj.state_dict() for name, obj in self.statefuls.items()},
        }

    def _load_replica_state(self, state: dict[str, Any]) -> None:
        for model, model_state in zip(self.models, state["models"], strict=True):
            model.module.load_state_dict(model_state)
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        for loader, loader_state in zip(self.loaders, state["loaders"], strict=True):
            loader.load_state_dict(loader_state)
        for name, stateful_state in state.get("statefuls", {}).items():
            if name in self.statefuls:
                self.statefuls[name].load_state_dict(stateful_state)
        self.committed_step = state["committed_step"]

    def _dump(self, plan: Plan) -> None:
        """The dying checkpoint: the chosen replica writes the committed state; everyone else waits."""
        if self.rank != plan.source_rank:
            return
        started = time.time()
        step = plan.target_step
        root = self.checkpoint_root
        staging = staging_dir(root, step, plan.generation)
        records = write_shared_shard(staging, {**self._replica_state(), "committed_step": step},
                                     self.checkpoints.param_names())
        members = plan.members or list(range(self.world_size))
        for rank in members:
            records.append(save_object(staging, rank_state_file(rank),
                                       {"rng": self.rng_mirror.read(step, rank, plan.rng_stores), "statefuls": {}}))
        committed = commit(root, staging, step=step, generation=plan.generation, world_size=len(members),
                           files=records, meta={"dump": True, "node": self.node, "members": members},
                           keep=self.spec.checkpoint.keep)
        self.reporter.emit(ev.DUMP_COMMITTED, step=step, path=str(committed.path),
                           seconds=round(time.time() - started, 4), bytes=sum(r.size for r in records))

    # ------------------------------------------------------------- checkpoints

    @property
    def checkpoint_root(self) -> Location:
        return root_location(self.spec.checkpoint.dir) if self.spec.checkpoint.dir else self.run_dir / "checkpoints"

    @functools.cached_property
    def checkpoints(self) -> CheckpointEngine:
        """T1 snapshots and background T2 checkpoints of this worker (runtime/snapshots.py)."""
        return CheckpointEngine(self)

    def _settle_snapshot(self) -> None:
        """Wait for an overlapped T1 snapshot's background copy (before the state changes)."""
        if "checkpoints" in self.__dict__:
            self.checkpoints.settle()

    def _rank_state(self) -> dict[str, Any]:
        """This rank's own part of a snapshot, as of the last commit boundary."""
        return {"rng": self._commit_rng or capture_rng(),
                "statefuls": {name: obj.state_dict() for name, obj in self.statefuls.items()}}

    def _restore(self) -> None:
        """Load the newest state every rank can reach: node memory (T1) or storage (T2)."""
        self.checkpoints.restore()

    # ------------------------------------------------------------- internals

    def _set_phase(self, phase: str) -> None:
        self.reporter.update(phase=phase)


_runtime: Runtime | None = None


def _exit_without_teardown_if_reaping() -> None:
    """atexit: a group abandoned after a fault may still be joining threads stuck on a dead peer;
    tearing the interpreter down under it crashes the process (seen: SIGSEGV after a recovered
    hang). Only after ``finish()``: training is over and its result written, so leave at once with
    exit code 0; a script that failed keeps the normal teardown and its non-zero exit."""
    if _runtime is not None and _runtime.finished and reapers_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _excepthook_then_freeze(previous: Any) -> Any:
    """An uncaught exception ends the worker: print it as usual, then spare the interpreter's final
    garbage collection over torch's objects (seconds on these machines), so the agent sees the
    exit, and the controller the real cause, at once."""

    def hook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        previous(kind, value, traceback)
        sys.stderr.flush()
        gc.freeze()

    return hook


def init() -> Runtime:
    """Join the job this process was started in (or a one-process standalone job)."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
        atexit.register(_exit_without_teardown_if_reaping)
        sys.excepthook = _excepthook_then_freeze(sys.excepthook)
    return _runtime
