"""tests/scripts/nanogpt.py's loop under torchrun and stock DDP: the baseline it is compared with.

Runs in every process torchrun starts (``torchrun --standalone --nproc-per-node 4
tests/scripts/nanogpt_ddp.py``); rank 0 saves ``raw_model``'s final state and prints its digest.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nanogpt import Setup, arguments, train_step  # noqa: E402
from torchrun_exit import end_without_teardown  # noqa: E402

import undying  # noqa: E402


def main() -> None:
    args = arguments()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    setup = Setup(args, rank)
    optimizer = setup.optimizer()
    model = DistributedDataParallel(setup.model)
    raw_model = model.module
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batch = setup.get_batch("train")
    for iteration in range(args.steps):
        batch = train_step(setup, model, optimizer, scaler, batch, iteration, rank == 0)
    if rank == 0:
        if args.final_state:
            torch.save(raw_model.state_dict(), args.final_state)
        print(json.dumps({"param_sha256": undying.param_sha256(raw_model)}), flush=True)
    del model  # DDP's reducer holds the group
    end_without_teardown()


if __name__ == "__main__":
    main()
