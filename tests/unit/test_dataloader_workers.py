"""ResumableLoader through a torch DataLoader: with worker processes (and prefetch) the batches are
bitwise those read on the training thread, the position is the loader's and not the prefetch's, a
jump in position drops what was read ahead; and ft.dataloader's stateful iterables."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import default_collate

from tests.conftest import REPO
from undying.config import JobSpec
from undying.data import ResumableLoader
from undying.data.iterable import StatefulIterableLoader
from undying.runtime.core import Runtime
from undying.worker_env import WorkerEnv

WORKER_SETTINGS = [
    pytest.param({"num_workers": 0}, id="workers0"),
    pytest.param({"num_workers": 2}, id="workers2"),
    pytest.param({"num_workers": 2, "persistent_workers": True, "prefetch_factor": 3}, id="workers2-persistent"),
]


class Features:
    """Item i: a dict of a random vector drawn from a generator seeded by i, and i itself."""

    def __len__(self) -> int:
        return 60

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return {"x": torch.randn(3, generator=generator), "index": torch.tensor(index)}


class WithPid(Features):
    """Also says which process read the item."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(index), "pid": torch.tensor(os.getpid())}


class FailsOnce(Features):
    """Reading ``bad`` raises while ``broken`` holds (a transient read error)."""

    def __init__(self, bad: int) -> None:
        self.bad = bad
        self.broken = True

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.broken and index == self.bad:
            raise OSError(f"cannot read sample {index}")
        return super().__getitem__(index)


def direct(dataset: Any, indices: list[int]) -> Any:
    """The batch as the loader read it on the training thread before the DataLoader."""
    return default_collate([dataset[i] for i in indices])


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def scenario(settings: dict[str, Any]) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """Every kind of position change: epochs, resume, rollback, a shrink in both modes, an abandoned
    step, a reshard back. Returns each batch with its indices."""
    dataset = Features()
    loader = ResumableLoader(dataset, 3, 5, 1, 4, **settings)  # global batch 12: 5 steps per epoch
    seen = []

    def take(count: int) -> None:
        for _ in range(count):
            batch = next(loader)
            seen.append((loader.last_indices, batch))

    take(7)  # into epoch 1
    committed = loader.state_dict()
    take(2)
    loader.load_state_dict(committed)  # a failed step rolled back
    take(2)
    resumed = ResumableLoader(dataset, 3, 5, 1, 4, **settings)  # a restart from a checkpoint
    resumed.load_state_dict(loader.state_dict())
    loader = resumed
    take(1)
    loader.set_replicas(0, 3, "accumulate")  # slots 0 and 1: two micro-batches per step
    take(1)
    loader.begin_step()  # that step was abandoned after its first micro-batch
    for _ in range(2):
        for batch in loader.step_batches():
            seen.append((loader.last_indices, batch))
    loader.set_replicas(2, 3, "grow")  # slot 3 alone
    take(2)
    loader.reshard(1, 4)
    take(4)
    return seen


@pytest.mark.parametrize("settings", WORKER_SETTINGS)
def test_worker_processes_yield_bitwise_the_batches_read_on_the_training_thread(settings):
    expected = scenario({"num_workers": 0})
    got = scenario(settings)
    assert [indices for indices, _ in got] == [indices for indices, _ in expected]
    dataset = Features()
    for (indices, batch), (_, reference) in zip(got, expected, strict=True):
        assert same(batch, reference) and same(batch, direct(dataset, indices))
        assert batch["index"].tolist() == indices


@pytest.mark.parametrize("settings", WORKER_SETTINGS[1:])
def test_the_position_is_what_was_taken_not_what_was_prefetched(settings):
    dataset = Features()
    loader = ResumableLoader(dataset, 2, 0, 0, 2, **settings)
    uninterrupted = ResumableLoader(dataset, 2, 0, 0, 2)
    for _ in range(3):
        next(loader), next(uninterrupted)
    assert len(loader._sampler.planned) > 0, "nothing was read ahead: the test shows nothing"
    assert loader.state_dict() == uninterrupted.state_dict() == {"epoch": 0, "position": 12, "seed": 0,
                                                                "dataset_len": 60}
    restored = ResumableLoader(dataset, 2, 0, 0, 2, **settings)
    restored.load_state_dict(loader.state_dict())
    for _ in range(4):
        assert same(next(restored), next(uninterrupted))


@pytest.mark.parametrize("persistent", [False, True])
def test_a_rollback_drops_the_batches_read_ahead_and_persistent_workers_are_kept(persistent):
    dataset = WithPid()
    loader = ResumableLoader(dataset, 2, 0, 0, 1, num_workers=2, persistent_workers=persistent)
    committed = loader.state_dict()
    first = [next(loader) for _ in range(3)]
    assert loader.stream_restarts == 1
    loader.load_state_dict(committed)
    again = [next(loader) for _ in range(3)]
    assert loader.stream_restarts == 2
    for before, after in zip(first, again, strict=True):
        assert torch.equal(before["index"], after["index"]) and torch.equal(before["x"], after["x"])
    pids_before = {pid for batch in first for pid in batch["pid"].tolist()}
    pids_after = {pid for batch in again for pid in batch["pid"].tolist()}
    assert os.getpid() not in pids_before | pids_after
    if persistent:
        assert pids_after <= pids_before
    else:  # new processes, and the old ones are gone (joined), not piling up over rollbacks
        assert not pids_after & pids_before
        assert not [pid for pid in pids_before if Path(f"/proc/{pid}").exists()]


