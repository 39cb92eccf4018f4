"""Checkpoint benchmark: what a checkpoint costs the training loop, how long it takes to persist and
to load, and how much memory it needs: undying (T1 snapshot + background T2) against synchronous
``torch.save`` and ``torch.distributed.checkpoint.async_save``, on CPU, in one process.

Runs standalone (no job, no agent): the engine's own classes on the same tensors each method
sees. The physical limit is a plain ``copy_`` of the same tensors into preallocated memory.

    python bench/checkpoint.py --out bench/results/checkpoint.json
    python bench/checkpoint.py --sizes 50M 200M --loop-rounds 0 --rounds 3   # persistence only, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from checkpoint_tables import loop_table, table  # bench/, beside this script
from process_meters import PeakRss, gil_waits, settle_page_cache

from undying.checkpoint import latest_verified
from undying.checkpoint.copy import updated_only_by
from undying.checkpoint.dcp_format import optimizer_param_names, read_shared_shard
from undying.checkpoint.persister import Persister
from undying.checkpoint.snapshot import RankSnapshots, flatten_state

WIDTH = 2048  # square bias-free linear layers of 2048 x 2048 = 4.19M parameters each
# name -> (layers, with AdamW state, full comparison). 1B with AdamW is 12 GB of state and does not
# fit twice (live + a T1 slot) in this machine's 23 GiB: it runs with parameters only and fewer methods.
SIZES = {"50M": (12, True, True), "200M": (48, True, True), "1B": (240, False, False),
         "tiny": (1, True, True)}  # tiny: 4M parameters, the smoke test's (tests/unit/test_benchmarks.py)
DEFAULT_SIZES = ["50M", "200M", "1B"]
LOOP_BATCH = 16  # rows per training step in the loop measurement (AdamW sizes only)
DEVICE = torch.device("cpu")  # --device: where the model and optimizer live (cuda: snapshots are D2H copies)


def synchronize() -> None:
    """Wait for the device's queued work (a timing of device copies must include them)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def build(layers: int, adamw: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False, device="meta") for _ in range(layers)])
    model.to_empty(device=DEVICE)
    for index, parameter in enumerate(model.parameters()):
        parameter.data.fill_(0.001 * (index + 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if adamw:
        for parameter in model.parameters():  # AdamW's own state layout, without paying for a step
            optimizer.state[parameter] = {"step": torch.tensor(1.0), "exp_avg": torch.full_like(parameter, 0.01),
                                          "exp_avg_sq": torch.full_like(parameter, 0.0001)}
    return model, optimizer


def replica_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"committed_step": 1, "models": [model.state_dict()], "optimizers": [optimizer.state_dict()],
            "loaders": [{"epoch": 0, "position": 0, "seed": 0, "dataset_len": 1}], "statefuls": {}}


def timed(function: Callable[[], Any]) -> float:
    started = time.perf_counter()
    function()
    synchronize()
    return time.perf_counter() - started


def measure_copy(tensors: list[torch.Tensor], repeats: int) -> dict[str, Any]:
    # Into host memory (page-locked for a device's tensors: the bus's limit).
    destinations = [torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
                    for tensor in tensors]
    for destination in destinations:
        destination.zero_()  # pages allocated before timing, as a preallocated buffer is

    def copy() -> None:
        for destination, tensor in zip(destinations, tensors, strict=True):
            destination.copy_(tensor)

    times = [timed(copy) for _ in range(repeats)]
    destinations.clear()
    return {"stall_s": statistics.median(times), "runs": times}


def measure_undying(model: torch.nn.Module, optimizer: torch.optim.Optimizer, work: Path, full: bool,
                    repeats: int, persist_from: RankSnapshots | None = None) -> dict[str, Any]:
    """Snapshot stalls and the T1 load on fresh slots; the T2 persist from ``persist_from`` when given: slots
    that earlier rounds wrote already, as a running job's are (the first persist after fresh slots
    were allocated ran up to 2x slower here, and a job persists from slots it has long used)."""
    shm_dir = Path(os.environ.get("UNDYING_SHM_DIR", "/dev/shm")) / f"undying-bench-{os.getpid()}" / "node0"
    snapshots = RankSnapshots(shm_dir, rank=0, slots=2)
    state = {"replica": replica_state(model, optimizer), "rank": {"rng": {"torch": torch.get_rng_state()},
                                                                  "statefuls": {}}}
    result: dict[str, Any] = {}
    try:
        with PeakRss() as memory:
            first = timed(lambda: snapshots.write(state, step=1, generation=1, world_size=1))
            reserve = timed(snapshots.wait_reserved)  # the other slot, grown in the background
            second = timed(lambda: snapshots.write(state, step=2, generation=1, world_size=1))
            steady = [timed(lambda s=step: snapshots.write(state, step=s, generation=1, world_size=1))
                      for step in range(3, 3 + repeats)]
        step = 2 + repeats
        result.update({"stall_s": statistics.median(steady), "runs": steady, "first_snapshot_s": first,
                       "second_snapshot_s": second, "background_reserve_s": reserve, "extra_memory_bytes": snapshots.nbytes_reserved(),
                       "rss_delta_bytes": memory.extra})
        started = time.perf_counter()
        read = snapshots.read(step, live={"replica": replica_state(model, optimizer)})
        model.load_state_dict(read["replica"]["models"][0])
        optimizer.load_state_dict(read["replica"]["optimizers"][0])
        result["load_t1_s"] = time.perf_counter() - started
        del read
        if not full:
            return result
        source = persist_from if persist_from is not None else snapshots
        return persist_and_load(model, optimizer, work, source, state, result)
    finally:
        snapshots.close()
        shutil.rmtree(shm_dir.parent, ignore_errors=True)


def persist_and_load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, work: Path, source: RankSnapshots,
                     state: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """T2 from a slot of ``source`` written now (the persister's wall and CPU seconds, the training
    thread's GIL waits meanwhile), then the verified T2 load back into the model."""
    root = work / "undying"
    step = max((info.step for info in source.committed()), default=0) + 1
    source.write(state, step=step, generation=1, world_size=1)
    settle_page_cache()
    idle = gil_waits(lambda: True, at_least=0.5)
    persister = Persister(snapshots=source, root=root, rank=0,
                          store=torch.distributed.HashStore(), key_prefix="bench", keep=1,
                          param_names=[optimizer_param_names(optimizer, [model])], rank_file="rank_00000.pt",
                          records_timeout=600, current_generation=lambda: 1)
    started, cpu = time.perf_counter(), time.process_time()
    submitted = persister.submit(step, 1, [0])
    busy = gil_waits(lambda: persister.flush(0))
    result["persist_s"] = time.perf_counter() - started
    result["persist_cpu_s"] = time.process_time() - cpu
    result["submit_s"] = submitted
    result["gil_wait_idle"], result["gil_wait_persisting"] = idle, busy
    persister.close()
    [outcome] = persister.results()
    assert outcome.committed, outcome
    result["checkpoint_bytes"] = outcome.nbytes
    started = time.perf_counter()
    checkpoint = latest_verified(root)
    loaded = read_shared_shard(checkpoint, verified=True)
    model.load_state_dict(loaded["models"][0])
    optimizer.load_state_dict(loaded["optimizers"][0])
    result["load_t2_s"] = time.perf_counter() - started
    del loaded
    shutil.rmtree(root, ignore_errors=True)  # the next round's (or size's) steps may be lower
    return result


def measure_in_loop(layers: int, batch: int, rounds: int) -> dict[str, Any]:
    """What a snapshot costs a real training loop (forward, backward, AdamW step): one step of each
    kind per round, interleaved so that drift of the machine hits every kind alike.

    - ``none``: no snapshot;
    - ``boundary``: the whole snapshot copied at the step boundary (``checkpoint.overlap: false``);
    - ``overlapped``: buffers and the skeleton copied at the boundary, parameters and AdamW state
      on a helper thread while the next step's forward and backward run; the AdamW step waits for
      it (what the runtime's wrapped optimizer does).

    A snapshot's cost to training is its step's time minus a step without one; for ``overlapped``
    also the seconds the training thread was blocked (its part at the boundary plus the wait)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False, device=DEVICE) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    inputs = torch.randn(batch, WIDTH, device=DEVICE)

    def forward_backward() -> None:
        optimizer.zero_grad(set_to_none=False)
        model(inputs).square().mean().backward()

    forward_backward()
    optimizer.step()  # AdamW's state exists from here on
    shm_dir = Path(os.environ.get("UNDYING_SHM_DIR", "/dev/shm")) / f"undying-bench-loop-{os.getpid()}" / "node0"
    snapshots = RankSnapshots(shm_dir, rank=0, slots=2)
    defer = updated_only_by([optimizer])  # what the runtime defers: parameters and AdamW state

    def state() -> dict[str, Any]:
        return {"replica": replica_state(model, optimizer), "rank": {"rng": {"torch": torch.get_rng_state()}}}

    step = 0
    blocked: list[float] = []

    def one_step(kind: str) -> float:
        nonlocal step
        step += 1
        started = time.perf_counter()
        if kind != "none":  # the commit boundary of the previous step
            snapshots.write(state(), step=step, generation=1, world_size=1,
                            defer=defer if kind == "overlapped" else None)
        boundary = time.perf_counter() - started
        forward_backward()
        waited = snapshots.wait()  # the wrapped optimizer's step waits for an overlapped copy
        optimizer.step()
        synchronize()
        if kind == "overlapped":
            blocked.append(boundary + waited)
        return time.perf_counter() - started

    try:
        for kind in ("boundary", "overlapped", "boundary"):  # slots allocated, everything warm
            one_step(kind)
            snapshots.wait_reserved()
        blocked.clear()
        kinds = ("none", "boundary", "overlapped")
        steps: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(rounds):
            for kind in kinds:
                steps[kind].append(one_step(kind))
    finally:
        snapshots.close()
        shutil.rmtree(shm_dir.parent, ignore_errors=True)
    median = {kind: statistics.median(times) for kind, times in steps.items()}
    return {"batch": batch, "rounds": rounds, "step_s": median, "runs": steps,
            "cost_boundary_s": median["boundary"] - median["none"],
            "cost_overlapped_s": median["overlapped"] - median["none"],
            "blocked_overlapped_s": statistics.median(blocked)}


def measure_torch_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, work: Path) -> dict[str, Any]:
    path = work / "torch_save.pt"
    cpu = time.process_time()
    with PeakRss() as memory:
        stall = timed(lambda: torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path))

    def sync() -> None:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())

    durable = stall + timed(sync)
    cpu = time.process_time() - cpu
    started = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    load = time.perf_counter() - started
    del loaded
    path.unlink()
    return {"stall_s": stall, "persist_s": durable, "persist_cpu_s": cpu, "load_s": load,
            "rss_delta_bytes": memory.extra}


def measure_write(tensors: list[torch.Tensor], work: Path) -> dict[str, Any]:
    """The disk's own speed for the same bytes: every tensor's bytes written in turn into one file by
    one thread, then fsynced; no format, no checksum (what no checkpoint method can beat)."""
    path = work / "raw.bin"
    started, cpu = time.perf_counter(), time.process_time()
    with open(path, "wb") as handle:
        for tensor in tensors:
            handle.write(memoryview(tensor.detach().cpu().contiguous().numpy()).cast("B"))
        handle.flush()
        os.fsync(handle.fileno())
    result = {"persist_s": time.perf_counter() - started, "persist_cpu_s": time.process_time() - cpu}
    path.unlink()
    return result


def measure_async_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, work: Path) -> dict[str, Any]:
    directory = work / "async_save"
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    idle = gil_waits(lambda: True, at_least=0.5)
    with PeakRss() as memory:
        started, cpu = time.perf_counter(), time.process_time()
        future = dcp.async_save(state, checkpoint_id=str(directory), no_dist=True)
        stall = time.perf_counter() - started
        busy = gil_waits(future.done)
        future.result()
        persist = time.perf_counter() - started
        cpu = time.process_time() - cpu
    shutil.rmtree(directory, ignore_errors=True)
    return {"stall_s": stall, "persist_s": persist, "persist_cpu_s": cpu, "rss_delta_bytes": memory.extra,
            "gil_wait_idle": idle, "gil_wait_persisting": busy}


def medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The first round's result, its persist and load times replaced by the median over all rounds
    (each round's value kept beside it, as ``<key>_runs``)."""
    merged = dict(results[0])
    for key in ("persist_s", "persist_cpu_s", "load_t2_s", "load_s"):
        values = [result[key] for result in results if key in result]
        if values:
            merged[key] = statistics.median(values)
            merged[f"{key}_runs"] = values
    return merged


def run_size(name: str, work: Path, repeats: int, loop_rounds: int, rounds: int = 1) -> dict[str, Any]:
    layers, adamw, full = SIZES[name]
    model, optimizer = build(layers, adamw)
    _, tensors = flatten_state(replica_state(model, optimizer))
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    params = sum(parameter.numel() for parameter in model.parameters())
    print(f"{name}: {params / 1e6:.0f}M parameters, adamw={adamw}, {nbytes / 2**30:.2f} GiB of state", flush=True)
    row: dict[str, Any] = {"size": name, "parameters": params, "adamw": adamw, "state_bytes": nbytes,
                           "threads": torch.get_num_threads()}
    row["copy"] = measure_copy(tensors, repeats)
    print(f"  copy_ {row['copy']['stall_s']:.3f} s", flush=True)
    # Each round runs every method once, in turn, so that the machine's drift (other processes, the
    # disk's cache) hits each alike; the row holds each timing's median and every round's value.
    runs: dict[str, list[dict[str, Any]]] = {"undying": [], "torch_save": [], "async_save": [], "write": []}
    steady_dir = Path(os.environ.get("UNDYING_SHM_DIR", "/dev/shm")) / f"undying-bench-steady-{os.getpid()}" / "node0"
    steady = RankSnapshots(steady_dir, rank=0, slots=2) if full else None
    if steady is not None:  # both slots allocated and written once before the first round
        warm = {"replica": replica_state(model, optimizer), "rank": {"rng": {"torch": torch.get_rng_state()},
                                                                     "statefuls": {}}}
        for warm_step in (1, 2):
            steady.write(warm, step=warm_step, generation=1, world_size=1)
            steady.wait_reserved()
    for round_index in range(rounds):
        settle_page_cache()
        if round_index and steady is not None:  # stalls measured once: later rounds persist and load only
            runs["undying"].append(persist_and_load(model, optimizer, work, steady, warm, {}))
        else:
            runs["undying"].append(measure_undying(model, optimizer, work, full, repeats, steady))
        print(f"  undying {runs['undying'][-1]}", flush=True)
        settle_page_cache()
        runs["torch_save"].append(measure_torch_save(model, optimizer, work))
        print(f"  torch.save {runs['torch_save'][-1]}", flush=True)
        if full:
            settle_page_cache()
            runs["async_save"].append(measure_async_save(model, optimizer, work))
            print(f"  async_save {runs['async_save'][-1]}", flush=True)
            settle_page_cache()
            runs["write"].append(measure_write(tensors, work))
            print(f"  write+fsync {runs['write'][-1]}", flush=True)
    if steady is not None:
        steady.close()
        shutil.rmtree(steady_dir.parent, ignore_errors=True)
    for method, results in runs.items():
        if results:
            row[method] = medians(results)
    if adamw and loop_rounds:
        del model, optimizer, tensors
        row["loop"] = measure_in_loop(layers, LOOP_BATCH, loop_rounds)
        print(f"  loop {row['loop']}", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3, help="steady-state snapshots / copies timed per size")
    parser.add_argument("--loop-rounds", type=int, default=7,
                        help="training-loop rounds (one step without, one with a boundary, one with an "
                             "overlapped snapshot); 0 skips the loop measurement")
    parser.add_argument("--rounds", type=int, default=1,
                        help="persist and load measurements per method, interleaved (medians reported)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: model and optimizer on the GPU, "
                        "every size with AdamW state")
    parser.add_argument("--work-dir", default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--out", default="bench/results/checkpoint.json")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
        for name, (layers, _, _) in SIZES.items():  # GPU memory and a large host: every size in full
            SIZES[name] = (layers, True, True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="undying-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for name in args.sizes:
            rows.append(run_size(name, work, args.repeats, args.loop_rounds, args.rounds))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "torch": torch.__version__,
              "cpus": os.cpu_count(), "device": str(DEVICE), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(table(rows))
    print(loop_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
