"""T1 per node: host memory and snapshot stall with 1, 2 and 4 data-parallel ranks on one node, the
replica kept in every rank's slots against once per node, each rank copying its part: its share of
the replica's bytes (now), or whole tensors dealt largest first (session 11's deal, kept here as
the baseline: ``whole_tensor_part``).

Real processes, one per local rank, each holding the same model and AdamW state (a stack of linear
layers, one optimizer step taken), write T1 snapshots through the engine's own classes
(checkpoint/snapshot.py, checkpoint/node_replica.py) into one node directory in /dev/shm, all at
once at every round (a barrier), as the ranks of a training step do; the same processes run both
ways in turn, each into a node directory of its own. Measured: the slowest rank's
copy per round (the step waits for it; median over the rounds), and the bytes the node's slot
files hold after the rounds (allocated blocks, every slot of every rank). The node's reader then
puts a snapshot back together on every rank and it is compared bitwise with the live state.
``--embedding ROWS`` puts an embedding of ROWS x 1024 in front of the layers (a language model's
vocabulary): a tensor larger than a rank's share, which whole-tensor dealing cannot balance.

    python bench/t1_per_node.py --ranks 1 2 4 --layers 12 --rounds 6 --out bench/results/t1_per_node.json
    python bench/t1_per_node.py --ranks 2 4 --layers 4 --embedding 65536 --rounds 8 --out bench/results/t1_per_node_embedding.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from undying.checkpoint.node_replica import PART, REPLICA, NodeReplica, replica_part  # noqa: E402
from undying.checkpoint.snapshot import RankSnapshots  # noqa: E402
from undying.checkpoint.state_tree import flatten_state  # noqa: E402

WIDTH = 1024  # square linear layers of 1024 x 1024 (+ bias): 1.05M parameters each


def replica_state(layers: int, embedding: int) -> dict[str, Any]:
    """The same model and AdamW state on every rank (same seed), as data-parallel replicas hold."""
    torch.manual_seed(0)
    front = [torch.nn.Embedding(embedding, WIDTH)] if embedding else []
    model = torch.nn.Sequential(*front, *[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randint(0, embedding, (4,)) if embedding else torch.randn(4, WIDTH)
    model(batch).sum().backward()
    optimizer.step()
    return {"committed_step": 1, "models": [model.state_dict()], "optimizers": [optimizer.state_dict()]}


MODES = ("per rank", "per node, whole tensors", "per node")


def whole_tensor_part(replica: Any, local_index: int, local_count: int) -> dict[str, Any]:
    """Session 11's part, the baseline: whole tensors, largest first, each to the part holding the
    fewest bytes so far; in today's part format (pieces that are whole tensors), which the node's
    reader reads as it reads any part."""
    part = replica_part(replica, local_index, local_count)  # the skeleton and the count, as today
    _, tensors = flatten_state(replica)
    load = [0] * local_count
    mine = []
    for index in sorted(range(len(tensors)), key=lambda i: (-tensors[i].numel() * tensors[i].element_size(), i)):
        owner = min(range(local_count), key=lambda candidate: (load[candidate], candidate))
        load[owner] += tensors[index].numel() * tensors[index].element_size()
        if owner == local_index:
            mine.append(index)
    mine.sort()
    part["pieces"] = [[index, 0, tensors[index].numel(), list(tensors[index].shape)] for index in mine]
    part["tensors"] = [tensors[index] for index in mine]
    return part


def rank_main(directories: dict[str, str], rank: int, ranks: int, model: tuple[int, int], rounds: int,
              barrier: Any, results: Any) -> None:
    """One local rank: every mode in turn, each into its own node directory."""
    torch.set_num_threads(1)
    replica = replica_state(*model)
    for mode in MODES:
        directory = Path(directories[mode])
        snapshots = RankSnapshots(directory, rank)
        seconds = []
        for step in range(1, rounds + 1):
            barrier.wait()
            started = time.perf_counter()
            if mode == "per rank":
                state = {REPLICA: replica, "rank": {"rng": torch.get_rng_state()}}
            else:
                deal = replica_part if mode == "per node" else whole_tensor_part
                state = {PART: deal(replica, rank, ranks), "rank": {"rng": torch.get_rng_state()}}
            assert snapshots.write(state, step=step, generation=1, world_size=ranks) is not None
            seconds.append(time.perf_counter() - started)
            snapshots.wait_reserved()  # the other slot grown in the background, before the next round
        barrier.wait()  # every rank's snapshots are written: read the node's back
        if mode == "per rank":
            read = snapshots.read(rounds)[REPLICA]
        else:
            node = NodeReplica(directory, snapshots, range(ranks), slots=2)
            assert node.held(ranks)[0] == rounds
            read = node.read(rounds, live={})[REPLICA]
        pairs = zip(flatten_state(read)[1], flatten_state(replica)[1], strict=True)
        results.put((mode, rank, seconds, all(torch.equal(a, b) for a, b in pairs), snapshots.committed()[0].nbytes))
        barrier.wait()  # the others' slots stay mapped until every rank has read
        snapshots.close()


def measure(ranks: int, model: tuple[int, int], rounds: int) -> list[dict[str, Any]]:
    directories = {mode: tempfile.mkdtemp(prefix="undying-t1-bench-", dir="/dev/shm") for mode in MODES}
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(ranks), context.Queue()
    processes = [context.Process(target=rank_main, args=(directories, rank, ranks, model, rounds, barrier, results))
                 for rank in range(ranks)]
    try:
        for process in processes:
            process.start()
        gathered = [results.get(timeout=600) for _ in range(ranks * len(MODES))]
        node_bytes = {mode: sum(path.stat().st_blocks * 512 for path in Path(directory).iterdir())
                      for mode, directory in directories.items()}
        for process in processes:
            process.join(timeout=60)
    finally:
        for directory in directories.values():
            shutil.rmtree(directory, ignore_errors=True)
    state_bytes = sum(t.numel() * t.element_size() for t in flatten_state(replica_state(*model))[1])
    rows = []
    for mode in MODES:
        mine = [(seconds, same) for kind, _, seconds, same, _ in gathered if kind == mode]
        largest = max(nbytes for kind, _, _, _, nbytes in gathered if kind == mode)
        per_round = [max(seconds[index] for seconds, _ in mine) for index in range(rounds)]
        steady = per_round[2:] or per_round  # the first rounds allocate and map the slots
        rows.append({"ranks": ranks, "mode": mode, "state_bytes": state_bytes, "node_bytes": node_bytes[mode],
                     "node_bytes_per_state": round(node_bytes[mode] / state_bytes, 3),
                     "largest_snapshot_bytes": largest,
                     "stall_median_s": round(statistics.median(steady), 4),
                     "stall_all_s": [round(value, 4) for value in per_round],
                     "bitwise_equal": all(same for _, same in mine)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embedding", type=int, default=0, help="rows of an embedding in front of the layers (0: none)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        for row in measure(ranks, (args.layers, args.embedding), args.rounds):
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| ranks per node | replica kept | host memory of the node's slots | per state size "
          "| largest rank's snapshot | stall s (slowest rank, median) | read back bitwise |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['ranks']} | {row['mode']} | {row['node_bytes'] / 2**30:.2f} GiB | {row['node_bytes_per_state']} "
              f"| {row['largest_snapshot_bytes'] / 2**20:.0f} MiB | {row['stall_median_s']} | {row['bitwise_equal']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"layers": args.layers, "embedding": args.embedding, "rounds": args.rounds,
                                             "command": "python bench/t1_per_node.py " + " ".join(sys.argv[1:]), "rows": rows}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
