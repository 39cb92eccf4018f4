"""Two gloo groups per recovery: built one after the other, or at once on two threads of each process.

Every recovery builds two groups of the same members (the training group and torch's default
group: runtime/membership.py). This measures gloo alone, outside undying: W spawned processes, each
with two client connections to one TCPStore (a TCPStore client serializes its calls, so two builds
sharing one connection block each other until the store's timeout), build two
``ProcessGroupGloo`` on fresh prefixes, ``sequential`` (one, then the other, as undying does) or
``threads`` (the second on a thread of its own while the first is built). Every process starts
together (a count in the store); the figure is the slowest process's time for both groups, for each
of ``ROUNDS`` builds, and the modes alternate ``--repeats`` times.

    python bench/studies/group_build.py --worlds 4 8 16 --repeats 2 --out bench/results/group_build.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("sequential", "threads")
ROUNDS = 3
TIMEOUT = datetime.timedelta(seconds=60)


def build_both(first: dist.Store, second: dist.Store, rank: int, world: int, mode: str) -> float:
    started = time.perf_counter()
    if mode == "sequential":
        groups = [dist.ProcessGroupGloo(first, rank, world, TIMEOUT), dist.ProcessGroupGloo(second, rank, world, TIMEOUT)]
    else:
        built: list[Any] = []
        helper = threading.Thread(target=lambda: built.append(dist.ProcessGroupGloo(second, rank, world, TIMEOUT)))
        helper.start()
        groups = [dist.ProcessGroupGloo(first, rank, world, TIMEOUT)]
        helper.join()
        if not built:
            raise RuntimeError("the second group's build failed")
        groups += built
    seconds = time.perf_counter() - started
    del groups
    return seconds


def process_main(rank: int, world: int, port: int, prefix: str, mode: str, results: Any) -> None:
    stores = [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT) for _ in range(2)]
    for build in range(ROUNDS):
        key = f"{prefix}/{build}"
        stores[0].add(f"{key}/arrived", 1)
        while stores[0].add(f"{key}/arrived", 0) < world:
            time.sleep(0.001)
        first, second = (dist.PrefixStore(f"{key}/{group}", store) for group, store in zip("ab", stores, strict=True))
        results.put((build, build_both(first, second, rank, world, mode)))


def measure(world: int, mode: str, prefix: str, server: dist.TCPStore) -> list[float]:
    """The slowest process's seconds for each build."""
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=process_main, args=(rank, world, server.port, prefix, mode, results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    slowest = [0.0] * ROUNDS
    for _ in range(world * ROUNDS):
        build, seconds = results.get(timeout=300)
        slowest[build] = max(slowest[build], seconds)
    for process in processes:
        process.join(timeout=60)
    return [round(seconds, 4) for seconds in slowest]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    runs = []
    for world in args.worlds:
        for repeat in range(args.repeats):
            for mode in MODES:  # alternated: a change in the machine's load falls on both
                builds = measure(world, mode, f"w{world}/r{repeat}/{mode}", server)
                runs.append({"world": world, "mode": mode, "repeat": repeat, "slowest_s": builds})
                print(json.dumps(runs[-1]), flush=True)
    print("| world | two groups built | slowest process, median s | every build s |")
    print("| --- | --- | --- | --- |")
    for world in args.worlds:
        for mode in MODES:
            builds = [seconds for run in runs if (run["world"], run["mode"]) == (world, mode) for seconds in run["slowest_s"]]
            print(f"| {world} | {mode} | {statistics.median(builds):.4f} | {', '.join(f'{s:.3f}' for s in builds)} |")
    if args.out:
        args.out.write_text(json.dumps({"command": "python bench/studies/group_build.py " + " ".join(sys.argv[1:]),
                                        "rounds": ROUNDS, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
