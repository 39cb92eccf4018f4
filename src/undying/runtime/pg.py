"""One process-group generation: a backend group built on a fresh store prefix.

Runs in the worker. Instead of re-initialising torch's global default group, each
generation g builds its own group object on ``PrefixStore(f"{job}/gen{g}", store)``
(as TorchFT does), so a later recovery can drop it and build g+1 without touching
the model. Collectives are issued async and waited with ``comm_timeout``: nothing
interrupts a gloo collective that already blocks the calling thread, but a
bounded ``wait`` does return. Under NCCL the wait polls ``work.is_completed()`` (the future
completes at enqueue), and a collective that times out or is aborted aborts the group's
communicators at once, so no kernel of a dead generation lingers into the next one.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist

from undying._torch_compat.dist import set_backend_timeout
from undying.runtime.reapers import abort_quietly, release_last_references, start_reaper
from undying.store_link import StoreLink

ABORT_POLL_S = 0.05  # how often a waiting collective checks for an abort from the controller
POLL_WAIT = datetime.timedelta(seconds=ABORT_POLL_S)
# A collective waiting this long may be waiting for a peer that is gone (a frozen host keeps its
# connections open): from then on it has the controller asked for its word every so often, so an
# abort reaches it within about ASK_AGAIN_S, not at the heartbeat thread's next beat (heartbeat_interval).
ASK_CONTROLLER_AFTER_S = 0.25
# ... and then this often (the reporter's ASK_MIN_SPACING spaces these asks too).
ASK_AGAIN_S = 0.1
DEVICE_POLL_MIN_S = 0.0001  # NCCL: first pause between polls of a collective's completion on the GPU
DEVICE_POLL_MAX_S = 0.002  # ... doubling up to this
BACKEND_TIMEOUT_S = 1800.0  # the backends' own default (30 minutes), used when watchdog is off
# NCCL's watchdog must not tear the process down (SIGABRT) when a collective times out: our own
# bounded wait reports it and recovery aborts the group. Read by each ProcessGroupNCCL at construction.
NCCL_ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"

# Seconds this process has spent waiting for collectives to complete, over every generation's group:
# a rank's wait for its peers (runtime/step_timing.py tells its own compute from it).
_waited = 0.0


def waited_seconds() -> float:
    """Seconds spent so far in collective waits (``GenerationGroup``'s), by every thread of the process."""
    return _waited


class CollectiveError(RuntimeError):
    """A collective failed or timed out; carries where it happened."""

    def __init__(self, op: str, rank: int, generation: int, cause: BaseException) -> None:
        super().__init__(f"{op} failed on rank {rank} in generation {generation}: {cause}")
        self.op = op
        self.rank = rank
        self.generation = generation
        self.cause_text = str(cause)

    def retold(self) -> CollectiveError:
        """The same error as a fresh object with no traceback or context: one kept to be raised later
        must not keep alive the frames (and through them the dropped group) it was raised through."""
        return CollectiveError(self.op, self.rank, self.generation, RuntimeError(self.cause_text))


def connect_store(host: str, port: int, timeout: float) -> dist.Store:
    """A client connection to the job's TCPStore, through this process's authenticated link to the
    store's gate at (host, port) (store_link.py): the one place a worker connects to the store."""
    local_host, local_port = StoreLink.from_environ().local_end(host, port, timeout)
    return dist.TCPStore(local_host, local_port, is_master=False, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


class GenerationGroup:
    """The collectives of one generation; build a new object for the next one."""

    def __init__(self, store: dist.Store, prefix: str, generation: int, rank: int, world_size: int,
                 backend: str, comm_timeout: float | None, device: torch.device,
                 should_abort: Callable[[], bool] = lambda: False, join_timeout: float = 300.0,
                 ask_controller: Callable[[], None] = lambda: None) -> None:
        self.store = dist.PrefixStore(f"{prefix}/gen{generation}", store)
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        # None: no deadline of ours (watchdog off); the backend's own 30-minute timeout still applies.
        self.comm_timeout_s = comm_timeout
        self.should_abort = should_abort
        self.ask_controller = ask_controller  # a heartbeat now, whose reply may abort this generation
        # The backend's own timeout bounds the rendezvous of a late joiner (a cold replacement needs
        # seconds) and how long an abandoned group's destructor can block its reaper thread.
        backend_timeout = datetime.timedelta(seconds=comm_timeout or BACKEND_TIMEOUT_S)
        self.comm_timeout = datetime.timedelta(seconds=comm_timeout or BACKEND_TIMEOUT_S)
        self._abandoned: list[dist.Work] = []
        self._aborted = False
        self._abort_also: list[Callable[[], None]] = []
        self.group = self._build_abortable(backend, backend_timeout, join_timeout)

    def _build_abortable(self, backend: str, timeout: datetime.timedelta, join_timeout: float) -> dist.ProcessGroup:
        """Construct the group on a helper thread: the constructor blocks until every member has
        connected, and a member that died first must not keep the survivors there."""
        built: list[dist.ProcessGroup] = []
        failure: list[BaseException] = []
        finished = threading.Event()
        given_up = threading.Event()

        def build() -> None:
            try:
                group = self._build(backend, timeout)
                if given_up.is_set():
                    # Built after the waiting thread gave up on it: its NCCL communicators, made by
                    # now, must not outlive the failed generation.
                    abort_quietly(group)
                else:
                    built.append(group)
            except Exception as error:  # noqa: BLE001 - handed to the waiting thread
                failure.append(error)
            finally:
                finished.set()

        threading.Thread(target=build, name="undying-build-group", daemon=True).start()
        deadline = time.monotonic() + join_timeout
        while not finished.wait(ABORT_POLL_S):
            cause: BaseException | None = None
            if self.should_abort():
                cause = RuntimeError("the controller aborted this generation")
            elif time.monotonic() > deadline:
                cause = TimeoutError(f"not every rank joined within {join_timeout:g} s")
            if cause is not None:
                given_up.set()
                raise CollectiveError("build", self.rank, self.generation, cause) from None
        if failure:
            raise CollectiveError("build", self.rank, self.generation, failure[0]) from None
        return built[0]

    def _build(self, backend: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
        # Built with a long timeout so a late joiner (a newcomer importing torch) is waited for;
        # every collective is then bounded by comm_timeout in _wait.
        # The backend object is used directly as the generation's group: it serves every call made on
        # it here (allreduce, broadcast, send, recv), though torch's stubs do not derive it from ProcessGroup.
        if backend == "gloo":
            return cast(dist.ProcessGroup, dist.ProcessGroupGloo(self.store, self.rank, self.world_size, timeout))
        if backend == "nccl":
            os.environ[NCCL_ASYNC_ERROR_HANDLING_ENV] = "0"
            options = dist.ProcessGroupNCCL.Options()
            set_backend_timeout(options, timeout)
            group = dist.ProcessGroupNCCL(self.store, self.rank, self.world_size, options)
            # Make the communicator now, on this builder thread, under the join timeout and the abort
            # flag: lazily, ncclCommInitRank would run inside the first collective on the training
            # thread, where a rank that died meanwhile would leave the others stuck.
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # this thread's current device: the communicator's
            connect = getattr(group, "eager_connect_single_device", None)
            if connect is not None:
                connect(self.device)
            return cast(dist.ProcessGroup, group)
        raise ValueError(f"backend {backend!r}: allowed gloo, nccl")

    def _wait(self, op: str, work: dist.Work) -> None:
        """Wait for ``work`` without ever blocking past comm_timeout or an abort from the controller.

        Nothing interrupts a gloo collective that blocks the calling thread, so we never block in
        it for long: a gloo work is waited in its own ``wait`` bounded to ABORT_POLL_S at a time
        (the backend's thread wakes the waiting one directly when the work completes), a NCCL
        work's future completes when the kernel is enqueued, so there the loop also polls
        ``work.is_completed()``; on timeout or abort the group's communicators are aborted.
        """
        started = time.perf_counter()
        try:
            self._wait_settled(op, work)
        finally:
            global _waited
            _waited += time.perf_counter() - started

    def _wait_settled(self, op: str, work: dist.Work) -> None:
        if work.is_completed():
            # Done already (a bucket's all-reduce that ran during the rest of the backward): no
            # event, callback or helper thread to set up; wait() returns at once or raises its error.
            try:
                work.wait()
            except Exception as error:
                raise CollectiveError(op, self.rank, self.generation, error) from None
            return
        finished = threading.Event()
        failure: list[BaseException] = []
        # gloo: the work's own wait, bounded (torch's ``Work.wait(timeout)``), where the completion
        # wakes this thread at once; a callback on the future would first have to take the GIL on
        # the backend's thread (about 15 us more of this thread's CPU and 0.07-0.18 ms more wall per
        # all-reduce of 4 ranks on 2 cores: bench/studies/collective_wait.py, docs/benchmarks.md).
        bounded = self.backend == "gloo"
        try:
            future = work.get_future()
            if not bounded:
                future.add_done_callback(lambda _: finished.set())
        except RuntimeError:
            # Some works (gloo send/recv) have no future: a helper thread does the blocking wait.
            future, bounded = None, False
            threading.Thread(target=_blocking_wait, args=(work, finished, failure), daemon=True,
                             name="undying-wait").start()
        deadline = None if self.comm_timeout_s is None else time.monotonic() + self.comm_timeout_s
        poll_device = self.backend == "nccl"
        ask_at = time.monotonic() + ASK_CONTROLLER_AFTER_S
        while not (_waited_out(work) if bounded else _settled(work, finished, poll_device)):
            now = time.monotonic()
            if now >= ask_at:
                self.ask_controller()
                ask_at = now + ASK_AGAIN_S
            cause: BaseException | None = None
            if self.should_abort():
                cause = RuntimeError("the controller aborted this generation")
            elif deadline is not None and time.monotonic() > deadline:
                cause = TimeoutError(f"no completion within comm_timeout ({self.comm_timeout_s:g} s)")
            if cause is not None:
                # No local may keep the work (and through it the group) alive: the group must die
                # in the reaper thread, since its destructor joins threads stuck on a dead peer.
                self._abandoned.append(work)
                del work, future
                self.abort_backend()
                raise CollectiveError(op, self.rank, self.generation, cause) from None
        try:
            if poll_device or bounded:
                work.wait()  # completed: returns at once, or raises the collective's error
            elif future is not None:
                future.wait()
            elif failure:
                raise failure[0]
        except Exception as error:
            raise CollectiveError(op, self.rank, self.generation, error) from None

    def allreduce_sum(self, tensor: torch.Tensor) -> None:
        """In-place sum over the generation's ranks."""
        if self.world_size == 1:
            return
        try:
            self._wait("allreduce", self.group.allreduce([tensor]))
        except CollectiveError:
            raise
        except Exception as error:
            raise CollectiveError("allreduce", self.rank, self.generation, error) from None

    def start_allreduce(self, tensor: torch.Tensor) -> dist.Work | None:
        """Start an in-place sum over the generation's ranks; finish it with ``wait_work`` (None: a
        group of one, nothing to wait for). Collectives started this way complete in start order."""
        if self.world_size == 1:
            return None
        try:
            return self.group.allreduce([tensor])
        except Exception as error:
            raise CollectiveError("allreduce", self.rank, self.generation, error) from None

    def wait_work(self, op: str, work: dist.Work) -> None:
        """Wait for a started collective, bounded like every other (comm_timeout, an abort)."""
        try:
            self._wait(op, work)
        except CollectiveError:
            raise
        except Exception as error:
            raise CollectiveError(op, self.rank, self.generation, error) from None

    def abandon_work(self, work: dist.Work) -> None:
        """Give up a started collective without waiting: it is dropped with the group (``abandon``)."""
        self._abandoned.append(work)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        if self.world_size == 1:
            return
        options = dist.BroadcastOptions()
        options.rootRank = root
        try:
            self._wait("broadcast", self.group.broadcast([tensor], options))
        except CollectiveError:
            raise
        except Exception as error:
            raise CollectiveError("broadcast", self.rank, self.generation, error) from None

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Point-to-point: ``tensor`` to group rank ``dst``, matched by the ``recv`` with the same tag."""
        try:
            self._wait("send", self.group.send([tensor], dst, tag))
        except CollectiveError:
            raise
        except Exception as error:
            raise CollectiveError("send", self.rank, self.generation, error) from None

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        """Point-to-point: fill ``tensor`` (its shape and dtype must match the sender's) from ``src``."""
        try:
            self._wait("recv", self.group.recv([tensor], src, tag))
        except CollectiveError:
            raise
        except Exception as error:
            raise CollectiveError("recv", self.rank, self.generation, error) from None

    def gather_objects(self, key: str, value: bytes, timeout: float) -> list[bytes] | None:
        """Every rank hands ``value`` to rank 0 through the store; rank 0 gets them all (in rank order),
        waiting up to ``timeout`` s: the caller's phase decides (a start-up rendezvous waits for ranks
        still importing torch, which ``comm_timeout`` was never meant to cover)."""
        self.store.set(f"{key}/{self.rank}", value)  # type: ignore[arg-type]  # the binding takes bytes; the stub says str
        if self.rank != 0:
            return None
        keys = [f"{key}/{rank}" for rank in range(self.world_size)]
        self.store.wait(keys, datetime.timedelta(seconds=timeout))
        return [self.store.get(k) for k in keys]

    def publish(self, key: str, value: bytes) -> None:
        self.store.set(key, value)  # type: ignore[arg-type]  # the binding takes bytes; the stub says str

    def read(self, key: str, timeout: float) -> bytes:
        """The value another rank published under ``key``, waiting up to ``timeout`` s for it."""
        self.store.wait([key], datetime.timedelta(seconds=timeout))
        return self.store.get(key)

    def abort_backend(self) -> None:
        """Abort the group's NCCL communicators (at most once): a collective stuck on a dead peer
        stops holding the GPU's streams, and the next generation's group starts clean. Gloo has no
        such call; its group dies with its sockets, in ``abandon``."""
        if self.backend != "nccl" or self._aborted or getattr(self.group, "abort", None) is None:
            return
        self._aborted = True
        abort_quietly(self.group)
        for abort_other in self._abort_also:
            abort_other()

    def abort_also(self, abort: Callable[[], None]) -> None:
        """Have ``abort_backend`` also call ``abort`` (a second group of this generation's members;
        ``abort`` swallows its own errors)."""
        self._abort_also.append(abort)

    def shutdown(self) -> None:
        """End of training, every rank done with the group: release its communicators the ordinary
        way (NCCL warns, and may hang at exit, about a group never shut down; gloo needs nothing)."""
        if self.backend == "nccl" and self.group is not None and not self._aborted:
            shutdown = getattr(self.group, "shutdown", None)
            if shutdown is not None:
                shutdown()

    def abandon(self) -> None:
        """Drop this generation's group without blocking: its destructor may wait for its own timeout,
        so the last references go away in a reaper thread. Closing its sockets also makes every
        peer still in one of its collectives fail at once. A NCCL group is aborted first."""
        self.abort_backend()
        doomed: list[object] = [self.group, *self._abandoned]
        self.group = None  # type: ignore[assignment]
        self._abandoned = []
        start_reaper(release_last_references, doomed)


def _settled(work: dist.Work, finished: threading.Event, poll_device: bool) -> bool:
    """Has ``work`` finished? Returns within about ABORT_POLL_S either way, so the caller checks its
    deadline and abort flag that often. With ``poll_device`` (NCCL) the work's future says only that
    it was enqueued; its completion on the GPU is polled, at first often (a step's all-reduce must not
    pay a whole poll period), then every DEVICE_POLL_MAX_S."""
    if not finished.wait(ABORT_POLL_S):
        return False
    if not poll_device:
        return True
    give_up = time.monotonic() + ABORT_POLL_S
    pause = DEVICE_POLL_MIN_S
    while not work.is_completed():
        if time.monotonic() >= give_up:
            return False
        time.sleep(pause)
        pause = min(pause * 2, DEVICE_POLL_MAX_S)
    return True


def _waited_out(work: dist.Work) -> bool:
    """Has ``work`` finished? Waits in the work's own ``wait`` for up to ABORT_POLL_S. A work that
    ends in an error counts as finished: the caller's final ``wait`` raises it."""
    try:
        work.wait(POLL_WAIT)
    except RuntimeError:
        return work.is_completed()  # not completed: the bounded wait timed out
    return True


def _blocking_wait(work: dist.Work, finished: threading.Event, failure: list[BaseException]) -> None:
    try:
        work.wait()
    except Exception as error:  # noqa: BLE001 - handed to the waiting thread, which raises it
        failure.append(error)
    finally:
        finished.set()


def flat_views(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` laid out like ``tensors`` in order (shape of each tensor)."""
    views, offset = [], 0
    for tensor in tensors:
        views.append(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return views
