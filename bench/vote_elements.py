"""What a small gloo all-reduce costs by its number of elements: why the commit vote packs its counts.

``--world`` gloo processes on loopback, each all-reduce preceded by a barrier, ``--rounds`` rounds;
the median of rank 0's times for 1 float32 and 1, 2, 3, 4 and 6 float64 elements.

    python bench/vote_elements.py --world 4 --out bench/results/vote_elements.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn_ranks import spawn_ranks  # noqa: E402

SHAPES = (("1 float32", 1, "float32"), *((f"{n} float64", n, "float64") for n in (1, 2, 3, 4, 6)))


def worker(rank: int, world: int, rounds: int, port: int, queue: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=60))
    group = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), rank, world, datetime.timedelta(seconds=60))
    times: dict[str, list[float]] = {name: [] for name, _, _ in SHAPES}
    for _ in range(rounds):
        for name, count, dtype in SHAPES:
            group.barrier().wait()
            started = time.perf_counter()
            values = torch.ones(count, dtype=getattr(torch, dtype))
            group.allreduce([values]).wait()
            values.tolist()
            times[name].append(time.perf_counter() - started)
    queue.put((rank, {name: round(statistics.median(seconds) * 1e3, 3) for name, seconds in times.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    medians = spawn_ranks(args.world, worker, args.world, args.rounds)[0]
    report = {"world": args.world, "rounds": args.rounds, "load_average": round(os.getloadavg()[0], 2),
              "median_ms": medians}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
