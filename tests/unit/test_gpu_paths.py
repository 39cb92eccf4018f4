"""The GPU-path decisions that can be checked on CPU (issue 16): the commit vote counts exactly however
many ranks, RNG of the rank's own CUDA device only, one GPU per rank at start, and the bounded wait
polling an NCCL collective's completion (``torch.cuda`` and the backend's Work objects are faked)."""

from __future__ import annotations

import datetime
import os
import random
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from undying.runtime import devices, pg, rng
from undying.runtime.ddp import FixedLayoutDDP, commit_vote
from undying.runtime.pg import CollectiveError, GenerationGroup

SIMULATED_RANKS = 300


class SequentialSumGroup:
    """A group of ``world_size`` identical ranks whose all-reduce adds their contributions one at a
    time in the tensor's own dtype, as a ring does: a bf16 count of ones stops at 256."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.generation = 1
        self.reduced: list[torch.Tensor] = []

    def allreduce_sum(self, tensor: torch.Tensor) -> None:
        total = torch.zeros_like(tensor)
        for _ in range(self.world_size):
            total += tensor
        tensor.copy_(total)
        self.reduced.append(tensor)

    def start_allreduce(self, tensor: torch.Tensor) -> None:
        self.allreduce_sum(tensor)

    def wait_work(self, op: str, work: object) -> None:
        raise AssertionError("nothing to wait for: start_allreduce returned no work")


def averaged(model: torch.nn.Module, group: SequentialSumGroup) -> FixedLayoutDDP:
    ddp = FixedLayoutDDP(model, lambda: group, torch.device("cpu"), broadcast=False)  # type: ignore[arg-type, return-value]
    model(torch.ones(2, 4, dtype=next(model.parameters()).dtype)).sum().backward()
    ddp.sync_gradients()
    return ddp


def test_a_bf16_sum_of_ones_stops_at_256() -> None:
    """Why the vote has its own dtype: a vote slot in a bf16 gradient bucket would miscount."""
    votes = torch.ones(1, dtype=torch.bfloat16)
    SequentialSumGroup(SIMULATED_RANKS).allreduce_sum(votes)
    assert votes.item() == 256 != SIMULATED_RANKS


def test_vote_counts_300_ranks_exactly() -> None:
    group = SequentialSumGroup(SIMULATED_RANKS)
    assert commit_vote(group, True, torch.device("cpu"))  # type: ignore[arg-type]
    assert group.reduced[-1].dtype == torch.float32 and group.reduced[-1].numel() == 1
    assert not commit_vote(group, False, torch.device("cpu"))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_averages_in_its_own_dtype(dtype: torch.dtype) -> None:
    group = SequentialSumGroup(2)
    averaged(torch.nn.Linear(4, 3).to(dtype), group)
    assert [t.dtype for t in group.reduced] == [dtype]


def test_fp32_model_keeps_one_bucket_of_all_its_parameters() -> None:
    """The layout that bitwise replays (and the fault tests' digests) depend on."""
    group = SequentialSumGroup(SIMULATED_RANKS)
    model = torch.nn.Linear(4, 3)
    averaged(model, group)
    [flat] = group.reduced
    assert flat.dtype == torch.float32
    assert flat.numel() == sum(p.numel() for p in model.parameters())


def test_mixed_model_has_one_bucket_per_dtype() -> None:
    group = SequentialSumGroup(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 3))
    model[0].register_forward_hook(lambda _module, _inputs, output: output.float())
    averaged(model, group)
    # DDP's first layout: buckets by dtype sorted by their first parameter, the list reversed.
    assert [t.dtype for t in group.reduced] == [torch.float32, torch.bfloat16]


