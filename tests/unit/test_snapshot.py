"""T1 snapshots: bitwise round trip, torn writes never visible, no reallocation, pins, shared-memory cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import OrderedDict, namedtuple
from pathlib import Path

import pytest
import torch

from undying import shm
from undying.checkpoint import copy as copy_module
from undying.checkpoint.snapshot import STATE_WRITING, RankSnapshots, flatten_state, unflatten_state

REPO = Path(__file__).resolve().parents[2]
Pair = namedtuple("Pair", "left right")


def training_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 16)).sum().backward()
    optimizer.step()
    return {
        "replica": {"committed_step": 7, "models": [model.state_dict()], "optimizers": [optimizer.state_dict()],
                    "loaders": [{"epoch": 1, "position": 48, "seed": 0, "dataset_len": 100}],
                    "statefuls": {"counter": {"value": torch.tensor([3, 4]), "pair": Pair(1, torch.ones(2))}}},
        "rank": {"rng": {"torch": torch.get_rng_state(), "python": (3, (1, 2), None)}, "statefuls": {}},
    }


def assert_same(left: object, right: object) -> None:
    """Equal structure and types, tensors bitwise equal with the same dtype and shape."""
    assert type(left) is type(right), (type(left), type(right))
    if isinstance(left, torch.Tensor):
        assert left.dtype == right.dtype and left.shape == right.shape
        assert torch.equal(left, right)
    elif isinstance(left, dict):
        assert list(left) == list(right)
        assert getattr(left, "_metadata", None) == getattr(right, "_metadata", None)
        for key in left:
            assert_same(left[key], right[key])
    elif isinstance(left, (list, tuple)):
        assert len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            assert_same(a, b)
    else:
        assert left == right


def test_flatten_round_trip_keeps_types_and_metadata() -> None:
    state = training_state()
    skeleton, tensors = flatten_state(state)
    assert all(isinstance(t, torch.Tensor) for t in tensors)
    assert_same(unflatten_state(skeleton, tensors), state)
    assert isinstance(unflatten_state(skeleton, tensors)["replica"]["models"][0], OrderedDict)


@pytest.mark.parametrize("in_shm", [True, False])
def test_snapshot_round_trip_is_bitwise(tmp_path: Path, in_shm: bool) -> None:
    state = training_state()
    snapshots = RankSnapshots(tmp_path / "node0" if in_shm else None, rank=3)
    info = snapshots.write(state, step=7, generation=2, world_size=4)
    assert info is not None and (info.step, info.generation, info.world_size) == (7, 2, 4)
    copy = snapshots.read(7)
    assert_same(copy, state)
    # A private copy: the next snapshots may reuse the slot without changing what was read.
    snapshots.write(training_state(seed=1), step=8, generation=2, world_size=4)
    snapshots.write(training_state(seed=2), step=9, generation=2, world_size=4)
    assert_same(copy, state)


def test_torn_slot_is_never_returned(tmp_path: Path) -> None:
    """A slot whose commit word is not COMMITTED (a writer died mid-copy) is invisible to readers."""
    snapshots = RankSnapshots(tmp_path, rank=0)
    snapshots.write(training_state(seed=1), step=1, generation=1, world_size=1)
    snapshots.wait_reserved()
    snapshots.write(training_state(seed=2), step=2, generation=1, world_size=1)
    newest = snapshots.committed()[0]
    snapshots._slots[newest.slot].set_state(STATE_WRITING)
    snapshots.close()
    reopened = RankSnapshots(tmp_path, rank=0)
    assert [info.step for info in reopened.committed()] == [1]
    with pytest.raises(KeyError):
        reopened.read(2)


@pytest.mark.parametrize("overlap", [False, True], ids=["copy", "overlapped-copy"])
def test_a_writer_killed_mid_copy_leaves_only_complete_snapshots(tmp_path: Path, overlap: bool) -> None:
    """Real torn writes: a process snapshots a 48 MB state (every element = its step) in a loop and is
    SIGKILLed at some point of some copy (overlapped: most likely while the helper thread copies and
    the main thread has moved on); every snapshot still listed must hold exactly its step."""
    writer = textwrap.dedent(f"""
        import sys, torch
        from pathlib import Path
        from undying.checkpoint.snapshot import RankSnapshots
        snapshots = RankSnapshots(Path({str(tmp_path)!r}), rank=0)
        state = {{"weights": [torch.zeros(1 << 20) for _ in range(12)]}}
        defer = (lambda tensor: True) if {overlap!r} else None
        step = 0
        while True:
            step += 1
            snapshots.wait()  # the training loop's optimizer step waits for an overlapped copy
            for tensor in state["weights"]:
                tensor.fill_(float(step))
            snapshots.write(state, step=step, generation=1, world_size=1, defer=defer)
            if step == 2:
                print("ready", flush=True)
    """)
    process = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    snapshots = RankSnapshots(tmp_path, rank=0)
    held = snapshots.committed()
    assert held, "the older slot must survive whatever the killed write did"
    for info in held:
        weights = snapshots.read(info.step)["weights"]
        assert all(bool((tensor == float(info.step)).all()) for tensor in weights), f"step {info.step} is torn"


def test_an_overlapped_snapshot_is_visible_only_once_its_background_copy_is_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``defer``: the selected tensors are copied on a helper thread (held here until released); the
    rest is copied before ``write`` returns. Until the helper is done the snapshot is not listed, a
    pin of its step waits for it in ``read_slot``, and the result is bitwise the state handed over."""
    release = threading.Event()
    copy_now = copy_module.copy_now

    def held_copy(views: list, tensors: list) -> None:
        assert release.wait(30)
        copy_now(views, tensors)

    monkeypatch.setattr(copy_module, "copy_now", held_copy)  # the helper thread's copy only
    state = training_state()
    expected = training_state()
    snapshots = RankSnapshots(tmp_path, rank=0)
    deferred = {tensor.untyped_storage().data_ptr() for tensor in state["replica"]["models"][0].values()}
    info = snapshots.write(state, step=7, generation=1, world_size=1,
                           defer=lambda tensor: tensor.untyped_storage().data_ptr() in deferred)
    assert info is not None and info.step == 7
    assert snapshots.committed() == []
    slot = snapshots.pin(7)
    # The training thread is already waiting (e.g. at the end of training) when the persister reads.
    waiter = threading.Thread(target=snapshots.wait)
    waiter.start()
    read: list = []
    reader = threading.Thread(target=lambda: read.append(snapshots.read_slot(slot, clone=True)))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive(), "read_slot must wait for the background copy of a pinned step"
    release.set()
    reader.join(30)
    waiter.join(30)
    assert_same(read[0], expected)
    snapshots.unpin(slot)
    assert snapshots.wait() == 0.0
    assert [i.step for i in snapshots.committed()] == [7]
    assert_same(snapshots.read(7), expected)
    snapshots.close()


