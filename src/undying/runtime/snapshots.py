"""Worker side of the state tiers: T1 snapshots at step boundaries, T2 persistence in the
background, and the restore that chooses between node memory and storage.

Runs in the worker. ``Runtime`` (runtime/core.py) owns one ``CheckpointEngine``: it calls
``at_commit`` at every commit boundary, ``restore`` when the job (re)starts and ``close``
in ``finish()``. The snapshot files live in the node's shared-memory directory, which
the node's agent owns (undying/shm.py); a standalone run (no agent) snapshots into
private memory instead.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from undying import events as ev
from undying.checkpoint import (
    CommittedCheckpoint,
    CorruptCheckpoint,
    Location,
    latest_verified,
    list_committed,
    load_object,
    make_root,
    remove_stale_partials,
)
from undying.checkpoint.copy import updated_only_by
from undying.checkpoint.dcp_format import is_dcp_shard, optimizer_param_names, read_shared_shard
from undying.checkpoint.persister import Persister, PersistResult
from undying.checkpoint.snapshot import RankSnapshots, SnapshotUnavailable, flatten_state, unflatten_state
from undying.inject import fire
from undying.protocol import ENV_JOB_ID
from undying.runtime.bounded_store import BoundedStore, connect_bounded
from undying.runtime.pg import GenerationGroup
from undying.runtime.rng import restore_rng
from undying.shm import node_dir

if TYPE_CHECKING:
    from undying.runtime.core import Runtime

LEGACY_SHARED_FILE = "train_state.pt"  # the shared shard before the DCP format (still loadable)
SOURCE_MEMORY = "memory"
SOURCE_STORAGE = "storage"
RECORDS_TIMEOUT_MIN_S = 60.0  # rank 0 waits at least this long for the other ranks' file records
PERSIST_STORE_TIMEOUT_S = 10.0  # the persister's store connection: per call, not for the records wait


def rank_state_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def broadcast_state(group: GenerationGroup, state: Any, src: int, device: torch.device) -> Any:
    """``state`` (nested dicts/lists with tensors) from rank ``src`` to every rank of ``group``:
    the skeleton as pickled bytes, then each tensor with the backend's own broadcast (no
    serialization of the tensor data; with NCCL the tensors travel on the device)."""
    if group.rank == src:
        skeleton, tensors = flatten_state(state)
        meta = pickle.dumps((skeleton, [(t.dtype, tuple(t.shape)) for t in tensors]),
                            protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(meta)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    group.broadcast(size, src)
    if group.rank == src:
        payload = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.broadcast(payload, src)
    if group.rank == src:
        tensors = [tensor.to(device).contiguous() for tensor in tensors]
    else:
        # Only bytes this job's own rank ``src`` sent over the job's process group.
        skeleton, layout = pickle.loads(payload.cpu().numpy().tobytes())  # noqa: S301
        tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in layout]
    for tensor in tensors:
        if tensor.numel():
            group.broadcast(tensor, src)
    return unflatten_state(skeleton, tensors)


class CheckpointEngine:
    """T1 + T2 for one worker.

    Guarantees:

    - At every ``snapshot_interval``-th committed step (and at every checkpoint step) the
      rank's committed state is copied into its T1 slots; the training thread stalls for
      that copy only, and with ``checkpoint.overlap`` only for the part that the next step
      could change before its optimizer step (the rest overlaps that step's forward,
      backward and gradient sync; ``settle`` waits for it). At every ``interval``-th step
      the snapshot also goes to T2 in the background (rank 0 writes the shared shard, each
      rank its rank file).
    - ``restore`` makes every rank hold the same step: the newest step that every rank holds
      in T1, if it is not older than the newest verified T2 checkpoint, else that T2
      checkpoint (read by rank 0 only, sent to the others over the process group), else
      nothing (a fresh start). A T2 checkpoint that fails verification or does not parse is
      reported (``checkpoint_corrupt``) and the next older one is tried.

    Not guaranteed: T1 after the node's death or across a change of world size (both fall
    back to T2).
    """

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.spec = runtime.spec.checkpoint
        self._persister: Persister | None = None
        self._param_names: list[list[str]] | None = None
        self._stalls: dict[int, float] = {}  # checkpoint step -> its snapshot's seconds, until reported
        self._waited: dict[int, float] = {}  # step -> seconds its save waited for the previous one
        self._copying: int | None = None  # the step of an overlapped snapshot whose copy may still run
        self._stall = 0.0  # the training thread's seconds for the latest snapshot
        self.last_stall = 0.0  # ... once settled: what the latest snapshot cost the training thread
        self._reported_pageable = False
        job_id = os.environ.get(ENV_JOB_ID)
        # Only under an agent (which sets the job id) does someone own a node shared-memory
        # directory; a standalone run snapshots into private memory.
        self.directory: Path | None = node_dir(job_id, runtime.node) if job_id else None
        try:
            self.snapshots = RankSnapshots(self.directory, runtime.rank, self.spec.snapshot_slots)
        except (OSError, SnapshotUnavailable) as error:
            self._fall_back_to_private_memory(error)

    # ------------------------------------------------------------- at each commit (training thread)

    def at_commit(self, step: int) -> None:
        """Snapshot and/or persist as the knobs say, and report finished persistence jobs."""
        if step % self.spec.interval == 0:
            self.save(step)
        elif self.spec.snapshot_interval and step % self.spec.snapshot_interval == 0:
            self.snapshot(step)
        self._report_results()

    def snapshot(self, step: int) -> bool:
        """Copy the committed state into T1; False if every other slot was pinned (skipped).

        With ``checkpoint.overlap``, the parameters and optimizer state of the wrapped optimizers
        are copied in the background (only their ``step()`` changes them, and it waits for the
        copy: ``settle``); everything else (buffers, RNG, loaders, user state) is copied now."""
        state = {"replica": self.rt._replica_state(), "rank": self.rt._rank_state()}
        defer = updated_only_by(self.rt.optimizers) if self._overlapped() else None
        try:
            info = self.snapshots.write(state, step=step, generation=self.rt.generation,
                                        world_size=self.rt.replicas, defer=defer)
        except SnapshotUnavailable as error:
            self._fall_back_to_private_memory(error)
            info = self.snapshots.write(state, step=step, generation=self.rt.generation,
                                        world_size=self.rt.replicas, defer=defer)
        if info is not None:
            self._copying = step
            self._stall = self.snapshots.last_copy_seconds
        if self.snapshots.page_lock_error is not None and not self._reported_pageable:
            self._reported_pageable = True
            self.rt.reporter.emit(ev.SNAPSHOT_PAGEABLE, step=step, reason=self.snapshots.page_lock_error)
        return info is not None

    def _overlapped(self) -> bool:
        """``checkpoint.overlap``; ``auto``: on where the state lives on a device (its copy engines
        move the bytes beside the compute), off on CPU (the copy would take the training's cores)."""
        mode = self.spec.overlap
        return mode == "on" or (mode == "auto" and self.rt.device.type != "cpu")

    def settle(self) -> None:
        """Before anything changes the parameters or optimizer state (an optimizer step, a
        recovery, the end): wait for an overlapped snapshot's copy to finish. Its stall (the
        training thread's part of the copy plus this wait) is what ``checkpoint_save`` reports."""
        if self._copying is None:
            return
        step, self._copying = self._copying, None
        self._stall += self.snapshots.wait()
        self.last_stall = self._stall
        if step in self._stalls:
            self._stalls[step] = self._stall

    def save(self, step: int) -> None:
        """Snapshot ``step`` and hand it to the persister (T2), which writes and commits it in the background."""
        persister = self._ensure_persister()
        waited_started = time.perf_counter()
        persister.flush()  # back-pressure: the previous checkpoint is still being written
        self.snapshots.wait_reserved()  # right after the first snapshots: a slot still being allocated
        self._waited[step] = time.perf_counter() - waited_started
        if not self.snapshot(step):
            raise RuntimeError(f"no free snapshot slot for checkpoint step {step}")  # nothing is pinned now
        self._stalls[step] = self._stall  # the training thread's part so far; settle adds its wait
        persister.submit(step, self.rt.generation, list(self.rt.members), self._persist_fault(step))

    def _persist_fault(self, step: int) -> Callable[[], None] | None:
        """An ``at=persist`` injection aimed at this step, claimed now (the persister thread must not
        talk to the controller on the training thread's connection), fired mid-write."""
        for injection in self.rt.injections:
            if injection.at == "persist" and self.rt._claim(injection, step):
                return lambda: fire(injection)
        return None

    def _report_results(self) -> None:
        if self._persister is None:
            return
        for result in self._persister.results():
            self._report(result)

    def _report(self, result: PersistResult) -> None:
        stall = self._stalls.pop(result.step, None)
        waited = self._waited.pop(result.step, 0.0)
        if result.error is not None:
            self.rt.reporter.emit(ev.PERSIST_FAILED, step=result.step, reason=result.error,
                                  seconds=round(result.seconds, 4))
        elif result.committed:
            self.rt.reporter.emit(ev.CHECKPOINT_SAVE, step=result.step, path=result.path,
                                  seconds=round(result.seconds, 4), bytes=result.nbytes,
                                  stall=None if stall is None else round(stall, 6), waited=round(waited, 4),
                                  snapshots_skipped=self.snapshots.skipped)

    def store_moved(self) -> None:
        """The job's store moved (controller failover): the persister exchanges records in the new one."""
        rt = self.rt
        if self._persister is not None and rt._store_address is not None:
            self._persister.store = self._persister_store()

    def _ensure_persister(self) -> Persister:
        if self._persister is None:
            rt = self.rt
            # Its own store connection: a TCPStore client serializes its calls, and the training
            # thread's RNG mirror must never queue behind the persister's wait for records.
            self._persister = Persister(
                snapshots=self.snapshots, root=rt.checkpoint_root, rank=rt.rank,
                store=self._persister_store(), key_prefix=rt.store_prefix, keep=self.spec.keep,
                param_names=self.param_names(),
                rank_file=rank_state_file(rt.rank),
                records_timeout=max(RECORDS_TIMEOUT_MIN_S, 2 * rt.spec.comm_timeout),
                current_generation=lambda: self.rt.generation, commit_meta={"node": rt.node})
        return self._persister

    def _persister_store(self) -> torch.distributed.Store | BoundedStore:
        rt = self.rt
        if rt._store_address is None:
            return rt.store
        # Each store call answers in milliseconds; the bound caps what a store whose host froze
        # costs: that persist fails (persist_failed) and the next one uses the moved store.
        # Connected on the persister thread's first call, never on the training thread.
        host, port = rt._store_address
        return connect_bounded(host, port, PERSIST_STORE_TIMEOUT_S, name="persister store")

    def param_names(self) -> list[list[str]]:
        """For each optimizer, the FQN of each parameter in its state_dict order (the DCP keys)."""
        if self._param_names is None:
            modules = [model.module for model in self.rt.models]
            self._param_names = [optimizer_param_names(optimizer, modules) for optimizer in self.rt.optimizers]
        return self._param_names

    def _fall_back_to_private_memory(self, error: BaseException) -> None:
        self.rt.reporter.emit(ev.SNAPSHOT_UNAVAILABLE, reason=str(error), directory=str(self.directory))
        if self._persister is not None:
            self._persister.close()
            self._persister = None
        self.directory = None
        self.snapshots = RankSnapshots(None, self.rt.rank, self.spec.snapshot_slots)

    def close(self) -> None:
        """End of training: wait for the last checkpoint to be committed, report it, release memory."""
        self.settle()
        if self._persister is not None:
            self._persister.close()
            self._report_results()
        self.snapshots.close()

    # ------------------------------------------------------------- restore (every rank, at start)

    def restore(self) -> None:
        """Load the newest state every rank can reach (see the class docstring) and report it."""
        rt = self.rt
        started = time.time()
        group = rt._current_group()
        held = [info.step for info in self.snapshots.committed() if info.world_size == rt.world_size]
        gathered = group.gather_objects("restore/t1", json.dumps(held).encode())
        loaded: dict[str, Any] | None = None
        if gathered is not None:
            plan, loaded = self._choose([set(json.loads(blob)) for blob in gathered])
            group.publish("restore_plan", json.dumps(plan).encode())
        plan = json.loads(group.read("restore_plan"))
        source, step = plan["source"], plan["step"]
        if source == SOURCE_MEMORY:
            # Into the live tensors where they exist (the model's parameters; optimizer state once it
            # has stepped): a restore allocates only what the process does not hold yet.
            state = self.snapshots.read(step, live={"replica": rt._replica_state()})
            rt._load_replica_state(state["replica"])
            self._load_rank_state(state["rank"])
            self.snapshots.invalidate(keep_step=step)
            details: dict[str, Any] = {"path": None if self.directory is None else str(self.directory),
                                       "dump": False}
        elif source == SOURCE_STORAGE:
            rt._load_replica_state(broadcast_state(group, loaded, 0, rt.device))
            checkpoint = next(c for c in list_committed(rt.checkpoint_root) if c.step == step)
            if checkpoint.manifest.world_size == rt.world_size:
                self._load_rank_state(load_object(checkpoint, rank_state_file(rt.rank)))
            self.snapshots.invalidate()
            details = {"path": str(checkpoint.path), "dump": bool(checkpoint.manifest.meta.get("dump"))}
        else:
            self.snapshots.invalidate()
            return
        rt._resumed_from = rt.committed_step
        rt.reporter.update(step=rt.committed_step)
        rt.reporter.emit(ev.CHECKPOINT_LOAD, step=rt.committed_step, source=source,
                         seconds=round(time.time() - started, 4), **details)

    def _choose(self, held: list[set[int]]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Rank 0: the plan every rank follows, and (for storage) the shared shard it already read."""
        root = self.rt.checkpoint_root
        make_root(root)
        remove_stale_partials(root, self.rt.generation)
        memory_step = max(set.intersection(*held), default=-1) if held else -1
        listed = list_committed(root)
        if memory_step >= 0 and (not listed or memory_step >= listed[0].step):
            return {"source": SOURCE_MEMORY, "step": memory_step}, None  # T2 need not even be read

        def corrupt(path: Location, reason: str) -> None:
            self.rt.reporter.emit(ev.CHECKPOINT_CORRUPT, path=str(path), reason=reason)

        older_than: int | None = None
        while True:
            checkpoint = latest_verified(root, on_corrupt=corrupt, older_than=older_than)
            if checkpoint is None or memory_step >= checkpoint.step:
                if memory_step >= 0:
                    return {"source": SOURCE_MEMORY, "step": memory_step}, None
                return {"source": "none", "step": -1}, None
            try:
                return {"source": SOURCE_STORAGE, "step": checkpoint.step}, self._read_shard(checkpoint)
            except CorruptCheckpoint as error:
                corrupt(checkpoint.path, str(error))
                older_than = checkpoint.step

    def _read_shard(self, checkpoint: CommittedCheckpoint) -> dict[str, Any]:
        if is_dcp_shard(checkpoint):
            state = read_shared_shard(checkpoint, verified=True)  # latest_verified just checked every file
        else:
            state = load_object(checkpoint, LEGACY_SHARED_FILE)
        state["committed_step"] = checkpoint.step
        return state

    def _load_rank_state(self, state: dict[str, Any]) -> None:
        if state.get("rng"):
            restore_rng(state["rng"])
        for name, stateful_state in state.get("statefuls", {}).items():
            if name in self.rt.statefuls:
                self.rt.statefuls[name].load_state_dict(stateful_state)
