"""torch.distributed's default group under undying (runtime/default_group.py): installed with each
generation's group, with the generation's rank and size, replaced at every regroup, dropped without
waiting for a collective stuck on a peer, destroyed at the end; a script's own init is refused."""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from undying.config import JobSpec
from undying.runtime import default_group
from undying.runtime.core import Runtime
from undying.runtime.default_group import ALREADY_INITIALIZED, DefaultGroup
from undying.runtime.pg import GenerationGroup
from undying.runtime.reapers import await_last_references
from undying.worker_env import WorkerEnv

CPU = torch.device("cpu")
PREFIX = "undying/test"
LONG_TIMEOUT_S = 60.0  # no collective here may end by timing out


@pytest.fixture(autouse=True)
def no_default_group_left() -> Iterator[None]:
    yield
    installed = default_group._installed
    if installed is not None:
        installed.drop()
    if dist.is_initialized():
        dist.destroy_process_group()


def generation(store: dist.Store, number: int, rank: int = 0, world_size: int = 1) -> GenerationGroup:
    return GenerationGroup(store, PREFIX, number, rank, world_size, "gloo", LONG_TIMEOUT_S, CPU)


def test_each_generation_installs_its_own_default_group_and_drops_the_last() -> None:
    store = dist.HashStore()
    hook = sys.excepthook
    previous = None
    for number in (1, 2, 3):
        installed = DefaultGroup(generation(store, number), should_abort=lambda: False)
        assert dist.is_initialized() and installed.group is dist.group.WORLD
        assert installed.group is not previous
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")
        value = torch.tensor([3.0])
        dist.all_reduce(value)
        dist.barrier()
        assert value.item() == 3.0
        # init_process_group wraps sys.excepthook each time: one wrapper per generation would pile up.
        assert sys.excepthook is hook
        previous = installed.group
        installed.drop()
        assert not dist.is_initialized() and installed.group is None


def test_a_scripts_own_init_process_group_is_refused_in_one_line() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(RuntimeError) as refused:
        DefaultGroup(generation(dist.HashStore(), 1), should_abort=lambda: False)
    assert str(refused.value) == ALREADY_INITIALIZED and "\n" not in ALREADY_INITIALIZED


def test_missing_torch_internals_are_named_when_dropping(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = DefaultGroup(generation(dist.HashStore(), 1), should_abort=lambda: False)
    # A torch whose registry is shaped otherwise: it has a default group but no pg_names.
    monkeypatch.setattr(distributed_c10d, "_world", SimpleNamespace(default_pg=dist.group.WORLD))
    with pytest.raises(RuntimeError) as missing:
        installed.drop()
    assert "_world.pg_names" in str(missing.value) and torch.__version__ in str(missing.value)


def test_drop_does_not_wait_for_a_collective_pending_on_a_silent_peer() -> None:
    """Rank 0's user all_reduce waits for rank 1, which never joins it (a stopped peer): dropping the
    group returns at once and leaves the work to the reaper, where it is still pending."""
    store = dist.HashStore()
    peer: dict[str, Any] = {}

    def peer_rank() -> None:
        peer["training"] = generation(store, 1, rank=1, world_size=2)
        # What init_process_group builds on rank 1: torch prefixes the keys with the default group's
        # name, "0" (the first group after a destroy_process_group), then with the device type.
        keys = dist.PrefixStore("cpu/", dist.PrefixStore("0/", dist.PrefixStore(default_group.STORE_PREFIX,
                                                                               peer["training"].store)))
        peer["default"] = dist.ProcessGroupGloo(keys, 1, 2, datetime.timedelta(seconds=LONG_TIMEOUT_S))

    thread = threading.Thread(target=peer_rank)
    thread.start()
    installed = DefaultGroup(generation(store, 1, rank=0, world_size=2), should_abort=lambda: False)
    thread.join()
    assert dist.get_world_size() == 2
    value = torch.tensor([1.0])
    work = dist.all_reduce(value, async_op=True)
    assert work is not None
    installed.drop()
    assert not dist.is_initialized()
    # Had the group's last reference gone here, its destructor would have waited for the work (timeout).
    assert not work.is_completed()
    peer["default"].allreduce([torch.tensor([2.0])]).wait()  # the peer wakes up: the work completes
    work.wait()
    assert value.item() == 3.0


def test_the_runtime_installs_it_regroups_it_and_destroys_it_at_the_end(tmp_path: Path) -> None:
    runtime = Runtime(WorkerEnv(spec=JobSpec(), run_dir=tmp_path))
    membership = runtime.membership
    assert dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size()) == (runtime.group_rank, runtime.replicas)
    first = dist.group.WORLD
    membership.leave_group()
    assert not dist.is_initialized()
    membership.generation += 1
    membership.build_group()
    assert dist.is_initialized() and dist.group.WORLD is not first
    membership.close()
    assert not dist.is_initialized() and membership.default_group is None


def test_a_newer_runtime_in_the_same_process_replaces_the_default_group(tmp_path: Path) -> None:
    Runtime(WorkerEnv(spec=JobSpec(), run_dir=tmp_path / "a"))
    first = dist.group.WORLD
    Runtime(WorkerEnv(spec=JobSpec(), run_dir=tmp_path / "b"))
    assert dist.is_initialized() and dist.group.WORLD is not first


def test_a_reaper_lets_a_dropped_group_go_once_it_holds_the_last_reference() -> None:
    """A reaper waits while the training thread still holds the dropped group (an exception being
    unwound) and lets it go as soon as it holds the only reference, not a fixed pause later, so that
    peers blocked in the group's collectives fail at the drop. A reference never dropped is waited
    for only up to the limit."""
    group = dist.HashStore()  # any object the reaper is handed
    training_thread = {"frames": group}
    doomed: list[object] = [group]
    del group
    released = threading.Event()

    def unwind() -> None:
        training_thread.clear()
        released.set()

    threading.Timer(0.3, unwind).start()
    started = time.monotonic()
    await_last_references(doomed, limit=LONG_TIMEOUT_S)
    assert released.is_set()
    assert time.monotonic() - started < LONG_TIMEOUT_S / 2

    kept = doomed[0]
    started = time.monotonic()
    await_last_references(doomed, limit=0.2)
    assert time.monotonic() - started >= 0.2 and kept is doomed[0]
