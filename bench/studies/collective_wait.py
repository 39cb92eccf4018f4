"""What waiting for a gloo all-reduce costs, two ways: in the work's own ``wait`` bounded to a poll
period (what ``GenerationGroup`` does for gloo, runtime/pg.py), or on an event that a done-callback
on the work's future sets (its way for NCCL's enqueue, and for gloo before: the callback runs on
gloo's thread and needs the GIL).

Spawns WORLD gloo processes on loopback, each with two ``GenerationGroup``s over gloo, one told its
backend is another (so that its waits take the callback way, everything else in the product's
waiting loop alike: abort flag, deadline, the controller asked after a long wait); per round each
rank sums a tensor of each size PER_ROUND times through the one, then the other, so that machine
noise falls on both alike. Per way and size each rank records, per all-reduce, its thread's CPU time
(``time.thread_time``), its whole process's (``time.process_time``: gloo's threads too) and the
wall time; the report gives the medians over the rounds of their means, per rank, and the sums are
checked against the exact result.

    python bench/studies/collective_wait.py --world 4 --rounds 20 --per-round 100 --out bench/results/collective_wait.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared helpers
from spawn_ranks import join_gloo, leave_with, report_ranks, spawn_ranks  # noqa: E402

WAYS = ("bounded wait", "callback event")
CALLBACK_BACKEND = "gloo, waited by callback"  # neither "gloo" nor "nccl": pg.py's callback way without device polls


def worker(rank: int, args: argparse.Namespace, port: int, queue: mp.Queue) -> None:  # spawn_ranks' target
    import torch

    from undying.runtime.pg import GenerationGroup

    store = join_gloo(rank, args.world, port)
    groups = {way: GenerationGroup(store, f"wait-{index}", 1, rank, args.world, "gloo", 60.0, torch.device("cpu"))
              for index, way in enumerate(WAYS)}
    groups["callback event"].backend = CALLBACK_BACKEND
    sizes = [int(size) for size in args.sizes.split(",")]
    tensors = {size: torch.empty(size, dtype=torch.float64) for size in sizes}
    expected = {size: float(sum(range(1, args.world + 1))) for size in sizes}
    samples: dict[str, dict[int, dict[str, list[float]]]] = {
        way: {size: {"thread_us": [], "process_us": [], "wall_us": []} for size in sizes} for way in WAYS}
    ok = True
    for round_index in range(args.rounds + 1):  # the first round warms up, unrecorded
        for size in sizes:
            for way in WAYS:
                tensor = tensors[size]
                thread, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
                for _ in range(args.per_round):
                    tensor.fill_(rank + 1)
                    groups[way].allreduce_sum(tensor)
                    ok = ok and float(tensor[0]) == expected[size]
                if round_index:
                    record = samples[way][size]
                    record["thread_us"].append((time.thread_time() - thread) / args.per_round * 1e6)
                    record["process_us"].append((time.process_time() - process) / args.per_round * 1e6)
                    record["wall_us"].append((time.perf_counter() - wall) / args.per_round * 1e6)
    summary = {way: {str(size): {key: round(statistics.median(values), 1) for key, values in record.items()}
                     for size, record in by_size.items()} for way, by_size in samples.items()}
    leave_with(queue, rank, {"sums_exact": ok, "medians": summary})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--sizes", default="2,262144", help="comma-separated float64 element counts "
                        "(2: the commit vote; 262144: a 2 MiB bucket)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = spawn_ranks(args.world, worker, args)
    report_ranks(args, results)
    for size in args.sizes.split(","):
        for key in ("thread_us", "process_us", "wall_us"):
            row = [f"{way}: " + ", ".join(f"{results[rank]['medians'][way][size][key]:.1f}" for rank in sorted(results))
                   for way in WAYS]
            print(f"{size:>7} elements  {key:10}  " + "  |  ".join(row))
    print("sums exact on every rank:", all(result["sums_exact"] for result in results.values()))


if __name__ == "__main__":
    main()
