"""Replica state between ranks in its one encoding (skeleton + tensors): what a repair's receiver
and a restore's ranks get is bitwise what the source holds, over a real gloo group in threads."""

from __future__ import annotations

import datetime
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from tests.unit.gloo_ranks import run_ranks
from undying.runtime import state_transfer
from undying.runtime.pg import GenerationGroup
from undying.runtime.state_transfer import broadcast_state, buckets_of, recv_state, send_state

CPU = torch.device("cpu")


def source_state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(7)
    weights = OrderedDict(weight=torch.randn(3, 4, generator=generator), bias=torch.randn(4, generator=generator))
    weights._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]  # load_state_dict reads it
    return {
        "committed_step": 12,
        "models": [weights],
        "optimizers": [{"state": {0: {"step": torch.tensor(12.0), "exp_avg": torch.randn(3, 4).t()}},
                        "param_groups": [{"lr": 0.001, "params": [0]}]}],
        "loaders": [{"epoch": 1, "position": 36}],
        "statefuls": {"empty": torch.empty(0), "half": torch.arange(5, dtype=torch.float16)},
    }


def assert_same(received: Any, sent: Any) -> None:
    assert type(received) is type(sent)
    if isinstance(sent, dict):
        assert list(received) == list(sent)
        assert getattr(received, "_metadata", None) == getattr(sent, "_metadata", None)
        for key in sent:
            assert_same(received[key], sent[key])
    elif isinstance(sent, list):
        assert len(received) == len(sent)
        for item, expected in zip(received, sent, strict=True):
            assert_same(item, expected)
    elif isinstance(sent, torch.Tensor):
        assert received.dtype == sent.dtype and received.shape == sent.shape
        assert torch.equal(received, sent)
    else:
        assert received == sent


def test_repair_sends_the_source_state_to_the_receivers_only() -> None:
    sent = source_state()

    def body(group: GenerationGroup) -> Any:
        if group.rank == 1:
            send_state(group, sent, [0, 2], CPU)
            return None
        if group.rank in (0, 2):
            return recv_state(group, 1, CPU)
        return "untouched"  # rank 3 rolls back on its own: no part in the transfer

    results = run_ranks(4, body)
    assert_same(results[0], sent)
    assert_same(results[2], sent)
    assert results[3] == "untouched"


def test_restore_broadcasts_the_same_encoding_to_every_rank() -> None:
    sent = source_state()
    results = run_ranks(3, lambda group: broadcast_state(group, sent if group.rank == 0 else None, 0, CPU))
    for received in results:
        assert_same(received, sent)


def test_tensors_travel_in_few_buckets_of_one_dtype_each(monkeypatch) -> None:
    f32, f16 = torch.float32, torch.float16
    layout = [(f32, (4, 4)), (f32, (8,)), (f16, (3,)), (f32, (2,)), (f32, (1000,)), (f32, (4,))]
    assert buckets_of(layout) == [(f32, [0, 1]), (f16, [2]), (f32, [3, 4, 5])]
    monkeypatch.setattr(state_transfer, "BUCKET_BYTES", 100)  # a tensor over the cap travels alone
    assert buckets_of(layout) == [(f32, [0, 1]), (f16, [2]), (f32, [3]), (f32, [4]), (f32, [5])]
    state = {"tensors": [torch.full(shape, float(index), dtype=dtype) for index, (dtype, shape) in enumerate(layout)]}
    received = run_ranks(2, lambda group: recv_state(group, 0, CPU) if group.rank == 1
                         else send_state(group, state, [1], CPU))[1]
    assert_same(received, state)


def test_a_start_up_rendezvous_waits_as_long_as_its_caller_says_not_comm_timeout() -> None:
    """Rank 1 arrives 0.6 s late (still importing torch, at start): gather_objects and read wait the
    start-up allowance they are given, although the group's comm_timeout is 0.2 s."""
    store = torch.distributed.HashStore()
    results: list[Any] = [None, None]

    def rank(index: int) -> None:
        group = GenerationGroup(store, "startup", 1, index, 2, "gloo", 20.0, CPU)
        group.comm_timeout_s, group.comm_timeout = 0.2, datetime.timedelta(seconds=0.2)  # after the build
        if index == 1:
            time.sleep(0.6)
        gathered = group.gather_objects("held", str(index).encode(), timeout=5.0)
        if gathered is not None:
            group.publish("plan", b"+".join(gathered))
        results[index] = group.read("plan", timeout=5.0)

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [b"0+1", b"0+1"]
