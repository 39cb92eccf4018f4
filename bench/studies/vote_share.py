"""What the commit vote's sync point costs a training step: the example GPT with undying's gradient
buckets (``FixedLayoutDDP``), its step without a vote and with the vote the defaults cast at
``opt.step()`` (two float64 elements: the bad-step check's counts packed into one, the loss the
other; ``commit_vote_with_sums`` over a ``GenerationGroup``, runtime/vote_sums.py).

The question it answers: how much of a 50 ms step on this machine is the vote alone, a cost
torchrun + DDP does not have? Spawns WORLD gloo processes on loopback; each builds the model twice
(same weights) and runs STEPS steps of each, the two interleaved in blocks of BLOCK steps with a
barrier between two blocks, so that machine noise falls on both alike; within a block the ranks
run free, as in a job, so that a rank arriving late at the vote is waited for there instead of in
the next step's gradient all-reduce, not on top of it. Per model and block each rank records its
training thread's CPU time per step, its whole process's and the wall time, and reports their
medians; the two models' final parameters must be bitwise equal (the vote changes nothing in the
training).

    python bench/studies/vote_share.py --world 4 --steps 300 --block 10 --batch-size 4 --block-size 32 --out bench/results/vote_share.json
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

MODELS = ("no vote", "the defaults' vote")


def worker(rank: int, args: argparse.Namespace, port: int, queue: mp.Queue) -> None:  # spawn_ranks' target
    import torch
    import torch.distributed as dist

    from undying.runtime.ddp import FixedLayoutDDP
    from undying.runtime.pg import GenerationGroup
    from undying.runtime.step_check import COUNT_LIMITS
    from undying.runtime.vote_sums import commit_vote_with_sums

    store = join_gloo(rank, args.world, port)
    device = torch.device("cpu")
    groups = {name: GenerationGroup(store, f"vote-share-{index}", 1, rank, args.world, "gloo", 60.0, device)
              for index, name in enumerate(MODELS)}
    gpt = example_gpt(REPO, args.block_size, args.n_layer, args.n_embd)
    models = {name: FixedLayoutDDP(gpt(), lambda group=groups[name]: group, device) for name in MODELS}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, model in models.items()}
    vote_group = groups["the defaults' vote"]

    def vote() -> None:
        # This rank's report as the bad-step check makes it (nothing bad, a loss checked, no rank
        # named; runtime/step_check.py ``vote_report``): four counts and the loss.
        all_ok, _, _ = commit_vote_with_sums(vote_group, True, [0, 1, 0, 0], COUNT_LIMITS, [2.5], device)
        assert all_ok

    after_sync = {"no vote": lambda: None, "the defaults' vote": vote}
    generator = torch.Generator().manual_seed(rank)
    timings: dict[str, dict[str, list[float]]] = {name: {"thread": [], "process": [], "wall": []} for name in MODELS}
    blocks = -(-(args.steps + args.warmup) // args.block)
    for block in range(blocks):
        batches = [gpt_batch(args, generator) for _ in range(args.block)]
        for name, model in models.items():
            dist.barrier()  # between blocks only: within one the ranks run free, as in a job
            thread, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
            for x, y in batches:
                gpt_step(model, optimizers[name], x, y, after_sync[name])
            if block * args.block >= args.warmup:
                timings[name]["thread"].append((time.thread_time() - thread) / args.block)
                timings[name]["process"].append((time.process_time() - process) / args.block)
                timings[name]["wall"].append((time.perf_counter() - wall) / args.block)
    reference = models["no vote"].module.state_dict()
    voted = models["the defaults' vote"].module.state_dict()
    result = {name: {f"{kind}_ms": round(statistics.median(values) * 1e3, 3) for kind, values in kinds.items()}
              for name, kinds in timings.items()}
    result["bitwise_equal"] = all(torch.equal(reference[key], voted[key]) for key in reference)
    leave_with(queue, rank, result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--block", type=int, default=10, help="steps of one model between two barriers")
    add_gpt_arguments(parser)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = spawn_ranks(args.world, worker, args)
    report_ranks(args, results)
    for kind in ("wall_ms", "thread_ms", "process_ms"):
        cells = [f"{name}: " + ", ".join(f"{results[rank][name][kind]:.2f}" for rank in sorted(results)) for name in MODELS]
        print(f"{kind:10}  " + "  |  ".join(cells))
    print("bitwise equal on every rank:", all(result["bitwise_equal"] for result in results.values()))


if __name__ == "__main__":
    main()
