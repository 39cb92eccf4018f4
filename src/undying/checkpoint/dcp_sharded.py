"""T2 of a sharded job: one torch.distributed.checkpoint (DCP) directory written by every rank, each
its own shards, loadable by plain DCP on any mesh.

Runs in the worker: each rank's persister thread calls ``save_sharded`` for a periodic checkpoint,
and each rank calls ``load_sharded`` at a restore. DCP's own save protocol (every rank plans what it
holds; the coordinator merges the plans, dropping what replicas hold twice, and writes the global
``.metadata`` from every rank's write results) runs over the job's store instead of a process group:
the persister is a background thread, and the training group is the training thread's. The keys
are those of the data-parallel shared shard (checkpoint/dcp_format.py): ``model``, ``optimizer``
(FQN-keyed, as ``get_optimizer_state_dict`` lays it out) and the coordinator's ``undying`` extras;
``dcp.load({"model": model.state_dict()}, checkpoint_id=path)`` loads the weights into a model
sharded any way, or into a plain one.
"""

from __future__ import annotations

import base64
import pickle
import time
from collections.abc import Callable
from typing import Any, Protocol

from undying.checkpoint.dcp_format import DCP_DATA_SUFFIX, DCP_METADATA, plain_error
from undying.checkpoint.dcp_writer import checksummed_writer, records_of
from undying.checkpoint.storage import (
    CheckpointRoot,
    CommittedCheckpoint,
    CorruptCheckpoint,
    FileRecord,
    Location,
    verify_files,
)

EXCHANGE_POLL_S = 0.01  # how often the coordinator looks for the other ranks' values


class ExchangeStore(Protocol):
    """The part of the job's store the exchange uses (a TCPStore client, or a bounded one)."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...


class Exchange:
    """Gather to the coordinator (the first member) and scatter from it through the store, for one
    checkpoint: ``gather`` returns every member's value (member order) at the coordinator and None
    elsewhere. Used for a checkpoint's file records (checkpoint/persister.py, runtime/dying_checkpoint.py)
    and a sharded checkpoint's DCP plans. ``still_wanted`` False, or ``timeout`` s, ends a wait."""

    def __init__(self, store: ExchangeStore, key: str, rank: int, members: list[int], timeout: float,
                 still_wanted: Callable[[], bool]) -> None:
        self.store, self.key, self.rank, self.members = store, key, rank, members
        self.timeout, self.still_wanted = timeout, still_wanted
        self.coordinator = rank == members[0]

    def _wait(self, keys: list[str]) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.store.check(keys):
            if not self.still_wanted():
                raise RuntimeError(f"{self.key}: the generation ended before every rank took part")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.key}: not every rank took part within {self.timeout:g} s")
            time.sleep(EXCHANGE_POLL_S)

    def _put(self, key: str, value: Any) -> None:
        self.store.set(key, base64.b64encode(pickle.dumps(value)).decode())

    def _take(self, key: str) -> Any:
        # Only this job's own ranks write these keys, over the job's token-protected store.
        return pickle.loads(base64.b64decode(self.store.get(key)))  # noqa: S301

    def gather(self, phase: str, value: Any) -> list[Any] | None:
        self._put(f"{self.key}/{phase}/{self.rank}", value)
        if not self.coordinator:
            return None
        keys = [f"{self.key}/{phase}/{member}" for member in self.members]
        self._wait(keys)
        values = [self._take(key) for key in keys]
        for key in keys:
            self.store.delete_key(key)
        return values

    def scatter(self, phase: str, values: list[Any] | None) -> Any:
        """The coordinator hands member i ``values[i]``; every member returns its own."""
        if self.coordinator:
            assert values is not None
            for member, value in zip(self.members, values, strict=True):
                self._put(f"{self.key}/{phase}/to{member}", value)
        mine = f"{self.key}/{phase}/to{self.rank}"
        self._wait([mine])
        value = self._take(mine)
        self.store.delete_key(mine)
        return value


def save_sharded(staging: Location, state_dict: dict[str, Any], exchange: Exchange,
                 root: CheckpointRoot | None = None) -> list[FileRecord]:
    """Write this rank's part of the checkpoint into ``staging`` (the coordinator also the global
    ``.metadata``); return the records of the files this rank wrote, checksummed as they were written
    (one file per rank: the ranks write in parallel already). ``state_dict`` holds DTensors for what
    is sharded (built from local shards, no collective involved)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    root = root or CheckpointRoot.at(staging)  # a caller without a root: the staging directory's backend
    writer, files = checksummed_writer(staging, root.backend)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(),
                           is_coordinator=exchange.coordinator)
    writer.set_up_storage_writer(exchange.coordinator, rank=exchange.rank, use_collectives=True)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    plans = exchange.gather("plan", local_plan)
    metadata = None
    global_plans = None
    if plans is not None:
        global_plans, metadata = planner.create_global_plan(plans)
        global_plans = writer.prepare_global_plan(global_plans)
    final_plan = planner.finish_plan(exchange.scatter("global-plan", global_plans))
    writes = writer.write_data(final_plan, planner)
    writes.wait()
    results = writes.value()
    all_results = exchange.gather("written", results)
    names = sorted({result.storage_data.relative_path for result in results})
    if all_results is not None:
        assert metadata is not None, "the coordinator planned the checkpoint"
        writer.finish(metadata=metadata, results=all_results)
        names.append(DCP_METADATA)
    return records_of(root, staging, files, names)


def reader(ckpt: CommittedCheckpoint) -> Any:
    """DCP's storage reader of ``ckpt``, from the backend of the root that listed it."""
    return ckpt.backend.dcp_reader(ckpt.path)


def verify_sharded(ckpt: CommittedCheckpoint) -> None:
    """Check every DCP file's size and CRC-32 against the manifest (raises CorruptCheckpoint)."""
    verify_files(ckpt, [record.name for record in ckpt.manifest.files
                        if record.name == DCP_METADATA or record.name.endswith(DCP_DATA_SUFFIX)])


def saved_keys(ckpt: CommittedCheckpoint) -> dict[str, Any]:
    """The checkpoint's flattened keys and their metadata (global size for tensors)."""
    return dict(reader(ckpt).read_metadata().state_dict_metadata)


def load_sharded(ckpt: CommittedCheckpoint, targets: dict[str, Any]) -> None:
    """Fill ``targets`` (a state dict of DTensors on this job's mesh and plain tensors) in place from
    ``ckpt``: each rank reads the parts of the saved chunks its own shards cover, whatever the mesh
    that wrote them. Raises CorruptCheckpoint if DCP cannot read them."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(targets, storage_reader=reader(ckpt), no_dist=True)
    except dcp.CheckpointException as error:  # a BaseException: ``except Exception`` would let it through
        raise CorruptCheckpoint(f"{ckpt.path}: sharded DCP checkpoint unreadable ({plain_error(error)!r})") from None
    except Exception as error:  # noqa: BLE001 - any failure to read verified bytes means unusable
        raise CorruptCheckpoint(f"{ckpt.path}: sharded DCP checkpoint unreadable ({error!r})") from error
