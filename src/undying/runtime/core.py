"""The worker runtime behind ``undying.init()``: joins the job, runs steps as transactions, checkpoints.

Runs in every worker process. It reads the environment its agent set, connects to
the job's store, builds this generation's process group, and then serves the
user's loop: ``steps()`` restores the newest verified checkpoint, fires injected
faults, commits each step and writes periodic checkpoints atomically.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch

from undying import events as ev
from undying.checkpoint import (
    FileRecord,
    commit,
    latest_verified,
    list_committed,
    load_object,
    remove_stale_partials,
    save_object,
    staging_dir,
)
from undying.config import JobSpec, spec_from_json
from undying.data import ResumableLoader
from undying.inject import Injection, decode, fire
from undying.protocol import (
    ENV_CONTROLLER,
    ENV_GENERATION,
    ENV_INJECT,
    ENV_NODE,
    ENV_RUN_DIR,
    ENV_SPEC,
    ENV_STORE_PREFIX,
    ENV_TOKEN,
    PHASE_CHECKPOINTING,
    PHASE_COMPUTING,
    PHASE_DONE,
    PHASE_UPDATED,
)
from undying.runtime.ddp import FixedLayoutDDP
from undying.runtime.optim import CommitOptimizer
from undying.runtime.pg import GenerationGroup, choose_backend, connect_store
from undying.runtime.reporter import Reporter
from undying.runtime.rng import capture_rng, restore_rng

SHARED_STATE_FILE = "train_state.pt"  # model, optimizer and data position: written once, by rank 0
RESULT_FILE = "result.json"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rank_state_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


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
            store = connect_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), self.spec.start_timeout)
        else:
            store = torch.distributed.HashStore()
        self.group = GenerationGroup(store, env.get(ENV_STORE_PREFIX, "undying/standalone"), self.generation,
                                     self.rank, self.world_size, self.backend, self.spec.comm_timeout,
                                     self.device)
        self.committed_step = 0
        self.models: list[FixedLayoutDDP] = []
        self.optimizers: list[CommitOptimizer] = []
        self.loaders: list[ResumableLoader] = []
        self.statefuls: dict[str, Stateful] = {}
        self._restored_from: int | None = None
        self.reporter.emit(ev.WORKER_READY, step=0, seconds=round(time.time() - started, 4),
                           backend=self.backend, pid=os.getpid())

    # ------------------------------------------------------------- user API

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap_model(self, model: torch.nn.Module) -> FixedLayoutDDP:
        wrapped = FixedLayoutDDP(model.to(self.device), lambda: self.group, self.device)
        self.models.append(wrapped)
        return wrapped

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> CommitOptimizer:
        wrapped = CommitOptimizer(optimizer, self._sync_all_gradients, self._set_phase)
        self.optimizers.append(wrapped)
        return wrapped

    def dataloader(self, dataset: Any, batch_size: int, seed: int = 0, collate_fn: Any = None) -> ResumableLoader:
        loader = ResumableLoader(dataset, batch_size, seed, self.rank, self.world_size, collate_fn)
        self.loaders.append(loader)
        return loader

    def register(self, name: str, obj: Stateful) -> None:
        """Checkpoint ``obj`` (anything with state_dict/load_state_dict) with this rank's state."""
        if name in self.statefuls:
            raise ValueError(f"register: name {name!r} is taken")
        self.statefuls[name] = obj

    def log(self, loss: float | None = None) -> None:
        self.reporter.update(loss=loss)

    def steps(self, max_steps: int) -> Iterator[int]:
        """Yield step numbers from the restored step to ``max_steps - 1``; each yield is one transaction."""
        self._restore()
        step = self.committed_step
        first = True
        while step < max_steps:
            self._set_phase(PHASE_COMPUTING)
            self._fire_injections(step)
            yield step
            self.committed_step = step + 1
            self.reporter.update(step=self.committed_step, phase=PHASE_UPDATED)
            if first and self._restored_from is not None:
                self.reporter.emit(ev.FIRST_STEP, step=self.committed_step, resumed_from=self._restored_from)
            first = False
            if self.committed_step % self.spec.checkpoint.interval == 0:
                self.save_checkpoint()
            step += 1

    def finish(self, result: dict[str, Any] | None = None) -> None:
        """End of training: rank 0 writes RUN_DIR/result.json; every rank says it is done."""
        if self.is_main:
            payload = {"final_step": self.committed_step, "world_size": self.world_size,
                       "generation": self.generation, **(result or {})}
            path = self.run_dir / RESULT_FILE
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
            os.replace(tmp, path)
        self.reporter.update(phase=PHASE_DONE)
        self.reporter.emit(ev.WORKER_DONE, step=self.committed_step)
        self.reporter.close()
        # Interpreter shutdown otherwise spends seconds in a final GC over torch's object graph
        # (measured: ~3 s per worker on these machines); nothing left is garbage worth that.
        gc.freeze()

    # ------------------------------------------------------------- checkpoints

    @property
    def checkpoint_root(self) -> Path:
        return Path(self.spec.checkpoint.dir) if self.spec.checkpoint.dir else self.run_dir / "checkpoints"

    def save_checkpoint(self) -> None:
        """Write this step's state; rank 0 commits it once every rank's files are durable."""
        started = time.time()
        self._set_phase(PHASE_CHECKPOINTING)
        step = self.committed_step
        root = self.checkpoint_root
        staging = staging_dir(root, step, self.generation)
        records: list[FileRecord] = []
        if self.is_main:
            records.append(save_object(staging, SHARED_STATE_FILE, self._shared_state()))
        records.append(save_object(staging, rank_state_file(self.rank), self._rank_state()))
        gathered = self.group.gather_objects(f"ckpt/{step}", json.dumps([asdict(r) for r in records]).encode())
        if gathered is not None:
            files = [FileRecord(**raw) for blob in gathered for raw in json.loads(blob)]
            committed = commit(root, staging, step=step, generation=self.generation, world_size=self.world_size,
                               files=files, meta={"node": self.node}, keep=self.spec.checkpoint.keep)
            self.reporter.emit(ev.CHECKPOINT_SAVE, step=step, path=str(committed.path),
                               seconds=round(time.time() - started, 4), bytes=sum(f.size for f in files))
        self._set_phase(PHASE_UPDATED)

    def _shared_state(self) -> dict[str, Any]:
        return {
            "committed_step": self.committed_step,
            "models": [model.module.state_dict() for model in self.models],
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "loaders": [loader.state_dict() for loader in self.loaders],
        }

    def _rank_state(self) -> dict[str, Any]:
        return {"rng": capture_rng(), "statefuls": {name: obj.state_dict() for name, obj in self.statefuls.items()}}

    def _restore(self) -> None:
        started = time.time()
        root = self.checkpoint_root
        if self.is_main:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(root, self.generation)
            chosen = latest_verified(root, on_corrupt=lambda path, reason: self.reporter.emit(
                ev.CHECKPOINT_CORRUPT, path=str(path), reason=reason))
            self.group.publish("restore_step", str(chosen.step if chosen else -1).encode())
        step = int(self.group.read("restore_step"))
        if step < 0:
            return
        checkpoint = next(c for c in list_committed(root) if c.step == step)
        shared = load_object(checkpoint, SHARED_STATE_FILE, map_location=self.device)
        for model, state in zip(self.models, shared["models"], strict=True):
            model.module.load_state_dict(state)
        for optimizer, state in zip(self.optimizers, shared["optimizers"], strict=True):
            optimizer.load_state_dict(state)
        for loader, state in zip(self.loaders, shared["loaders"], strict=True):
            loader.load_state_dict(state)
        own = rank_state_file(self.rank)
        if checkpoint.manifest.world_size == self.world_size:
            mine = load_object(checkpoint, own)
            restore_rng(mine["rng"])
            for name, state in mine["statefuls"].items():
                if name in self.statefuls:
                    self.statefuls[name].load_state_dict(state)
        self.committed_step = shared["committed_step"]
        self._restored_from = self.committed_step
        self.reporter.update(step=self.committed_step)
        self.reporter.emit(ev.CHECKPOINT_LOAD, step=self.committed_step, path=str(checkpoint.path),
                           source="storage", seconds=round(time.time() - started, 4))

    # ------------------------------------------------------------- internals

    def _set_phase(self, phase: str) -> None:
        self.reporter.update(phase=phase)

    def _sync_all_gradients(self) -> bool:
        return all([model.sync_gradients() for model in self.models])

    def _fire_injections(self, step: int) -> None:
        for injection in self.injections:
            if injection.targets(self.rank, self.node, self.local_rank, step) and \
                    self.reporter.claim_injection(injection.index, step):
                self.reporter.emit(ev.INJECTION, step=step, spec=injection.text())
                fire(injection)


_runtime: Runtime | None = None


def init() -> Runtime:
    """Join the job this process was started in (or a one-process standalone job)."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
    return _runtime