def test_a_failed_background_copy_raises_on_wait_and_leaves_no_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_copy(views: list, tensors: list) -> None:
        raise OSError("device lost")

    snapshots = RankSnapshots(tmp_path, rank=0)
    snapshots.write({"w": torch.ones(8)}, step=1, generation=1, world_size=1)
    snapshots.wait_reserved()
    monkeypatch.setattr(copy_module, "copy_now", broken_copy)
    snapshots.write({"w": torch.full((8,), 2.0)}, step=2, generation=1, world_size=1, defer=lambda t: True)
    with pytest.raises(RuntimeError, match="background snapshot copy failed.*device lost"):
        snapshots.wait()
    assert [info.step for info in snapshots.committed()] == [1]
    monkeypatch.undo()
    assert snapshots.write({"w": torch.full((8,), 3.0)}, step=3, generation=1, world_size=1) is not None
    assert [info.step for info in snapshots.committed()] == [3, 1]
    snapshots.close()


def test_snapshots_reuse_their_buffers(tmp_path: Path) -> None:
    """100 snapshots: same memory under the views, no growth of reserved bytes or of the process RSS."""
    state = {"weights": [torch.randn(256, 256) for _ in range(8)], "step": 0}
    snapshots = RankSnapshots(tmp_path, rank=0)
    for step in range(1, 5):
        snapshots.write(state, step=step, generation=1, world_size=1)
        snapshots.wait_reserved()
    pointers = sorted(view.data_ptr() for slot in snapshots._slots for view in slot.views)
    reserved = snapshots.nbytes_reserved()
    rss_before = _rss_bytes()
    for step in range(5, 105):
        state["step"] = step
        state["weights"][step % 8].add_(1.0)
        assert snapshots.write(state, step=step, generation=1, world_size=1) is not None
    assert sorted(view.data_ptr() for slot in snapshots._slots for view in slot.views) == pointers
    assert snapshots.nbytes_reserved() == reserved
    assert _rss_bytes() - rss_before < 4 << 20
    assert_same(snapshots.read(104), state)


