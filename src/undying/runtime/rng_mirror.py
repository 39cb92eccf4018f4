"""The per-step RNG mirror: where a replacement finds the exact RNG state of the rank it replaces.

Runs in the worker. At every commit boundary (and just before each vote) a rank writes
its encoded RNG state for that step to the job's store, keeping the last few steps. The
store lives in the controller's process; in a failover job (``--etcd``) the controller's
node may die with it, so the rank also writes to a *backup store* (another node's
controller candidate, named in heartbeat replies). Reading tries the current store,
then the stores a plan lists (the previous controller's store and its backup). A store
that stops answering never fails a step: the mirror is best effort, and a missing one is
an ``rng_not_mirrored`` event (the replacement then keeps its own RNG state). Every store
call is bounded (runtime/bounded_store.py): a store whose host froze costs a step at most
a few seconds, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from undying import events as ev
from undying.client import parse_address
from undying.runtime.bounded_store import BoundedStore, connect_bounded
from undying.runtime.reporter import Reporter
from undying.runtime.rng import capture_rng, rng_from_bytes, rng_to_bytes

KEEP = 3  # steps of mirrored RNG state kept per rank
MIRROR_TIMEOUT_S = 5.0  # the job store: a write takes milliseconds unless its host froze
BACKUP_TIMEOUT_S = 2.0  # a backup store that does not answer within this is dropped


def bounded(address: str, timeout: float) -> BoundedStore:
    return connect_bounded(*parse_address(address), timeout, name=f"store {address}")


class RngMirror:
    """One rank's RNG mirror in the job's store (and a backup store, in failover jobs)."""

    def __init__(self, store: BoundedStore, prefix: str, rank: int, reporter: Reporter,
                 backup_address: Callable[[], str] = lambda: "") -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.reporter = reporter
        self.backup_address = backup_address
        self._last: tuple[int, bytes] = (-1, b"")  # (step, encoded RNG) last written
        self._store_lost = False
        self._backup: tuple[str, BoundedStore | None] = ("", None)  # (address, client; None once it failed)

    def key(self, step: int, rank: int | None = None) -> str:
        return f"{self.prefix}/rng/{self.rank if rank is None else rank}/{step}"

    def use_store(self, store: BoundedStore) -> None:
        """The job's store moved (controller failover): mirror into the new one from now on."""
        self.store = store
        self._store_lost = False
        self._last = (-1, b"")

    def write_rng(self, step: int, state: dict[str, Any] | None = None) -> None:
        """Mirror ``state`` (by default this process's RNG state now) as the state of ``step``."""
        self.write(step, rng_to_bytes(state if state is not None else capture_rng()))

    def write(self, step: int, data: bytes) -> None:
        if self._last == (step, data) or self._store_lost:
            return  # already mirrored; or the store is gone until the next plan names a new one
        stale = self.key(step - KEEP) if self._last[0] != step and step - KEEP >= 0 else None
        if not _put(self.store, self.key(step), data, stale):
            # The store went with its controller's node (failover): the step itself stands; the
            # next plan names the new store.
            self._store_lost = True
            self.reporter.emit(ev.RNG_NOT_MIRRORED, step=step, key=self.key(step), reason="store unreachable")
            return
        address = self.backup_address()
        if address != self._backup[0]:
            self._backup = (address, bounded(address, BACKUP_TIMEOUT_S) if address else None)
        backup = self._backup[1]
        if backup is not None and not _put(backup, self.key(step), data, stale):
            self.reporter.emit(ev.RNG_NOT_MIRRORED, step=step, key=self.key(step),
                               reason=f"backup store {address} unreachable")
            self._backup = (address, None)
        self._last = (step, data)

    def read(self, step: int, rank: int | None = None, fallbacks: list[str] | None = None) -> dict[str, Any]:
        key = self.key(step, rank)
        for store in [self.store, *(bounded(address, MIRROR_TIMEOUT_S) for address in fallbacks or [])]:
            try:
                if store.check([key]):
                    return rng_from_bytes(store.get(key))
            except (RuntimeError, OSError):
                continue
        self.reporter.emit(ev.RNG_NOT_MIRRORED, step=step, key=key, tried=1 + len(fallbacks or []))
        return {}


def _put(store: BoundedStore | dist.Store, key: str, data: bytes, stale: str | None) -> bool:
    try:
        store.set(key, data)  # type: ignore[arg-type]  # the binding takes bytes; the stub says str
        if stale is not None:
            store.delete_key(stale)
    except (RuntimeError, OSError):
        return False
    return True
