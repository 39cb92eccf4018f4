"""Worker side of the state tiers: T1 snapshots at step boundaries, T2 persistence in the
background, and the restore from node memory or storage (runtime/start_restore.py).

Runs in the worker. ``Runtime`` (runtime/core.py) owns one ``CheckpointEngine`` and gives it
the ``TrainingState`` to save and load; the step loop (runtime/step_loop.py) calls ``at_commit``
at every commit boundary and ``restore`` when the job (re)starts, ``finish()`` calls ``close``. The snapshot files live in
the node's shared-memory directory, which the node's agent owns (undying/shm.py); a standalone
run (no agent) snapshots into private memory instead.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from undying import events as ev
from undying.checkpoint import CheckpointRoot
from undying.checkpoint.copy import updated_only_by
from undying.checkpoint.dcp_format import optimizer_param_names
from undying.checkpoint.manifest import NUMERICS_KEY, rank_state_file
from undying.checkpoint.node_replica import PART, REPLICA, NodeReplica, replica_part
from undying.checkpoint.persister import Persister, PersistResult
from undying.checkpoint.snapshot import RankSnapshots, SnapshotUnavailable
from undying.config import JobSpec
from undying.config.model import SNAPSHOT_INTERVAL_AUTO
from undying.runtime.bounded_store import BoundedStore, connect_bounded
from undying.runtime.devices import numerics_record
from undying.runtime.injection_points import InjectionPoints
from undying.runtime.membership import Membership
from undying.runtime.peer_copies import PeerCopies
from undying.runtime.reporter import Reporter
from undying.runtime.sharded_checkpoint import DcpLayout
from undying.runtime.snapshot_cadence import SnapshotCadence
from undying.runtime.start_restore import restore_at_start
from undying.runtime.training_state import TrainingState
from undying.shm import node_dir

RECORDS_TIMEOUT_MIN_S = 60.0  # rank 0 waits at least this long for the other ranks' file records
PERSIST_STORE_TIMEOUT_S = 10.0  # the persister's store connection: per call, not for the records wait


def checkpoint_root(spec: JobSpec, run_dir: Path) -> CheckpointRoot:
    """Where T2 checkpoints go: ``checkpoint.dir`` (a path or URL), else the run directory's; built
    once per worker, with the storage backend every checkpoint operation of the worker uses."""
    return CheckpointRoot.at(spec.checkpoint.dir or run_dir / "checkpoints")


class CheckpointEngine:
    """T1 + T2 for one worker.

    Guarantees:

    - At every ``snapshot_interval``-th committed step (and at every checkpoint step) the
      rank's committed state is copied into its T1 slots (``auto``: the interval in force,
      the same on every rank, runtime/snapshot_cadence.py); the training thread stalls for
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
    - Every T2 checkpoint's manifest records the numerics its committing rank ran under
      (``meta.numerics``: runtime/devices.py ``numerics_record``); a restore from one by ranks
      whose numerics differ goes on and is reported once (``numerics_changed``, by rank 0).

    Not guaranteed: T1 after the node's death or across a change of world size (both fall
    back to T2). The replica state of a T2 checkpoint loads at any size (the data position is
    global, ``TrainingState.apply_members`` splits the step); each rank's own part (RNG, registered
    objects) only when the checkpoint was written by the same members.
    """

    def __init__(self, spec: JobSpec, state: TrainingState, membership: Membership, reporter: Reporter,
                 injections: InjectionPoints, root: CheckpointRoot, job_id: str | None, token: str = "") -> None:
        self.spec = spec.checkpoint
        self._deterministic = spec.deterministic
        self._nproc_per_node = spec.nproc_per_node
        self._node_t1: NodeReplica | None = None
        self._numerics: dict[str, Any] | None = None
        self._records_timeout = max(RECORDS_TIMEOUT_MIN_S, 2 * spec.comm_timeout)
        # The restore at start is a start-up rendezvous: ranks may still be importing torch, and rank 0
        # reads T2 before it publishes the plan; start_timeout is the allowance for both.
        self.restore_timeout = spec.start_timeout
        self.state = state
        self.membership = membership
        self.reporter = reporter
        self.injections = injections
        self.root = root
        self._persister: Persister | None = None
        self._param_names: list[list[str]] | None = None
        self._sharded_layout: DcpLayout | None = None  # a sharded job's T2 layout (``dcp_layout``)
        self._stalls: dict[int, float] = {}  # checkpoint step -> its snapshot's seconds, until reported
        self._waited: dict[int, float] = {}  # step -> seconds its save waited for the previous one
        self._submitted: tuple[int, int] | None = None  # (step, generation) last handed to the persister
        self._copying: int | None = None  # the step of an overlapped snapshot whose copy may still run
        self._stall = 0.0  # the training thread's seconds for the latest snapshot
        self.last_stall = 0.0  # ... once settled: what the latest snapshot cost the training thread
        self._reported_pageable = False
        # Only under an agent (which sets the job id) does someone own a node shared-memory
        # directory; a standalone run snapshots into private memory.
        self.directory: Path | None = node_dir(job_id, membership.node) if job_id else None
        self._snapshots: RankSnapshots | None = None
        # snapshot_interval: a number of steps, or auto: chosen as the job runs, the same on every rank.
        auto = self.spec.snapshot_interval == SNAPSHOT_INTERVAL_AUTO
        self._fixed_interval = 0 if auto else int(self.spec.snapshot_interval)
        self._cadence = SnapshotCadence.for_job(self.spec, membership) if auto else None
        self._timed_snapshot: tuple[int, float, float] | None = None  # step, call's seconds, the copy's part
        # checkpoint.peer_copy: each snapshot also kept in another node's memory (runtime/peer_copy.py).
        self.peer = PeerCopies(spec, membership, reporter, job_id, token, lambda: self.snapshots)

    @property
    def snapshots(self) -> RankSnapshots:
        """This rank's T1 slots, opened on first use (a process that never trains opens none)."""
        if self._snapshots is None:
            try:
                self._snapshots = RankSnapshots(self.directory, self.membership.rank,
                                                self.peer.slots(self.spec.snapshot_slots))
            except (OSError, SnapshotUnavailable) as error:
                self._fall_back_to_private_memory(error)
        assert self._snapshots is not None
        return self._snapshots

    @property
    def numerics(self) -> dict[str, Any]:
        """This rank's numerics record (runtime/devices.py), taken at the first restore or save: by
        then the script has set its threads and device."""
        if self._numerics is None:
            self._numerics = numerics_record(self._deterministic, self.membership.backend, self.membership.device)
        return self._numerics

    # ------------------------------------------------------------- at each commit (training thread)

    def at_commit(self, step: int) -> None:
        """Snapshot and/or persist as the knobs say, and report finished persistence jobs."""
        if self._cadence is not None:
            timed, self._timed_snapshot = self._timed_snapshot, None
            self._cadence.pace(step, self.membership, self.reporter, self.spec.interval, timed,
                               copying=self._copying is not None, last_stall=self.last_stall)
        if step % self.spec.interval == 0:
            if self.spec.persist:
                self.save(step)
            else:
                self.snapshot(step)
        elif self._cadence is not None and self._cadence.due(step):
            started = time.perf_counter()
            if self.snapshot(step):
                self._timed_snapshot = (step, time.perf_counter() - started, self._stall)
        elif self._fixed_interval and step % self._fixed_interval == 0:
            self.snapshot(step)
        self.peer.report(step)
        self._report_results()

    def snapshot(self, step: int, whole: bool = False) -> bool:
        """Copy the committed state into T1; False if every other slot was pinned (skipped).

        A data-parallel job with several ranks per node keeps the replica state once per node: this
        rank copies its part of it (checkpoint/node_replica.py), or with ``whole`` all of it (the T2
        writer, at a checkpoint step). With ``checkpoint.overlap``, the parameters and optimizer
        state of the wrapped optimizers are copied in the background (only their ``step()`` changes
        them, and it waits for the copy: ``settle``); everything else (buffers, RNG, loaders, user
        state) is copied now."""
        replica, local_ranks = self.state.replica_state(), self.node_t1().local_ranks
        if len(local_ranks) == 1 or whole:
            state = {REPLICA: replica, "rank": self.state.rank_state()}
        else:
            part = replica_part(replica, local_ranks.index(self.membership.rank), len(local_ranks))
            state = {PART: part, "rank": self.state.rank_state()}
        defer = updated_only_by(self.state.optimizers) if self._overlapped() else None
        generation, replicas = self.membership.generation, self.membership.replicas
        try:
            info = self.snapshots.write(state, step=step, generation=generation, world_size=replicas, defer=defer)
        except SnapshotUnavailable as error:
            self._fall_back_to_private_memory(error)
            info = self.snapshots.write(state, step=step, generation=generation, world_size=replicas, defer=defer)
        if info is not None:
            self._copying = step
            self._stall = self.snapshots.last_copy_seconds
            self.peer.after_snapshot(step)
        if self.snapshots.page_lock_error is not None and not self._reported_pageable:
            self._reported_pageable = True
            self.reporter.emit(ev.SNAPSHOT_PAGEABLE, step=step, reason=self.snapshots.page_lock_error)
        return info is not None

    def _overlapped(self) -> bool:
        """``checkpoint.overlap``; ``auto``: on where the state lives on a device (its copy engines
        move the bytes beside the compute), off on CPU (the copy would take the training's cores)."""
        mode = self.spec.overlap
        return mode == "on" or (mode == "auto" and self.membership.device.type != "cpu")

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
        # The writer of the shared shard persists from its own slot alone: the whole replica there.
        if not self.snapshot(step, whole=self.membership.rank == self.membership.members[0]):
            raise RuntimeError(f"no free snapshot slot for checkpoint step {step}")  # nothing is pinned now
        self._stalls[step] = self._stall  # the training thread's part so far; settle adds its wait
        persister.submit(step, self.membership.generation, list(self.membership.members),
                         self.injections.persist_fault(step))
        self._submitted = (step, self.membership.generation)

    def persist_now(self, step: int) -> None:
        """The job stops: write the T2 checkpoint of committed ``step`` (every rank its part, as at a
        checkpoint step) and wait until it is done and reported. A checkpoint step's periodic
        checkpoint is already in the persister's hands on every rank (each submits it at the commit):
        it is the one waited for, never written a second time into the same partial directory."""
        self.settle()
        if self._submitted != (step, self.membership.generation):
            self.save(step)
        persister = self._ensure_persister()
        persister.flush()
        self._report_results()

    def committing_step(self) -> int:
        """The step whose T2 checkpoint this rank commits, its persister busy with it (0: none)."""
        return self._persister.committing if self._persister is not None else 0

    def finish_commit(self, timeout: float) -> None:
        """This process is about to be stopped (a job restart): a commit whose records are all in
        finishes first (at most ``timeout`` s; ``Persister.drain``), and its outcome is reported."""
        if self._persister is not None and self._persister.drain(timeout):
            self._report_results()

    def _report_results(self) -> None:
        if self._persister is None:
            return
        for result in self._persister.results():
            self._report(result)

    def _report(self, result: PersistResult) -> None:
        stall = self._stalls.pop(result.step, None)
        waited = self._waited.pop(result.step, 0.0)
        if result.error is not None:
            self.reporter.emit(ev.PERSIST_FAILED, step=result.step, reason=result.error,
                                  seconds=round(result.seconds, 4))
        elif result.committed:
            self.reporter.emit(ev.CHECKPOINT_SAVE, step=result.step, path=result.path,
                                  seconds=round(result.seconds, 4), bytes=result.nbytes,
                                  stall=None if stall is None else round(stall, 6), waited=round(waited, 4),
                                  snapshots_skipped=self.snapshots.skipped)

    def store_moved(self) -> None:
        """The job's store moved (controller failover): the persister exchanges records in the new one."""
        if self._persister is not None and self.membership.store_address is not None:
            self._persister.store = self._persister_store()
        self.peer.store_moved()

    def _ensure_persister(self) -> Persister:
        if self._persister is None:
            membership = self.membership
            # Its own store connection: a TCPStore client serializes its calls, and the training
            # thread's RNG mirror must never queue behind the persister's wait for records.
            self._persister = Persister(
                snapshots=self.snapshots, root=self.root, rank=membership.rank,
                store=self._persister_store(), key_prefix=membership.store_prefix, keep=self.spec.keep,
                param_names=self.param_names(),
                rank_file=rank_state_file(membership.rank),
                records_timeout=self._records_timeout,
                current_generation=lambda: membership.generation,
                commit_meta={"node": membership.node, NUMERICS_KEY: self.numerics},
                sharded_state=self.dcp_layout().state_dict if self.state.sharded else None,
                commit_started=self.reporter.beat_now)  # the controller learns of the commit in flight now
        return self._persister

    def dcp_layout(self) -> DcpLayout:
        """A sharded job's DCP keys and placements, taken once from the live models."""
        if self._sharded_layout is None:
            self._sharded_layout = DcpLayout([model.module for model in self.state.models],
                                             list(self.state.optimizers))
        return self._sharded_layout

    def _persister_store(self) -> torch.distributed.Store | BoundedStore:
        address = self.membership.store_address
        if address is None:
            return self.membership.store
        # Each store call answers in milliseconds; the bound caps what a store whose host froze
        # costs: that persist fails (persist_failed) and the next one uses the moved store.
        # Connected on the persister thread's first call, never on the training thread.
        host, port = address
        return connect_bounded(host, port, PERSIST_STORE_TIMEOUT_S, name="persister store")

    def param_names(self) -> list[list[str]]:
        """For each optimizer, the FQN of each parameter in its state_dict order (the DCP keys)."""
        if self.state.sharded:
            return []  # a sharded job's models and optimizers are in the rank files, not the shared shard
        if self._param_names is None:
            modules = [model.module for model in self.state.models]
            self._param_names = [optimizer_param_names(optimizer, modules) for optimizer in self.state.optimizers]
        return self._param_names

    def node_t1(self) -> NodeReplica:
        """This rank's reader of its node's T1: the node's local ranks when they keep a data-parallel
        replica once per node (two or more per node, node shared memory, not sharded), else itself."""
        count, rank = self._nproc_per_node, self.membership.rank
        first = self.membership.node * count
        shared = not self.state.sharded and self.directory is not None and count > 1 and first <= rank < first + count
        ranks = range(first, first + count) if shared else [rank]
        if self._node_t1 is None or self._node_t1.own is not self.snapshots or self._node_t1.local_ranks != list(ranks):
            self._node_t1 = NodeReplica(self.directory, self.snapshots, ranks, self.spec.snapshot_slots)
        return self._node_t1

    def load_t1(self, step: int) -> None:
        """Load the node's T1 snapshot of ``step`` into the training state: the replica part and this
        rank's own (RNG, registered objects, a sharded job's shards), as a restart from T1 does."""
        training = self.state
        state = self.node_t1().read(step, live={REPLICA: training.replica_state(), "rank": training.rank_state()})
        training.load_replica_state(state[REPLICA])
        training.load_rank_state(state["rank"])

    def restore(self) -> bool:
        """Load the newest state every rank can reach (see the class docstring) and report it; False
        when there was none (a fresh start). Every rank calls it when the job (re)starts
        (runtime/start_restore.py)."""
        return restore_at_start(self)

    def _fall_back_to_private_memory(self, error: BaseException) -> None:
        self.reporter.emit(ev.SNAPSHOT_UNAVAILABLE, reason=str(error), directory=str(self.directory))
        if self._persister is not None:
            self._persister.close()
            self._persister = None
        self.directory = None
        self._snapshots = RankSnapshots(None, self.membership.rank, self.peer.slots(self.spec.snapshot_slots))

    def close(self) -> None:
        """End of training: wait for the last checkpoint to be committed, report it, release memory."""
        self.settle()
        self.peer.close()
        if self._persister is not None:
            self._persister.close()
            self._report_results()
            if self.membership.group_rank == 0:
                self._remove_dead_staging()
        if self._snapshots is not None:
            self._snapshots.close()

    def _remove_dead_staging(self) -> None:
        """The staging directories that generations ended by a fault left (a writer killed mid-write,
        a commit given up when its generation ended) and no restore removed since (a recovery that
        keeps the processes does not restore). None can still be committed: a generation's writer gives
        its commit up once a newer generation exists (checkpoint/persister.py). The current
        generation's directories are left alone: this rank, its committer, has finished its last job,
        but another rank may still be closing."""
        try:
            self.root.remove_stale_partials(self.membership.generation)
        except OSError as error:
            print(f"undying: rank {self.membership.rank}: could not remove unfinished checkpoint directories "
                  f"under {self.root}: {error}", file=sys.stderr, flush=True)