def test_a_position_that_did_not_move_keeps_the_batches_read_ahead():
    loader = ResumableLoader(Features(), 2, 0, 0, 1, num_workers=2)
    next(loader)
    committed = loader.state_dict()
    loader.begin_step()
    loader.load_state_dict(committed)  # a rollback before the step took anything
    expected = ResumableLoader(Features(), 2, 0, 0, 1)
    expected.load_state_dict(committed)
    assert same(next(loader), next(expected))
    assert loader.stream_restarts == 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_after_a_read_error_the_same_batch_is_read_again(num_workers):
    reference = ResumableLoader(Features(), 2, 0, 0, 1)
    expected = [next(reference) for _ in range(4)]
    dataset = FailsOnce(bad=expected[2]["index"][0].item())
    loader = ResumableLoader(dataset, 2, 0, 0, 1, num_workers=num_workers)
    got = [next(loader), next(loader)]
    with pytest.raises(Exception, match="cannot read sample"):
        next(loader)
    assert loader.position == 4
    dataset.broken = False  # fork copies it into the new workers
    got += [next(loader), next(loader)]
    assert all(same(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("settings", WORKER_SETTINGS)
def test_reading_draws_nothing_from_the_process_rng(settings):
    """A rollback restores the process's RNG and replays the step bit for bit; restarting reading
    (a DataLoader iterator draws its workers' seed) must not shift that stream."""
    loader = ResumableLoader(Features(), 2, 0, 0, 1, **settings)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    committed = loader.state_dict()
    next(loader), next(loader)
    loader.load_state_dict(committed)
    next(loader)
    assert torch.equal(torch.get_rng_state(), before)


def test_pin_memory_without_cuda_is_quietly_off_and_with_cuda_pins():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = ResumableLoader(Features(), 2, 0, 0, 1, num_workers=2, pin_memory=True)
        batch = next(loader)
    assert loader.pin_memory == torch.cuda.is_available()
    assert batch["x"].is_pinned() == torch.cuda.is_available()


# ------------------------------------------------------------- ft.dataloader with a stateful iterable


class Stream:
    """A stateful iterable of the tensors start, start+1, ...: ``iter`` resumes at the loaded position,
    ``state_dict`` counts what was handed out (the contract of torchdata's StatefulDataLoader)."""

    def __init__(self, length: int = 10) -> None:
        self.length = length
        self.handed_out = 0

    def __iter__(self):
        while self.handed_out < self.length:
            self.handed_out += 1
            yield torch.tensor([self.handed_out - 1])
        self.handed_out = 0  # the next pass starts over

    def state_dict(self) -> dict[str, int]:
        return {"handed_out": self.handed_out}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.handed_out = state["handed_out"]


def standalone(tmp_path: Path, **spec: Any) -> Runtime:
    return Runtime(WorkerEnv(spec=JobSpec(**spec), run_dir=tmp_path))


def test_a_stateful_iterable_is_registered_and_rewound_with_a_failed_step(tmp_path):
    ft = standalone(tmp_path)
    loader = ft.dataloader(Stream(), batch_size=2)
    assert isinstance(loader, StatefulIterableLoader) and ft.state.statefuls["dataloader.0"] is loader
    assert ft.loaders == []
    assert next(loader).flatten().tolist() == [0, 1]
    ft.state.mark_commit_boundary()
    assert next(loader).flatten().tolist() == [2, 3]
    ft.state.roll_back_step_in_flight()
    assert [next(loader).flatten().tolist() for _ in range(2)] == [[2, 3], [4, 5]]
    assert ft.state.rank_state()["statefuls"]["dataloader.0"] == {"handed_out": 2}


def test_a_stateful_loader_yields_its_own_batches_and_a_pass_ends_once(tmp_path):
    ft = standalone(tmp_path)
    ft.dataloader(Stream(), batch_size=4)
    loader = ft.dataloader(Stream(3))  # yields batches itself
    assert "dataloader.1" in ft.state.statefuls
    assert [batch.item() for batch in loader] == [0, 1, 2]
    assert [batch.item() for batch in loader] == [0, 1, 2]


def test_an_elastic_job_refuses_an_iterable_in_one_line(tmp_path):
    ft = standalone(tmp_path, process_recover=True, recover_strategy=["retry", "elastic-training"])
    with pytest.raises(ValueError) as refused:
        ft.dataloader(Stream(), batch_size=2)
    message = str(refused.value)
    assert "\n" not in message and "Stream" in message and "elastic-training" in message
    assert "map-style dataset (len and __getitem__)" in message
    assert ft.state.statefuls == {}


@pytest.mark.parametrize(("source", "kwargs", "message"), [
    (iter(range(4)), {"batch_size": 2}, "has no state_dict/load_state_dict"),
    (Stream(), {"batch_size": 2, "num_workers": 2}, "num_workers apply to a map-style dataset only"),
    (Features(), {}, "batch_size is required for a map-style dataset"),
])
def test_what_ft_dataloader_cannot_take_is_named(tmp_path, source, kwargs, message):
    ft = standalone(tmp_path)
    with pytest.raises((TypeError, ValueError), match=message):
        ft.dataloader(source, **kwargs)


def test_ft_dataloader_passes_the_worker_options_on(tmp_path):
    """In a fresh interpreter, as in a worker: the DataLoader forks its worker processes, and a fork
    of this test process, full of earlier tests' threads, once crashed in the child (CI)."""
    code = f"""
from pathlib import Path
from tests.unit.test_dataloader_workers import Features, same, standalone
from undying.data import ResumableLoader
ft = standalone(Path({str(tmp_path)!r}))
loader = ft.dataloader(Features(), 2, seed=3, num_workers=2, pin_memory=True)
assert isinstance(loader, ResumableLoader) and ft.loaders == [loader]
assert loader.num_workers == 2 and loader.pin_memory == (ft.device.type == "cuda")
assert same(next(loader), next(ResumableLoader(Features(), 2, 3, 0, 1)))
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