def test_pinned_slots_are_never_overwritten_and_the_newest_only_while_one_is_pinned(tmp_path: Path) -> None:
    snapshots = RankSnapshots(tmp_path, rank=0, slots=3)
    for step in (1, 2):
        snapshots.write({"weights": torch.full((4,), float(step))}, step=step, generation=1, world_size=1)
        snapshots.wait_reserved()  # the other slots are grown in the background after the first write
    # Nothing pinned: the newest (step 2) is kept, the empty slot is used, then the oldest.
    snapshots.write({"weights": torch.full((4,), 3.0)}, step=3, generation=1, world_size=1)
    assert [info.step for info in snapshots.committed()] == [3, 2, 1]
    snapshots.write({"weights": torch.full((4,), 4.0)}, step=4, generation=1, world_size=1)
    assert [info.step for info in snapshots.committed()] == [4, 3, 2]

    two = RankSnapshots(tmp_path / "two", rank=0, slots=2)
    for step in (1, 2):
        two.write({"weights": torch.full((4,), float(step))}, step=step, generation=1, world_size=1)
        two.wait_reserved()
    pinned = two.pin(1)
    # Step 1 is pinned (being persisted): the newest slot is overwritten step after step, so T1
    # keeps up with training; step 1 stays intact to fall back on.
    for step in (3, 4):
        assert two.write({"weights": torch.full((4,), float(step))}, step=step, generation=1,
                         world_size=1) is not None
    assert [info.step for info in two.committed()] == [4, 1]
    assert torch.equal(two.read_slot(pinned, clone=False)["weights"], torch.ones(4))
    two.unpin(pinned)
    # Unpinned again: the newest (4) is kept and the older slot (1) is reused.
    assert two.write({"weights": torch.full((4,), 5.0)}, step=5, generation=1, world_size=1) is not None
    assert [info.step for info in two.committed()] == [5, 4]
    two.invalidate(keep_step=4)
    assert [info.step for info in two.committed()] == [4]


def test_other_slots_grow_in_the_background(tmp_path: Path) -> None:
    """The first snapshot allocates its own slot only; the next ones skip the slot still being grown."""
    snapshots = RankSnapshots(tmp_path, rank=0, slots=3)
    state = {"weights": torch.ones(1 << 20)}
    assert snapshots.write(state, step=1, generation=1, world_size=1) is not None
    snapshots.wait_reserved()
    sizes = [slot.size for slot in snapshots._slots]
    assert len(set(sizes)) == 1 and sizes[0] > 4 << 20
    assert [snapshots.write(state, step=s, generation=1, world_size=1).slot for s in (2, 3, 4)] == [1, 2, 0]


def test_stale_shared_memory_of_dead_jobs_is_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shm.claim_node_dir("deadjob", 0, pid=dead.pid, root=tmp_path)
    (shm.node_dir("deadjob", 0, tmp_path) / "rank00000.slot0").write_bytes(b"x" * 10)
    live = shm.claim_node_dir("livejob", 0, root=tmp_path)  # owned by this (live) process
    removed = shm.remove_stale(keep_job="mine", root=tmp_path)
    assert removed == [shm.job_dir("deadjob", tmp_path)]
    assert live.is_dir() and not shm.job_dir("deadjob", tmp_path).exists()
    shm.remove_node_dir("livejob", 0, tmp_path)
    assert not shm.job_dir("livejob", tmp_path).exists()
    with pytest.raises(ValueError):
        shm.job_dir("../etc")


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_slot_file_left_empty_by_a_failed_allocation_holds_nothing(tmp_path: Path) -> None:
    """Node memory full at a slot's allocation leaves its file empty (or shorter than a header): a
    reader (a replacement, a node's other rank) sees no snapshot there instead of failing, and a
    writer grows it anew."""
    (tmp_path / "rank00000.slot0").touch()
    (tmp_path / "rank00000.slot1").write_bytes(b"\0" * 100)
    snapshots = RankSnapshots(tmp_path, rank=0)
    assert snapshots.committed() == []
    snapshots.write({"w": torch.ones(8)}, step=3, generation=1, world_size=1)
    assert [info.step for info in snapshots.committed()] == [3]
    snapshots.close()
