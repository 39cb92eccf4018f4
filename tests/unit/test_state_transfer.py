"""Replica state between ranks in its one encoding (skeleton + tensors): what a repair's receiver
and a restore's ranks get is bitwise what the source holds, over a real gloo group in threads; it
fills the receiver's own tensors where they fit, keeps the source's host tensors on the host, and
streams: a repair's peak memory, measured in real processes, is about one bucket beyond the state."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.gloo_ranks import run_ranks
from undying.runtime import state_transfer
from undying.runtime.pg import GenerationGroup
from undying.runtime.state_transfer import (
    broadcast_state,
    buckets_of,
    encode,
    placement,
    recv_state,
    send_state,
)

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


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


def test_the_layout_says_which_tensors_lived_on_the_host_and_those_stay_there() -> None:
    """An AdamW's ``step`` is a host scalar beside moments on the GPU: the receiver must keep that
    split (torch's load_state_dict would leave a GPU step on the GPU). A meta tensor stands for the
    device one here; the placement is decided for a CUDA device without touching CUDA."""
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.empty(4, device="meta")}}}
    _, _, layout, _ = encode(state)
    assert [(meta.shape, meta.on_host) for meta in layout] == [((), True), ((4,), False)]
    assert placement(True, "cuda:1") == torch.device("cpu")
    assert placement(False, "cuda:1") == torch.device("cuda", 1)
    assert placement(False, torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert placement(True, CPU) == placement(False, CPU) == CPU


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 6)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("bucket_bytes", [64 << 20, 24])  # many tensors a bucket; every tensor alone
@pytest.mark.parametrize("transfer", ["repair", "restore"])
def test_a_receiver_fills_its_own_tensors_in_place_and_its_optimizer_loads_the_rest(
        monkeypatch, bucket_bytes: int, transfer: str) -> None:
    """A replacement rank holds its model (other values) and a fresh AdamW: the model's tensors are
    filled in place, the optimizer state arrives new, and both then step exactly like the source's.
    A live tensor of another shape, a strided one and one that requires grad are handled as
    copy_into does: replaced, filled through the bucket, left alone."""
    monkeypatch.setattr(state_transfer, "BUCKET_BYTES", bucket_bytes)
    source_model, source_optimizer = trained(0)
    step(source_model, source_optimizer)
    extras = {"other_shape": torch.ones(3), "strided": torch.randn(3, 4), "param": torch.full((2,), 5.0)}
    sent = {"models": [source_model.state_dict()], "optimizers": [source_optimizer.state_dict()], "extras": extras}
    receiver_model, receiver_optimizer = trained(1)
    live_extras = {"other_shape": torch.zeros(2), "strided": torch.zeros(4, 3).t(),
                   "param": torch.nn.Parameter(torch.zeros(2))}
    live = {"models": [receiver_model.state_dict()], "optimizers": [receiver_optimizer.state_dict()],
            "extras": live_extras}

    def body(group: GenerationGroup) -> Any:
        if transfer == "restore":
            return broadcast_state(group, sent if group.rank == 0 else None, 0, CPU, live=live if group.rank else None)
        if group.rank == 0:
            return send_state(group, sent, [1], CPU)
        return recv_state(group, 0, CPU, live=live)

    received = run_ranks(2, body)[1]
    assert_same(received, sent)
    for name, tensor in live["models"][0].items():
        assert received["models"][0][name] is tensor
    assert received["extras"]["strided"] is live_extras["strided"]
    assert received["extras"]["other_shape"] is not live_extras["other_shape"]
    assert received["extras"]["param"] is not live_extras["param"]
    assert torch.equal(live_extras["param"].detach(), torch.zeros(2))
    receiver_model.load_state_dict(received["models"][0])
    receiver_optimizer.load_state_dict(received["optimizers"][0])
    assert all(state["step"].device.type == "cpu" for state in receiver_optimizer.state.values())
    step(source_model, source_optimizer)
    step(receiver_model, receiver_optimizer)
    for expected, got in zip(source_model.parameters(), receiver_model.parameters(), strict=True):
        assert torch.equal(expected, got)


def test_a_repair_and_a_restore_hold_about_one_bucket_beyond_the_state(tmp_path: Path) -> None:
    """Peak extra host memory of each rank during a repair (one source, two receivers) and a
    restore's broadcast of a 96 MiB model + AdamW state in 16 MiB buckets (7 buckets), measured by
    bench/repair_memory.py in real processes: each resets its peak RSS (/proc/self/clear_refs),
    transfers, and reads VmHWM. Why processes and RSS: it is the memory the machine actually
    gives, whatever allocates it (torch, gloo, pickle), and it cannot miss a tensor the way
    instrumenting torch's allocations could; the ranks' glibc maps every allocation of 64 KiB or
    more on its own, so a freed bucket leaves the RSS at once and the peak is the tensors' own. The
    bounds sit a whole bucket above what streaming needs and a whole bucket below what packing all
    at once needed (the source: one state; a receiver: two), and the fresh receiver's peak must
    hold the state it received: a measurement that saw no tensors fails."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the peak RSS is reset through Linux's /proc/self/clear_refs")
    out = tmp_path / "repair_memory.json"
    done = subprocess.run([sys.executable, "bench/repair_memory.py", "--state-mib", "96", "--tensor-mib", "4",
                           "--bucket-mib", "16", "--receivers", "2", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    state, model, bucket = report["state_bytes"], report["model_bytes"], report["bucket_bytes"]
    assert report["buckets"] >= 6 and state >= 90 * MIB
    for phase, (source, fresh, replacement) in report["phases"].items():
        assert source["peak_extra_bytes"] <= 2 * bucket, (phase, source)
        assert 0.9 * state <= fresh["peak_extra_bytes"] <= state + 2 * bucket, (phase, fresh)
        # A replacement rank's own model is filled in place: only the optimizer's state is new.
        assert replacement["peak_extra_bytes"] <= state - model + 2 * bucket, (phase, replacement)
        for receiver in (fresh, replacement):
            assert receiver["equal"] and receiver["steps_on_host"], (phase, receiver)
        assert replacement["filled_live_in_place"], (phase, replacement)