class FakeCuda:
    """``torch.cuda`` as seen by a rank whose own device is cuda:1 on a host with three GPUs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, device_count: int = 3, own: int = 1) -> None:
        self.read: list[torch.device] = []
        self.written: list[tuple[torch.device, torch.Tensor]] = []
        self.own = own
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: device_count)
        monkeypatch.setattr(cuda, "current_device", lambda: self.own)
        monkeypatch.setattr(cuda, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(cuda, "set_rng_state", self.set_rng_state)
        monkeypatch.setattr(cuda, "get_rng_state_all", self.every_device)
        monkeypatch.setattr(cuda, "set_rng_state_all", self.every_device)

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        self.read.append(torch.device(device))
        return torch.full((16,), 7, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        self.written.append((torch.device(device), state))

    def every_device(self, *_args: Any) -> None:
        raise AssertionError("the generators of every visible device were touched")


def test_rng_captures_and_restores_the_own_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch)
    state = rng.rng_from_bytes(rng.rng_to_bytes(rng.capture_rng()))
    assert cuda.read == [torch.device("cuda", 1)]
    assert torch.equal(state[rng.CUDA_KEY], torch.full((16,), 7, dtype=torch.uint8))
    rng.restore_rng(state)
    [(device, written)] = cuda.written
    assert device == torch.device("cuda", 1) and torch.equal(written, state[rng.CUDA_KEY])


def test_rng_restores_an_older_every_device_capture_into_the_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch)
    legacy = {"torch": torch.get_rng_state(), "python": random.getstate(),
              rng.LEGACY_CUDA_KEY: [torch.full((16,), index, dtype=torch.uint8) for index in range(3)]}
    rng.restore_rng(rng.rng_from_bytes(rng.rng_to_bytes(legacy)))
    [(device, written)] = cuda.written
    assert device == torch.device("cuda", 1) and torch.equal(written, legacy[rng.LEGACY_CUDA_KEY][1])


def test_auto_picks_nccl_only_when_every_local_rank_has_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch, device_count=2)
    assert devices.choose_backend("auto", local_world_size=2) == "nccl"
    assert devices.choose_backend("auto", local_world_size=3) == "gloo"
    assert devices.choose_backend("gloo", local_world_size=1) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.choose_backend("auto", local_world_size=1) == "gloo"


def test_nccl_rank_gets_its_local_rank_s_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch, device_count=2)
    assert devices.choose_device("nccl", rank=5, local_rank=1, local_world_size=2) == torch.device("cuda", 1)
    assert devices.choose_device("gloo", rank=5, local_rank=1, local_world_size=2) == torch.device("cpu")


@pytest.mark.parametrize(("local_rank", "local_world_size"), [(2, 3), (0, 2)])
def test_device_check_refuses_ranks_sharing_a_gpu(monkeypatch: pytest.MonkeyPatch, local_rank: int,
                                                  local_world_size: int) -> None:
    FakeCuda(monkeypatch, device_count=1)
    with pytest.raises(devices.DeviceError) as refused:
        devices.choose_device("nccl", rank=7, local_rank=local_rank, local_world_size=local_world_size)
    message = str(refused.value)
    assert "\n" not in message
    assert f"rank 7 (local rank {local_rank} of {local_world_size}" in message and "1 CUDA device" in message


class FakeBackend:
    def __init__(self) -> None:
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1


class EnqueuedWork:
    """A NCCL work: its future completes at enqueue, the GPU finishes ``runs_s`` later (None: never)."""

    def __init__(self, runs_s: float | None) -> None:
        self.done_at = None if runs_s is None else time.monotonic() + runs_s
        self.waited = False

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self) -> bool:
        assert self.is_completed(), "waited before the GPU finished"
        self.waited = True
        return True


def fake_group(monkeypatch: pytest.MonkeyPatch, backend: str, comm_timeout: float,
               should_abort: Any = lambda: False) -> tuple[GenerationGroup, FakeBackend]:
    fake = FakeBackend()
    monkeypatch.setattr(GenerationGroup, "_build_abortable", lambda *_args: fake)
    group = GenerationGroup(dist.HashStore(), "test", 1, 0, 2, backend, comm_timeout, torch.device("cpu"),
                            should_abort=should_abort)
    return group, fake


def test_nccl_wait_polls_until_the_gpu_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    group, backend = fake_group(monkeypatch, "nccl", comm_timeout=5.0)
    work = EnqueuedWork(runs_s=0.3)
    started = time.monotonic()
    group._wait("allreduce", work)  # type: ignore[arg-type]
    assert time.monotonic() - started >= 0.3 - 0.01
    assert work.waited and backend.aborts == 0


def test_nccl_wait_times_out_and_aborts_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    group, backend = fake_group(monkeypatch, "nccl", comm_timeout=0.3)
    with pytest.raises(CollectiveError, match="comm_timeout"):
        group._wait("allreduce", EnqueuedWork(runs_s=None))  # type: ignore[arg-type]
    assert backend.aborts == 1
    group.abandon()  # the group is already aborted: not twice
    assert backend.aborts == 1


def test_nccl_wait_aborts_on_the_controller_s_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    group, backend = fake_group(monkeypatch, "nccl", comm_timeout=30.0, should_abort=lambda: True)
    with pytest.raises(CollectiveError, match="aborted"):
        group._wait("broadcast", EnqueuedWork(runs_s=None))  # type: ignore[arg-type]
    assert backend.aborts == 1


class GlooWork:
    """A gloo work: done ``runs_s`` after its start; its ``wait`` bounded by a timeout, as torch's."""

    def __init__(self, runs_s: float) -> None:
        self.done_at = time.monotonic() + runs_s
        self.timeouts: list[datetime.timedelta | None] = []

    def get_future(self) -> torch.futures.Future:
        return torch.futures.Future()  # never asked to call back under gloo

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.timeouts.append(timeout)
        left = self.done_at - time.monotonic()
        if timeout is not None and left > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        time.sleep(max(0.0, left))
        return True


