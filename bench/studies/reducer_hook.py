"""CPU per step of four ways to average gradients during backward: stock DDP, stock DDP with a Python
comm hook doing DDP's arithmetic, the same hook returning a future of its own that the all-reduce's
completion sets (an abort could set it first, without the all-reduce), and undying's Python buckets
(``FixedLayoutDDP``).

The question it answers: would torch's C++ reducer with undying's collectives in a comm hook cost
less per step than undying's per-parameter Python hooks? Spawns WORLD gloo processes on loopback;
each builds the four models (same weights, DDP's bucket caps) and runs STEPS steps of each, the four
interleaved step by step behind a barrier, so that machine noise falls on all alike. Per model and
step each rank records its training thread's CPU time (``time.thread_time``), its whole process's
(``time.process_time``: gloo's threads too) and the wall time, and reports their medians and
whether each model's final parameters are bitwise equal to stock DDP's.

    python bench/studies/reducer_hook.py --world 4 --steps 300 --out bench/results/reducer_hook.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))  # the shared helpers
from spawn_ranks import (  # noqa: E402
    add_gpt_arguments,
    example_gpt,
    gpt_batch,
    gpt_step,
    join_gloo,
    leave_with,
    report_ranks,
    spawn_ranks,
)


def worker(rank: int, args: argparse.Namespace, port: int, queue: mp.Queue) -> None:  # spawn_ranks' target
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from undying.runtime.ddp import FixedLayoutDDP
    from undying.runtime.ddp_options import parse_ddp_options
    from undying.runtime.pg import GenerationGroup

    world = args.world
    store = join_gloo(rank, world, port)
    hook_group = dist.new_group(backend="gloo")
    abortable_group = dist.new_group(backend="gloo")
    group = GenerationGroup(store, "undying", 1, rank, world, "gloo", 60.0, torch.device("cpu"))
    gpt = example_gpt(REPO, args.block_size, args.n_layer, args.n_embd)
    # The same arguments to DDP and to ft.wrap_model's reading of them: the same bucket layouts.
    ddp_arguments = {} if args.bucket_mb is None else {"bucket_cap_mb": args.bucket_mb}

    def ddp() -> DistributedDataParallel:
        return DistributedDataParallel(gpt(), **ddp_arguments)

    def python_hook(_state, bucket):  # unannotated: DDP checks a hook's annotations against its own types
        # DDP's arithmetic: each gradient times 1/world (one product per element), then the sum.
        buffer = bucket.buffer().mul_(1.0 / world)
        return dist.all_reduce(buffer, group=hook_group, async_op=True).get_future().then(lambda done: done.value()[0])

    def abortable_hook(_state, bucket):  # unannotated: DDP checks a hook's annotations against its own types
        # The future DDP's reducer waits on is ours: the all-reduce's completion sets it (on gloo's
        # thread), and an abort could set it first, from any thread, with the bucket as it is.
        buffer = bucket.buffer().mul_(1.0 / world)
        mine: torch.futures.Future = torch.futures.Future()
        once = threading.Lock()

        def complete(_done: Any) -> None:
            if once.acquire(blocking=False):
                mine.set_result(buffer)

        dist.all_reduce(buffer, group=abortable_group, async_op=True).get_future().add_done_callback(complete)
        return mine

    models: dict[str, torch.nn.Module] = {"ddp": ddp(), "ddp_python_hook": ddp(), "ddp_abortable_hook": ddp()}
    models["ddp_python_hook"].register_comm_hook(None, python_hook)
    models["ddp_abortable_hook"].register_comm_hook(None, abortable_hook)
    models["undying_buckets"] = FixedLayoutDDP(gpt(), lambda: group, torch.device("cpu"),
                                               options=parse_ddp_options(ddp_arguments, torch.device("cpu")))
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, model in models.items()}
    generator = torch.Generator().manual_seed(rank)
    timings: dict[str, dict[str, list[float]]] = {name: {"thread": [], "process": [], "wall": []} for name in models}
    for step in range(args.steps + args.warmup):
        x, y = gpt_batch(args, generator)
        for name, model in models.items():
            dist.barrier()
            thread, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
            gpt_step(model, optimizers[name], x, y)
            if step >= args.warmup:
                timings[name]["thread"].append(time.thread_time() - thread)
                timings[name]["process"].append(time.process_time() - process)
                timings[name]["wall"].append(time.perf_counter() - wall)
    reference = models["ddp"].module.state_dict()
    result = {name: {**{f"{kind}_ms": round(statistics.median(values) * 1e3, 3) for kind, values in kinds.items()},
                     "bitwise_equal_to_ddp": all(torch.equal(reference[key], value) for key, value in
                                                 getattr(models[name], "module", models[name]).state_dict().items())}
              for name, kinds in timings.items()}
    leave_with(queue, rank, result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    add_gpt_arguments(parser)
    parser.add_argument("--bucket-mb", type=float, default=None, help="DDP's bucket_cap_mb, and undying's (default: DDP's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = spawn_ranks(args.world, worker, args)
    print(json.dumps(report_ranks(args, results), indent=2))


if __name__ == "__main__":
    main()
