"""Background persistence: T1 snapshots become T2 checkpoints on a thread beside the training loop.

Runs in the worker, one ``Persister`` (and one thread) per rank. The training thread pins
a snapshot and submits it; the persister writes it into the checkpoint's staging
directory (under a URL root: the checkpoint's own directory) (rank 0: the shared shard in DCP format; every rank: its own small rank file;
a sharded job: every rank its shards into one DCP checkpoint, checkpoint/dcp_sharded.py),
announces its file records in the job's store, and rank 0's persister (the generation's
first member) commits the checkpoint once every rank's records are there.

Why a thread and not a process: the bytes are already a stable copy in shared memory,
and the work is file writes, fsync, DCP's per-tensor copy and ``zlib.crc32`` over large
buffers, all of which release the GIL; the GIL is held only for DCP's planning and the
pickling of small objects (bench/checkpoint.py measures what that costs the training
thread). Coordination goes through the job's c10d store on the persister's own
connection, never through the training process group, which the training thread is
using at the same time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from undying.checkpoint.dcp_format import UNDYING_KEY, materialize, to_dcp, write_shared_shard
from undying.checkpoint.dcp_sharded import Exchange, ExchangeStore, save_sharded
from undying.checkpoint.snapshot import RankSnapshots
from undying.checkpoint.storage import CheckpointRoot, FileRecord, Location


@dataclass(frozen=True)
class PersistResult:
    """What one persistence job did on this rank (``committed`` only ever on the committing rank)."""

    step: int
    generation: int
    committed: bool
    path: str | None
    seconds: float
    nbytes: int
    error: str | None = None


@dataclass(frozen=True)
class _Job:
    step: int
    generation: int
    members: tuple[int, ...]  # the generation's ranks; the first writes the shared shard and commits
    slot: int
    fault: Callable[[], None] | None


class Persister:
    """Writes pinned T1 snapshots to T2, one job at a time, on a daemon thread.

    Guarantees:

    - A checkpoint is committed (by the generation's first member only, with
      ``storage.commit``: files fsynced, manifest with sizes and CRC-32 renamed into place;
      under a URL root the manifest written last, as one object) only after every member
      published the records of its files for that step and generation; until then it is a
      ``.partial`` directory (URL: a directory without a manifest) that no reader lists.
    - The snapshot being written stays pinned, so the training thread never overwrites it.
    - Jobs run in submission order; ``submit`` returns at once unless the previous job is
      still running, in which case it waits for it (back-pressure: a checkpoint interval
      shorter than the time to persist slows training down rather than piling up pins).

    Not guaranteed: that a job commits. A rank that never publishes (it died, or the job
    moved to a new generation) makes rank 0 give up after ``records_timeout`` seconds and
    leave the staging directory for ``remove_stale_partials``.
    """

    def __init__(self, *, snapshots: RankSnapshots, root: CheckpointRoot | Location, rank: int,
                 store: ExchangeStore, key_prefix: str, keep: int, param_names: list[list[str]],
                 rank_file: str, records_timeout: float, current_generation: Callable[[], int],
                 commit_meta: dict[str, object] | None = None,
                 sharded_state: Callable[[dict[str, Any], dict[str, Any] | None], dict[str, Any]] | None = None,
                 commit_started: Callable[[], None] = lambda: None,
                 ) -> None:
        self.snapshots = snapshots
        self.root = CheckpointRoot.of(root)
        self.rank = rank
        self.store = store
        self.key_prefix = key_prefix
        self.keep = keep
        self.param_names = param_names
        self.rank_file = rank_file
        self.records_timeout = records_timeout
        self.current_generation = current_generation
        self.commit_meta = dict(commit_meta or {})
        # A sharded job: (a snapshot's shards, the coordinator's undying extras or None) -> the DCP
        # state dict every rank saves its part of (checkpoint/dcp_sharded.py). None: data parallel.
        self.sharded_state = sharded_state
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._wake = threading.Event()
        self._pending: _Job | None = None
        self._results: list[PersistResult] = []
        self._closing = False
        self._draining = False  # the process is about to be stopped: no more waiting for missing records
        self.committing = 0  # the step this rank commits, its job in flight (0: none, or not the writer)
        # Called on the persister's thread once ``committing`` is set: the controller must learn soon
        # that a commit is in flight (a job restart then holds its stop orders for it).
        self.commit_started = commit_started
        self._thread = threading.Thread(target=self._run, name="undying-persister", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ training thread

    def submit(self, step: int, generation: int, members: list[int],
               fault: Callable[[], None] | None = None) -> float:
        """Persist the snapshot of ``step`` taken in ``generation``, whose ranks are ``members``;
        returns the seconds spent waiting for the previous job."""
        started = time.perf_counter()
        self._idle.wait()
        waited = time.perf_counter() - started
        slot = self.snapshots.pin(step)
        with self._lock:
            self._pending = _Job(step, generation, tuple(members), slot, fault)
            self._idle.clear()
        self._wake.set()
        return waited

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the submitted job is done; False if ``timeout`` passed first."""
        return self._idle.wait(timeout)

    def results(self) -> list[PersistResult]:
        """Results of finished jobs since the last call (the training thread turns them into events)."""
        with self._lock:
            results, self._results = self._results, []
        return results

    def drain(self, timeout: float) -> bool:
        """This process is about to be stopped (a job restart): the job in flight goes on, but a writer
        waits no longer for records that are not in the store (it gives up: the checkpoint stays
        uncommitted). True once idle, False if ``timeout`` passed first."""
        self._draining = True
        return self._idle.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        self.flush(timeout)
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------ persister thread

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                job, self._pending = self._pending, None
            if job is None:
                if self._closing:
                    return
                continue
            started = time.monotonic()
            self.committing = job.step if self.rank == job.members[0] else 0
            if self.committing:
                self.commit_started()
            try:
                result = self._persist(job, started)
            except Exception as error:  # noqa: BLE001 - reported as a result, the training goes on
                result = PersistResult(job.step, job.generation, False, None, time.monotonic() - started, 0,
                                       f"{type(error).__name__}: {error}")
            except BaseException:
                self._idle.set()  # the thread is going: nobody may wait for it any longer
                raise
            finally:
                self.committing = 0
                self.snapshots.unpin(job.slot)
            with self._lock:
                self._results.append(result)
            self._idle.set()

    def _records_key(self, job: _Job) -> str:
        return f"{self.key_prefix}/persist/g{job.generation}/{job.step}"

    def _persist(self, job: _Job, started: float) -> PersistResult:
        staging = self.root.staging_dir(job.step, job.generation)
        state = self.snapshots.read_slot(job.slot, clone=False)
        records: list[FileRecord] = []
        writer = job.members[0]
        # Every rank's file records (and a sharded job's DCP plans) go to the writer through the store.
        exchange = Exchange(self.store, self._records_key(job), self.rank, list(job.members), self.records_timeout,
                            lambda: self.current_generation() == job.generation and not self._draining)
        rank_state = state["rank"]
        if self.sharded_state is not None:
            # Every rank writes its shards into one DCP checkpoint; the rank file keeps the rest.
            extras = to_dcp(state["replica"], [])[UNDYING_KEY] if self.rank == writer else None
            records += save_sharded(staging, self.sharded_state(rank_state["shards"], extras), exchange, self.root)
            rank_state = {key: value for key, value in rank_state.items() if key != "shards"}
        elif self.rank == writer:
            records += write_shared_shard(staging, state["replica"], self.param_names, self.root)
        if job.fault is not None:
            job.fault()  # an injected fault: the shard is on disk, nothing is committed
        records.append(self.root.save_object(staging, self.rank_file, materialize(rank_state)))
        del state  # views into the pinned slot: gone before the slot is unpinned
        gathered = exchange.gather("records", records)
        if gathered is None:  # not the writer
            return PersistResult(job.step, job.generation, False, None, time.monotonic() - started,
                                 sum(record.size for record in records))
        files = [record for rank_records in gathered for record in rank_records]
        # The manifest's world size is the number of replicas that wrote it (fewer than the job's after
        # an elastic shrink): only then does a restart of the same size restore each rank's RNG.
        committed = self.root.commit(staging, step=job.step, generation=job.generation,
                                     world_size=len(job.members), files=files,
                                     meta={**self.commit_meta, "members": list(job.members)}, keep=self.keep)
        return PersistResult(job.step, job.generation, True, str(committed.path), time.monotonic() - started,
                             sum(record.size for record in files))
