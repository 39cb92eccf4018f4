"""tests/scripts/classify.py under torchrun and stock DDP: the baseline it is compared with.

Runs in every process torchrun starts (``torchrun --standalone --nproc-per-node 4
tests/scripts/classify_ddp.py``). Same model, data order (undying's ResumableLoader used as a plain
sampler), optimizer, schedule, evaluation and flags; rank 0 saves the final ``model.module`` state
and prints its digest.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from classify import Shapes, arguments, build, evaluate, held_out  # noqa: E402
from torchrun_exit import end_without_teardown  # noqa: E402

import undying  # noqa: E402
from undying.data import ResumableLoader  # noqa: E402


def main() -> None:
    args = arguments()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler, criterion = build(args)
    model = DistributedDataParallel(model, **({"broadcast_buffers": False} if args.no_broadcast_buffers else {}))
    model_without_ddp = model.module
    loader = ResumableLoader(Shapes(4096, seed=args.seed), args.batch_size, args.seed, rank, world_size)
    test_images, test_labels = held_out(rank, world_size)

    accuracy = 0.0
    for step in range(args.steps):
        image, target = next(loader)
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
        if (step + 1) % args.steps_per_epoch == 0:
            scheduler.step()
            accuracy = evaluate(model, test_images, test_labels)
    if rank == 0:
        if args.final_state:
            torch.save({"model": model_without_ddp.state_dict()}, args.final_state)
        print(json.dumps({"param_sha256": undying.param_sha256(model_without_ddp), "accuracy": accuracy}), flush=True)
    del model  # DDP's reducer holds the group
    end_without_teardown()


if __name__ == "__main__":
    main()