def test_gloo_wait_waits_in_the_work_a_poll_period_at_a_time_and_never_aborts(monkeypatch: pytest.MonkeyPatch) -> None:
    group, backend = fake_group(monkeypatch, "gloo", comm_timeout=1.0)
    work = GlooWork(runs_s=4 * pg.ABORT_POLL_S)
    group._wait("allreduce", work)  # type: ignore[arg-type]
    group.abandon()
    assert backend.aborts == 0
    bounded = [timeout for timeout in work.timeouts if timeout is not None]
    assert len(bounded) >= 3 and all(timeout.total_seconds() == pg.ABORT_POLL_S for timeout in bounded)


def test_nccl_groups_are_built_eagerly_with_async_error_handling_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's default (3) would let NCCL's watchdog SIGABRT the worker on a timed-out collective."""
    seen_at_construction: list[str | None] = []
    monkeypatch.setenv(pg.NCCL_ASYNC_ERROR_HANDLING_ENV, "3")

    class Options:
        _timeout: Any = None

    connected: list[torch.device] = []

    class RecordingNccl:
        def __init__(self, *_args: Any) -> None:
            seen_at_construction.append(os.environ.get(pg.NCCL_ASYNC_ERROR_HANDLING_ENV))

        def eager_connect_single_device(self, device: torch.device) -> None:
            connected.append(device)

    RecordingNccl.Options = Options  # type: ignore[attr-defined]
    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordingNccl, raising=False)
    GenerationGroup(dist.HashStore(), "test", 1, 0, 1, "nccl", 5.0, torch.device("cpu"))
    assert seen_at_construction == ["0"]
    # The communicator is made eagerly, in the build (bounded by the join timeout and the abort).
    assert connected == [torch.device("cpu")]


class LateGroup:
    """A backend group whose construction (NCCL: the eager communicator) ends after the waiter gave up."""

    def __init__(self) -> None:
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()


def test_a_group_built_after_the_build_was_given_up_is_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    """An aborted generation's build returns at once; the group its builder thread finishes later
    is aborted there, so no communicator of the failed generation lives on."""
    late = LateGroup()
    release = threading.Event()

    def slow_build(self: GenerationGroup, backend: str, timeout: Any) -> LateGroup:
        release.wait(10)
        return late

    monkeypatch.setattr(GenerationGroup, "_build", slow_build)
    started = time.monotonic()
    with pytest.raises(CollectiveError, match="aborted this generation"):
        GenerationGroup(dist.HashStore(), "late", 1, 0, 2, "nccl", 5.0, torch.device("cpu"), should_abort=lambda: True)
    assert time.monotonic() - started < 2.0
    release.set()
    assert late.aborted.wait(5), "the late group was not aborted"
