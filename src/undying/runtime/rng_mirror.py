"""The per-step RNG mirror: where a replacement finds the exact RNG state of the rank it replaces.

Runs in the worker. At every commit boundary (and just before each vote) a rank writes
its encoded RNG state for that step to the job's store, keeping the last few steps; while an
elastic job is shrunk, also the streams of the batch slots it covers for other ranks, each under
that rank's key (runtime/slot_rng.py), and its own only while it covers its own slot. The next
step's state is written on the mirror's own thread (``start_write_rng``) from the moment the step's
last forward ends (while the steps draw random numbers: runtime/step_transaction.py), so the store's
round trip overlaps the backward pass, and the rank votes for the
step only once it is stored (``wait``): a rank lost right after the vote, whose peers apply the
step, is replaced with its RNG as of that step (runtime/step_transaction.py). The
store lives in the controller's process; in a failover job (``--etcd``) the controller's
node may die with it, so the rank also writes to a *backup store* (another node's
controller candidate, named in heartbeat replies). Reading tries the current store,
then the stores a plan lists (the previous controller's store and its backup). A store
that stops answering never fails a step: the mirror is best effort, and a missing one is
an ``rng_not_mirrored`` event (the replacement then keeps its own RNG state). Every store
call is bounded (runtime/bounded_store.py): a store whose host froze costs a step at most
a few seconds, once.

Only a change is written. A step whose state is the one last mirrored (a script that draws no
random number in its steps: no dropout, no random augmentation) costs no store trip and no trip
to the mirror's thread: the key of the step where the state last changed holds it for every step
since. Each rank's key also lists, under ``.../index``, the steps whose keys it keeps (the last
``KEEP`` changes), written in the same trip as each change; a reader asking for a step without a
key of its own takes the newest listed step not after it. This holds because a rank writes (or
finds unchanged) its state at every commit boundary before it votes: between two listed steps
the state did not change.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from undying import events as ev
from undying.client import parse_address
from undying.runtime.bounded_store import BoundedStore, connect_bounded
from undying.runtime.event_sink import EventSink
from undying.runtime.rng import capture_rng, rng_from_bytes, rng_to_bytes, same_rng

KEEP = 3  # changes of mirrored RNG state kept per rank (each under the step where it was first seen)
MIRROR_TIMEOUT_S = 5.0  # the job store: a write takes milliseconds unless its host froze
BACKUP_TIMEOUT_S = 2.0  # a backup store that does not answer within this is dropped
ABANDON_POLL_S = 0.05  # how often a wait for the mirror asks whether to give it up


def bounded(address: str, timeout: float) -> BoundedStore:
    return connect_bounded(*parse_address(address), timeout, name=f"store {address}")


class Chain:
    """What one store holds of the mirrored states: per rank key, the steps whose keys it keeps
    (oldest first) and the state under the newest of them. Touched only by the thread that writes
    (the mirror's thread), or by the training thread while no write is in flight."""

    def __init__(self) -> None:
        self.steps: dict[int, list[int]] = {}
        self.latest: dict[int, bytes] = {}

    def unchanged(self, step: int, data: Mapping[int, bytes]) -> bool:
        """Does the store already hold ``data`` as the state of ``step`` for every rank in it?"""
        return all(self.latest.get(rank) == value and self.steps[rank][-1] <= step for rank, value in data.items())

    def plan(self, step: int, data: Mapping[int, bytes], key: Callable[[int, int], str],
             known_steps: Callable[[int], list[int]]) -> tuple[dict[str, bytes], list[str], dict[int, list[int]]]:
        """The keys to set, the keys to delete and each written rank's new list of kept steps, for
        mirroring ``data`` as the states of ``step``. ``known_steps(rank)``: the steps another writer
        listed for that rank, asked the first time this chain writes it. Steps after ``step`` (a step
        given up and begun again) are dropped from the list, and their keys deleted."""
        entries: dict[str, bytes] = {}
        stale: list[str] = []
        kept: dict[int, list[int]] = {}
        for rank, value in data.items():
            if rank in self.latest and self.latest[rank] == value and self.steps[rank][-1] <= step:
                continue
            before = self.steps[rank] if rank in self.steps else known_steps(rank)
            steps = [*(earlier for earlier in before if earlier < step), step][-KEEP:]
            stale += [key(gone, rank) for gone in before if gone not in steps]
            entries[key(step, rank)] = value
            entries[index_key(key, rank)] = ",".join(map(str, steps)).encode()
            kept[rank] = steps
        return entries, stale, kept

    def apply(self, data: Mapping[int, bytes], kept: dict[int, list[int]]) -> None:
        for rank, steps in kept.items():
            self.steps[rank] = steps
            self.latest[rank] = data[rank]


def index_key(key: Callable[[int, int], str], rank: int) -> str:
    """The key listing the steps whose keys hold ``rank``'s mirrored states: beside them."""
    return key(0, rank).rsplit("/", 1)[0] + "/index"


def parse_index(raw: bytes) -> list[int]:
    return [int(step) for step in raw.decode().split(",") if step]


class RngMirror:
    """One rank's RNG mirror in the job's store (and a backup store, in failover jobs)."""

    def __init__(self, store: BoundedStore, prefix: str, rank: int, reporter: EventSink,
                 backup_address: Callable[[], str] = lambda: "") -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.reporter = reporter
        self.backup_address = backup_address
        self._chain = Chain()  # what the job's store holds
        self._backup_chain = Chain()  # what the backup store holds
        self._store_lost = False
        self._backup: tuple[str, BoundedStore | None] = ("", None)  # (address, client; None once it failed)
        self._writes: queue.SimpleQueue[tuple[int, dict[int, bytes], threading.Event]] = queue.SimpleQueue()
        self._written: threading.Event | None = None  # the write in flight on the mirror's thread
        self._writer: threading.Thread | None = None
        # rng_not_mirrored events of the mirror's thread, sent by the training thread (``wait``): the
        # reporter's connection to the controller is not shared between threads.
        self._events: list[dict[str, Any]] = []
        # By key rank: the last state encoded and its bytes (``_encoded``).
        self._last_encoded: dict[int, tuple[dict[str, Any], bytes]] = {}

    def key(self, step: int, rank: int | None = None) -> str:
        return f"{self.prefix}/rng/{self.rank if rank is None else rank}/{step}"

    def use_store(self, store: BoundedStore) -> None:
        """The job's store moved (controller failover): mirror into the new one from now on. A write
        still in flight is stuck on the old store (its host froze): its thread finishes it (bounded)
        and is left behind, its outcome ignored; the new store's writes get a thread of their own."""
        if self._written is not None and not self._written.is_set():
            self._writer, self._writes, self._written = None, queue.SimpleQueue(), None
        else:
            self.wait()
        self.store = store
        self._store_lost = False
        self._chain = Chain()

    def forget_written(self, abandon: Callable[[], bool] | None = None) -> None:
        """After a recovery: another process may have written this rank's keys meanwhile (the coverer
        of its slot while the job was shrunk), so the next write of each key starts from what the
        store lists, not from what this process last wrote there. ``abandon``: as for ``wait``."""
        self.wait(abandon)
        self._chain, self._backup_chain = Chain(), Chain()

    def write_rng(self, step: int, states: Mapping[int, dict[str, Any]] | None = None,
                  abandon: Callable[[], bool] | None = None) -> None:
        """Mirror ``states`` (rank whose key -> RNG state; by default this rank's RNG state now) as the
        states of ``step``. ``abandon``: as for ``wait``."""
        self.start_write_rng(step, states)
        self.wait(abandon)

    def start_write_rng(self, step: int, states: Mapping[int, dict[str, Any]] | None = None) -> bool:
        """Like ``write_rng``, but the write runs on the mirror's thread: the states are captured now,
        and ``wait`` returns once they are in the store (or found unreachable). False when there was
        nothing to write (the store holds these states already, or is lost until the next plan)."""
        states = states if states is not None else {self.rank: capture_rng()}
        data = {rank: self._encoded(rank, state) for rank, state in states.items()}
        if self._written is None or self._written.is_set():
            self.wait()  # returns at once; after it, the chains and _store_lost are the writer thread's final word
            if self._store_lost or self._nothing_to_write(step, data):
                return False  # the state did not change (the commit boundary's is usually the vote's): no trip
        # Else a write is still in flight (a slow or frozen store): this one queues behind it, not
        # waited for here, and the writer skips it if it turns out to be the same.
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_forever, args=(self._writes,),
                                            name="undying-rng-mirror", daemon=True)
            self._writer.start()
        self._written = threading.Event()
        self._writes.put((step, data, self._written))
        return True

    def _encoded(self, rank: int, state: dict[str, Any]) -> bytes:
        """``state`` encoded for the store; the last encoding of ``rank``'s key again when its state
        has not changed since (the common case: most steps draw nothing between two writes)."""
        last = self._last_encoded.get(rank)
        if last is not None and same_rng(last[0], state):
            return last[1]
        data = rng_to_bytes(state)
        self._last_encoded[rank] = (state, data)
        return data

    def wait(self, abandon: Callable[[], bool] | None = None) -> bool:
        """Until the write in flight is over (True). Every store call of it is bounded, so this is too.
        ``abandon``: asked while waiting; once it says so, False at once (the write goes on on the
        mirror's thread): the controller aborted the generation, whose store may be frozen with it."""
        if self._written is not None:
            while not self._written.wait(ABANDON_POLL_S if abandon is not None else None):
                if abandon is not None and abandon():
                    return False
            self._written = None
        while self._events:
            self.reporter.emit(ev.RNG_NOT_MIRRORED, **self._events.pop(0))
        return True

    def _write_forever(self, writes: queue.SimpleQueue[tuple[int, dict[int, bytes], threading.Event]]) -> None:
        while True:
            step, data, written = writes.get()
            try:
                self.write(step, data)
            except Exception as error:  # noqa: BLE001 - best effort, like an unreachable store
                self._events.append({"step": step, "key": self.key(step), "reason": repr(error)[:200]})
            finally:
                written.set()

    def _nothing_to_write(self, step: int, data: Mapping[int, bytes]) -> bool:
        """Do the job's store and the backup store (where there is one) already hold ``data`` for ``step``?"""
        if not self._chain.unchanged(step, data):
            return False
        backup_address, backup = self._backup
        return (backup is None or self._backup_chain.unchanged(step, data)) and self.backup_address() == backup_address

    def write(self, step: int, data: dict[int, bytes]) -> None:
        if self._store_lost:
            return  # the store is gone until the next plan names a new one
        store = self.store
        entries, stale, kept = self._chain.plan(step, data, self.key, lambda rank: _steps_listed_before(store, self.key, rank))
        written = not entries or _put(store, entries, stale)
        if store is not self.store:
            return  # left behind by a move of the store (use_store) while it was stuck: moot
        if not written:
            # The store went with its controller's node (failover): the step itself stands; the
            # next plan names the new store.
            self._store_lost = True
            self._events.append({"step": step, "key": self.key(step), "reason": "store unreachable"})
            return
        self._chain.apply(data, kept)
        address = self.backup_address()
        if address != self._backup[0]:
            self._backup = (address, bounded(address, BACKUP_TIMEOUT_S) if address else None)
            self._backup_chain = Chain()
        backup = self._backup[1]
        if backup is None:
            return
        entries, stale, kept = self._backup_chain.plan(step, data, self.key, lambda rank: [])
        if entries and not _put(backup, entries, stale):
            self._events.append({"step": step, "key": self.key(step),
                                 "reason": f"backup store {address} unreachable"})
            self._backup = (address, None)
            return
        self._backup_chain.apply(data, kept)

    def read(self, step: int, rank: int | None = None, fallbacks: list[str] | None = None) -> dict[str, Any]:
        self.wait()
        key = self.key(step, rank)
        rank = self.rank if rank is None else rank
        for store in [self.store, *(bounded(address, MIRROR_TIMEOUT_S) for address in fallbacks or [])]:
            try:
                if store.check([key]):
                    return rng_from_bytes(store.get(key))
                # No change at ``step`` itself: the newest listed change before it holds its state.
                earlier = [listed for listed in _listed_steps(store, self.key, rank) if listed < step]
                if earlier and store.check([self.key(earlier[-1], rank)]):
                    return rng_from_bytes(store.get(self.key(earlier[-1], rank)))
            except (RuntimeError, OSError):
                continue
        self.reporter.emit(ev.RNG_NOT_MIRRORED, step=step, key=key, tried=1 + len(fallbacks or []))
        return {}


