"""What gathering a step's gradients into DDP's buckets costs, two ways: every gradient copied in
one fused call and the buffer then scaled by ``1 / world`` in another (two passes over the bytes),
or a gradient of at least ``FUSED_MIN_ELEMENTS`` multiplied into its place by a call of its own (one
pass, DDP's ``mul_out``) and only the smaller ones copied and scaled together (what
``Bucket.gather`` does, runtime/ddp_buckets.py).

Each of WORLD processes (none talking to another: they only share the machine's cores and memory,
as a job's ranks do) builds the example GPT at each size, gives every parameter a random gradient,
lays its parameters out in one bucket and gathers them PER_ROUND times each way in turn, for ROUNDS
rounds; a run of many small parameters (1024 elements each) shows the way for them is unchanged.
Per way and size each rank records its thread's CPU time per gather (``time.thread_time``); the
report gives, per rank, the median over the rounds, and whether both ways filled the bucket with
the same bits.

    python bench/studies/bucket_gather.py --world 4 --rounds 15 --per-round 50 --out bench/results/bucket_gather.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))  # the shared helpers
from spawn_ranks import example_gpt, leave_with, report_ranks, spawn_ranks  # noqa: E402

WAYS = ("copy, then scale", "as built")
SMALL = "256 x 1024"  # many small parameters


def worker(rank: int, args: argparse.Namespace, _port: int, queue: mp.Queue) -> None:  # spawn_ranks' target
    import torch

    from undying._torch_compat.tensors import foreach_copy
    from undying.runtime.ddp_buckets import Bucket, CommHook

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    models: dict[str, list[torch.nn.Parameter]] = {}
    for size in args.sizes.split(","):
        n_layer, n_embd = (int(part) for part in size.split("x"))
        models[size] = list(example_gpt(REPO, 64, n_layer, n_embd)().parameters())
    models[SMALL] = [torch.nn.Parameter(torch.zeros(1024)) for _ in range(256)]
    samples: dict[str, dict[str, list[float]]] = {size: {way: [] for way in WAYS} for size in models}
    same_bits: dict[str, bool] = {}
    for size, params in models.items():
        for param in params:
            param.grad = torch.randn_like(param)
        bucket = Bucket(params, torch.device("cpu"))

        def copy_then_scale(bucket: Bucket = bucket) -> None:  # Bucket.gather before this way
            sources, destinations = [], []
            for param, view in zip(bucket.params, bucket.views, strict=True):
                if param.grad is None:
                    view.zero_()
                else:
                    sources.append(param.grad)
                    destinations.append(view)
            foreach_copy(destinations, sources)
            bucket.flat.mul_(1 / args.world)

        ways = {WAYS[0]: copy_then_scale, WAYS[1]: lambda bucket=bucket: bucket.gather(CommHook.NONE, 1, args.world)}
        outputs = []
        for way in WAYS:
            ways[way]()
            outputs.append(bucket.flat.clone())
        same_bits[size] = torch.equal(*outputs)
        for round_index in range(args.rounds + 1):  # the first round warms up, unrecorded
            for way in WAYS:
                started = time.thread_time()
                for _ in range(args.per_round):
                    ways[way]()
                if round_index:
                    samples[size][way].append((time.thread_time() - started) / args.per_round * 1e6)
    summary = {size: {way: round(statistics.median(values), 1) for way, values in by_way.items()}
               for size, by_way in samples.items()}
    elements = {size: sum(param.numel() for param in params) for size, params in models.items()}
    leave_with(queue, rank, {"same_bits": same_bits, "thread_us_per_gather": summary, "elements": elements})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--sizes", default="4x128,4x224,8x320", help="the example GPT's n_layer x n_embd")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = spawn_ranks(args.world, worker, args)
    report_ranks(args, results)
    for size, elements in results[0]["elements"].items():
        row = [f"{way}: " + ", ".join(f"{results[rank]['thread_us_per_gather'][size][way]:.0f}" for rank in sorted(results))
               for way in WAYS]
        print(f"{size:>10} ({elements} elements)  us per gather  " + "  |  ".join(row))
    print("same bits both ways on every rank:", all(all(result["same_bits"].values()) for result in results.values()))


if __name__ == "__main__":
    main()
