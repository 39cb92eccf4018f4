"""Peak host memory of a repair and of a T2 restore's broadcast: what the sender and each receiver
hold beyond their own state while a replica state travels (runtime/state_transfer.py).

Spawns 1 + RECEIVERS gloo processes on loopback. Rank 0 holds a replica state like a job's: a model
of fp32 tensors and a stepped AdamW over them (exp_avg, exp_avg_sq and a host ``step`` per
parameter), STATE_MIB in all. Rank 1 receives with nothing of its own to fill (``live: none``);
every further rank is a replacement rank that holds its model's parameters but no optimizer state
yet (``live: model``): its parameters are filled in place. Two phases: a repair (``send_state`` to
every receiver) and a restore (``broadcast_state`` from rank 0). In each, every rank resets its
peak RSS (Linux: ``/proc/self/clear_refs``), runs the transfer and reads ``VmHWM``; the extra is
that peak minus the RSS at the reset. glibc is told to map every allocation of 64 KiB or more on its
own (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the RSS at once and the peak is the
tensors' own. Afterwards each receiver checks what it got against a fresh build of the source state.

    python bench/repair_memory.py --state-mib 256 --bucket-mib 64 --receivers 2 --out bench/results/repair_memory.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing as mp
import os
import re
import time
from pathlib import Path
from typing import Any

from spawn_ranks import spawn_ranks

MMAP_THRESHOLD = 64 << 10
MIB = 1 << 20


def status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE).group(1))  # type: ignore[union-attr]


def reset_peak() -> int:
    """Set this process's VmHWM to its current RSS (Linux >= 4.0); returns that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return status_kib("VmRSS") << 10


def source_state(args: argparse.Namespace) -> dict[str, Any]:
    """The replica state rank 0 holds, built the same way by every rank (to check what arrived)."""
    import torch

    torch.manual_seed(0)
    tensor_numel = int(args.tensor_mib * MIB) // 4
    count = max(1, round(args.state_mib / (3 * args.tensor_mib)))  # a parameter, exp_avg, exp_avg_sq
    params = [torch.nn.Parameter(torch.randn(tensor_numel)) for _ in range(count)]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for param in params:
        param.grad = torch.randn(tensor_numel)
    optimizer.step()
    model = {f"layer{index}.weight": param.detach() for index, param in enumerate(params)}
    return {"committed_step": 1, "models": [model], "optimizers": [optimizer.state_dict()],
            "loaders": [{"epoch": 0, "position": 8}], "statefuls": {}}


def replacement_live(source: dict[str, Any]) -> dict[str, Any]:
    """What a replacement rank holds before its repair: its model's parameters, no optimizer state."""
    import torch

    model = {name: torch.zeros_like(tensor) for name, tensor in source["models"][0].items()}
    fresh = torch.optim.AdamW([torch.nn.Parameter(tensor) for tensor in model.values()], lr=1e-3)
    return {"models": [model], "optimizers": [fresh.state_dict()]}


def tensors_of(state: Any) -> list[Any]:
    from undying.checkpoint.state_tree import flatten_state

    return flatten_state(state)[1]


def rank_main(rank: int, args: argparse.Namespace, port: int, queue: mp.Queue) -> None:  # spawn_ranks' target
    import torch
    import torch.distributed as dist

    from undying.runtime import state_transfer
    from undying.runtime.pg import GenerationGroup

    torch.set_num_threads(1)
    state_transfer.BUCKET_BYTES = int(args.bucket_mib * MIB)
    cpu = torch.device("cpu")
    world = 1 + args.receivers
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=120))
    group = GenerationGroup(store, "repair-memory", 1, rank, world, "gloo", 600.0, cpu)
    live_kind = "source" if rank == 0 else "none" if rank == 1 else "model"
    source = source_state(args) if rank == 0 else None
    live: dict[str, Any] | None = None
    if live_kind == "model":
        live = replacement_live(source_state(args))
        gc.collect()
    # A small transfer first: the code it runs is paged in before anything is measured.
    warm_up = {"tensors": [torch.ones(1000), torch.ones(3, dtype=torch.int64)]}
    state_transfer.broadcast_state(group, warm_up if rank == 0 else None, 0, cpu)
    rows: dict[str, Any] = {}
    for phase in ("repair", "restore"):
        if live is not None:
            for tensor in tensors_of(live):
                tensor.zero_()  # what arrives must really be written into them
        group.allreduce_sum(torch.zeros(1))
        gc.collect()
        baseline = reset_peak()
        started = time.perf_counter()
        if phase == "repair" and rank == 0:
            state_transfer.send_state(group, source, list(range(1, world)), cpu)
            received = None
        elif phase == "repair":
            received = state_transfer.recv_state(group, 0, cpu, live=live)
        else:
            received = state_transfer.broadcast_state(group, source, 0, cpu, live=live)
        seconds = time.perf_counter() - started
        row: dict[str, Any] = {"rank": rank, "live": live_kind, "seconds": round(seconds, 4),
                               "peak_extra_bytes": (status_kib("VmHWM") << 10) - baseline}
        group.allreduce_sum(torch.zeros(1))
        if rank > 0:
            got = tensors_of(received)
            expected = tensors_of(source_state(args))
            row["equal"] = len(got) == len(expected) and all(
                a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, expected, strict=True))
            steps = [entry["step"] for entry in received["optimizers"][0]["state"].values()]
            row["steps_on_host"] = bool(steps) and all(step.device.type == "cpu" for step in steps)
            if live is not None:
                row["filled_live_in_place"] = all(
                    received["models"][0][name].data_ptr() == tensor.data_ptr()
                    for name, tensor in live["models"][0].items())
            del got, expected
        rows[phase] = row
        del received
    group.allreduce_sum(torch.zeros(1))
    queue.put((rank, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=float, default=256.0, help="model + AdamW state, fp32")
    parser.add_argument("--tensor-mib", type=float, default=4.0, help="size of each parameter")
    parser.add_argument("--bucket-mib", type=float, default=64.0, help="state_transfer.BUCKET_BYTES")
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        parser.error("needs Linux: the peak RSS is reset through /proc/self/clear_refs")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # read by glibc in each spawned rank
    results = spawn_ranks(1 + args.receivers, rank_main, args)
    import torch

    from undying.runtime import state_transfer

    state_transfer.BUCKET_BYTES = int(args.bucket_mib * MIB)
    state = source_state(args)
    state_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors_of(state))
    model_bytes = sum(tensor.numel() * tensor.element_size() for tensor in state["models"][0].values())
    report = {"state_mib": args.state_mib, "tensor_mib": args.tensor_mib, "bucket_mib": args.bucket_mib,
              "receivers": args.receivers, "torch": torch.__version__, "state_bytes": state_bytes,
              "model_bytes": model_bytes, "bucket_bytes": int(args.bucket_mib * MIB),
              "buckets": len(state_transfer.buckets_of(state_transfer.layout_of(tensors_of(state)))),
              "phases": {phase: [results[rank][phase] for rank in sorted(results)] for phase in ("repair", "restore")}}
    for phase, rows in report["phases"].items():
        for row in rows:
            checks = " ".join(f"{key}={row[key]}" for key in ("equal", "steps_on_host", "filled_live_in_place")
                              if key in row)
            print(f"{phase:8} rank {row['rank']} live={row['live']:6} peak extra "
                  f"{row['peak_extra_bytes'] / MIB:8.1f} MiB of a {state_bytes / MIB:.1f} MiB state, "
                  f"{row['seconds']:.3f} s {checks}", flush=True)
    text = json.dumps(report, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
