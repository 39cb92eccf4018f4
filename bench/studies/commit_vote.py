"""Step-commit cost: the vote as its own one-element all-reduce, folded into the gradient all-reduce,
or counted by a store round trip.

Spawns WORLD gloo processes on loopback; each times STEPS rounds of
(a) the all-reduce of the flat gradient buffer, then a one-element float32 all-reduce of the votes
(what undying does: the gradients are averaged during backward, the vote comes at opt.step()),
(b) one all-reduce of the buffer with one extra vote element (what undying did before), and
(c) the all-reduce of the buffer alone plus a store barrier that counts the votes.
Reports the median extra cost per step of each over a plain all-reduce.

    python bench/studies/commit_vote.py --world 4 --numel 1000000 --steps 50
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared helpers
from spawn_ranks import spawn_ranks  # noqa: E402


def worker(rank: int, world: int, numel: int, steps: int, port: int, queue: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=60))
    group = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), rank, world, datetime.timedelta(seconds=60))
    plain = torch.ones(numel)
    voted = torch.ones(numel + 1)
    vote = torch.ones(1)
    timings: dict[str, list[float]] = {"plain": [], "separate": [], "folded": [], "store": []}
    for step in range(steps):
        group.barrier().wait()
        started = time.perf_counter()
        group.allreduce([plain]).wait()
        timings["plain"].append(time.perf_counter() - started)
        group.barrier().wait()
        started = time.perf_counter()
        group.allreduce([plain]).wait()
        group.allreduce([vote]).wait()
        assert int(vote.item()) == world
        vote.fill_(1.0)
        timings["separate"].append(time.perf_counter() - started)
        group.barrier().wait()
        started = time.perf_counter()
        group.allreduce([voted]).wait()
        assert int(voted[-1].item()) >= world  # every rank voted yes
        voted[-1] = 1.0
        timings["folded"].append(time.perf_counter() - started)
        group.barrier().wait()
        started = time.perf_counter()
        group.allreduce([plain]).wait()
        store.add(f"vote/{step}", 1)
        while int(store.add(f"vote/{step}", 0)) < world:
            time.sleep(0.0001)
        timings["store"].append(time.perf_counter() - started)
    queue.put((rank, {name: statistics.median(values) for name, values in timings.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    results = spawn_ranks(args.world, worker, args.world, args.numel, args.steps)
    rank0 = results[0]
    report = {
        "world": args.world, "numel": args.numel, "steps": args.steps,
        "median_allreduce_ms": round(rank0["plain"] * 1e3, 3),
        "median_separate_vote_ms": round(rank0["separate"] * 1e3, 3),
        "median_folded_vote_ms": round(rank0["folded"] * 1e3, 3),
        "median_store_vote_ms": round(rank0["store"] * 1e3, 3),
        "separate_overhead_ms": round((rank0["separate"] - rank0["plain"]) * 1e3, 3),
        "folded_overhead_ms": round((rank0["folded"] - rank0["plain"]) * 1e3, 3),
        "store_overhead_ms": round((rank0["store"] - rank0["plain"]) * 1e3, 3),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
