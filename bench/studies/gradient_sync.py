"""Step time of three gradient syncs on the example GPT: undying's averaged during backward (buckets
started as their gradients are ready), undying's averaged at ``opt.step()`` (what it did before),
and stock DDP. Each undying step also pays its commit vote (one float32 all-reduce).

Spawns WORLD gloo processes on loopback; each builds the three models (same weights) and times
STEPS steps of each, the three interleaved step by step so that machine noise falls on all of them
alike. Reports the median step time of each on rank 0.

    python bench/studies/gradient_sync.py --world 4 --steps 40 --n-layer 4 --n-embd 128 --bucket-mb 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))  # the shared helpers
from spawn_ranks import (  # noqa: E402
    add_gpt_arguments,
    example_gpt,
    gpt_batch,
    gpt_step,
    join_gloo,
    leave_with,
    spawn_ranks,
)


def worker(rank: int, args: argparse.Namespace, port: int, queue: mp.Queue) -> None:  # spawn_ranks' target
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from undying.runtime.ddp import FixedLayoutDDP, commit_vote
    from undying.runtime.ddp_options import parse_ddp_options
    from undying.runtime.pg import GenerationGroup

    world = args.world
    store = join_gloo(rank, world, port)
    group = GenerationGroup(store, "undying", 1, rank, world, "gloo", 60.0, torch.device("cpu"))
    gpt = example_gpt(REPO, args.block_size, args.n_layer, args.n_embd)
    options = parse_ddp_options({"bucket_cap_mb": args.bucket_mb}, torch.device("cpu"))  # DDP's buckets

    models = {
        "undying_in_backward": FixedLayoutDDP(gpt(), lambda: group, torch.device("cpu"), options=options),
        "undying_at_step": FixedLayoutDDP(gpt(), lambda: group, torch.device("cpu"), options=options,
                                          ready_to_sync=lambda: False),
        "ddp": DistributedDataParallel(gpt(), bucket_cap_mb=args.bucket_mb),
    }
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, model in models.items()}

    def vote() -> None:
        assert commit_vote(group, True, torch.device("cpu"))

    generator = torch.Generator().manual_seed(rank)
    timings: dict[str, list[float]] = {name: [] for name in models}
    for step in range(args.steps + args.warmup):
        x, y = gpt_batch(args, generator)
        for name, model in models.items():
            dist.barrier()
            started = time.perf_counter()
            gpt_step(model, optimizers[name], x, y, vote)
            if step >= args.warmup:
                timings[name].append(time.perf_counter() - started)
    leave_with(queue, rank, {name: statistics.median(values) for name, values in timings.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    add_gpt_arguments(parser)
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="bucket cap of both undying and DDP")
    args = parser.parse_args()
    results = spawn_ranks(args.world, worker, args)
    print(json.dumps({**vars(args), **{f"median_step_ms_{name}": round(seconds * 1e3, 2)
                                        for name, seconds in results[0].items()}}, indent=2))


if __name__ == "__main__":
    main()
