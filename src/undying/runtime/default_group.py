"""torch.distributed's default process group, rebuilt with every generation, so that user code and
libraries calling ``dist.all_reduce``, ``dist.barrier``, ``dist.get_rank()`` work under undying.

Runs in the worker. ``Membership.build_group`` installs one beside each generation's training group
(runtime/pg.py) and ``leave_group`` drops it. It is a second group of the same members in the same
order, on its own store prefix (``.../gen{g}/default``): a rank voting on the training group must
never be paired with a peer's user collective.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from undying._torch_compat.dist import default_group_names
from undying._torch_compat.training import import_dynamo
from undying.runtime.pg import ABORT_POLL_S, CollectiveError, GenerationGroup
from undying.runtime.reapers import abort_quietly, await_last_references, start_reaper

STORE_PREFIX = "default"  # under the generation's prefix: keys .../gen{g}/default/...
ALREADY_INITIALIZED = ("torch.distributed is already initialized: undying.init() installs the default "
                       "process group itself and rebuilds it at every recovery; remove the script's "
                       "init_process_group call")


class DefaultGroup:
    """torch's default process group for one generation: ``dist.get_rank()`` is the generation's group
    rank and ``dist.get_world_size()`` its replica count (after an elastic shrink they differ from the
    job's rank and world size).

    Guarantees: a user collective on it ends within the group's ``comm_timeout`` under gloo (with
    an error if a peer is gone); under NCCL its communicators are aborted when the controller aborts
    the generation (a watcher thread) or the training group aborts its own, so a kernel waiting on a
    dead peer returns. ``drop`` never blocks: the old group is taken out of torch's registry at once
    and shut down in a reaper thread, where its last reference goes and its connections close, so
    peers still waiting on this rank fail at once. Not guaranteed: groups the script made from it
    (``dist.new_group``) do not carry over (they are dropped with it); and a failed collective's
    exception the script keeps alive (its traceback holds the group) keeps the group's connections
    open, so peers waiting on this rank then fail by timeout.
    """

    def __init__(self, training: GenerationGroup, should_abort: Callable[[], bool]) -> None:
        self.backend = training.backend
        self.generation = training.generation
        self.rank = training.rank
        global _installed
        if _installed is not None:
            # torch has one default group per process: a newer runtime's (or generation's) replaces it.
            _installed.drop()
        self.group: dist.ProcessGroup | None = _install(training)
        _installed = self
        self._dropped = threading.Event()
        if self.backend == "nccl":
            # A user's NCCL kernel waiting on a dead peer blocks the training thread in a device sync,
            # where no bounded wait of ours runs: the controller's abort reaches it from here.
            threading.Thread(target=self._abort_when_told, args=(should_abort,), daemon=True,
                             name="undying-default-group-watch").start()
            training.abort_also(self.abort)

    def abort(self) -> None:
        """Abort the group's NCCL communicators (gloo has nothing to abort: ``drop`` closes it)."""
        if self.backend == "nccl" and self.group is not None:
            abort_quietly(self.group)

    def drop(self) -> None:
        """Uninstall without blocking (a failed generation): torch forgets the group (and any made from
        it) now; their shutdown, which waits for collectives still pending on a dead peer, happens in a
        reaper thread."""
        if self.group is None:
            return
        self.abort()
        groups = _forget_default_group()
        self._forget()
        start_reaper(_shut_down, groups)

    def destroy(self) -> None:
        """End of training: destroy the group the ordinary way (every rank is done with it)."""
        if self.group is None:
            return
        self._forget()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _forget(self) -> None:
        global _installed
        self._dropped.set()
        self.group = None
        if _installed is self:
            _installed = None

    def _abort_when_told(self, should_abort: Callable[[], bool]) -> None:
        while not self._dropped.wait(ABORT_POLL_S):
            if should_abort():
                self.abort()
                return


_installed: DefaultGroup | None = None  # the one torch holds now (one default group per process)


def _install(training: GenerationGroup) -> dist.ProcessGroup:
    """``init_process_group`` over the generation's store, members and timeout. It returns once every
    member has connected, or raises after the group's timeout: all of them have just built the
    training group, so only a member dying in between keeps the others waiting that long."""
    if dist.is_initialized():
        raise RuntimeError(ALREADY_INITIALIZED)
    # Imported first, while no default group exists: importing torch._dynamo (which the first
    # optimizer a script builds does lazily) keeps ten references to the default group of the
    # moment (measured, torch 2.13), so a dropped one would never be destroyed and its connections,
    # which peers of a failed generation are blocked on, would stay open until comm_timeout.
    import_dynamo()
    # init_process_group wraps sys.excepthook at every call: one recovery after another would stack
    # a rank prefix per generation on every traceback line.
    excepthook = sys.excepthook
    try:
        dist.init_process_group(training.backend, store=dist.PrefixStore(STORE_PREFIX, training.store),
                                rank=training.rank, world_size=training.world_size, timeout=training.comm_timeout)
    except Exception as error:
        raise CollectiveError("build default group", training.rank, training.generation, error) from None
    finally:
        sys.excepthook = excepthook
    group = distributed_c10d.GroupMember.WORLD
    assert group is not None, "init_process_group returned without a default group"
    return group


def _forget_default_group() -> list[dist.ProcessGroup]:
    """Take the default group, and every group made from it, out of torch's registry without
    shutting any down, and return them: the caller hands them to a reaper thread.

    A gloo group's destructor, run where its last reference goes, waits for its pending collectives
    (a stopped peer: up to the group's timeout; measured), and a NCCL group's shutdown can wait on a
    dead peer. ``destroy_process_group()`` drops torch's references and shuts down every group in
    ``distributed_c10d._world.pg_names``; emptying that registry first leaves it only the bookkeeping."""
    if not dist.is_initialized():  # the script destroyed it itself
        return []
    names = default_group_names()
    if names is None:
        raise RuntimeError(f"undying: torch {torch.__version__} has no torch.distributed.distributed_c10d._world"
                           f".pg_names, which undying needs to drop the default process group without "
                           f"blocking; use a torch version in the range pyproject.toml declares")
    groups = list(names)
    names.clear()
    dist.destroy_process_group()
    return groups


def _shut_down(groups: list[dist.ProcessGroup]) -> None:
    # Outlive any reference the training thread may still drop (an exception being unwound).
    await_last_references(groups)
    for group in groups:
        try:
            group.shutdown()
        except Exception:  # noqa: BLE001, S110 - a group of a failed generation, dropped either way
            pass
    groups.clear()