def _listed_steps(store: BoundedStore | dist.Store, key: Callable[[int, int], str], rank: int) -> list[int]:
    """The steps a store's index lists for ``rank`` (oldest first; none when it has no index)."""
    index = index_key(key, rank)
    return parse_index(store.get(index)) if store.check([index]) else []


def _steps_listed_before(store: BoundedStore | dist.Store, key: Callable[[int, int], str], rank: int) -> list[int]:
    """``_listed_steps``, or none where the store does not answer (the write that follows fails too)."""
    try:
        return _listed_steps(store, key, rank)
    except (RuntimeError, OSError):
        return []


def _put(store: BoundedStore | dist.Store, entries: dict[str, bytes], stale: list[str]) -> bool:
    def put(client: BoundedStore | dist.Store) -> None:
        multi_set = getattr(client, "multi_set", None)
        if multi_set is not None and len(entries) > 1:
            multi_set(list(entries), list(entries.values()))  # one round trip for the state and its index
        else:
            for key, data in entries.items():
                client.set(key, data)  # type: ignore[arg-type]  # the binding takes bytes; the stub says str
        for key in stale:
            client.delete_key(key)

    try:
        if isinstance(store, BoundedStore):
            store.run(put)  # every call in one trip to the store client's thread
        else:
            put(store)
    except (RuntimeError, OSError):
        return False
    return True
