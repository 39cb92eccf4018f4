"""A training script that uses torch.distributed itself, as user code and libraries do: each step
all-reduces its loss with ``dist.all_reduce`` and meets the other ranks at ``dist.barrier()``.

Runs in every worker process (``undying run tests/scripts/dist_user.py``), for
tests/faults/test_default_group.py. Every rank appends one line per step it runs to
RUN_DIR/dist_user/rank{R}.jsonl: the step, the generation, what torch.distributed says about its
rank and size, and the loss all-reduced over the replicas (the last line of a step is the run
that committed).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import undying


def main() -> None:
    parser = argparse.ArgumentParser(description="A loop that calls torch.distributed collectives itself.")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--final-state", default=None, help="rank 0 saves the final parameters here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    ft = undying.init()
    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(512, 16, generator=generator), torch.randn(512, 1, generator=generator)
    dataset = [(inputs[i], targets[i]) for i in range(len(inputs))]
    torch.manual_seed(0)
    model = ft.wrap_model(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    opt = ft.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    loader = ft.dataloader(dataset, batch_size=args.batch_size)
    log_dir = ft.run_dir / "dist_user"
    log_dir.mkdir(parents=True, exist_ok=True)

    mean_loss = None
    for step in ft.steps(args.steps):
        with step:  # a user collective that fails because a peer died fails the step like any error
            x, y = next(loader)
            loss = F.mse_loss(model(x.to(ft.device)), y.to(ft.device))
            loss.backward()
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            dist.barrier()
            mean_loss = reduced.item() / dist.get_world_size()
            record = {"step": int(step), "generation": ft.generation, "pid": os.getpid(),
                      "initialized": dist.is_initialized(), "dist_rank": dist.get_rank(),
                      "dist_world_size": dist.get_world_size(), "group_rank": ft.group_rank,
                      "replicas": ft.replicas, "mean_loss": mean_loss}
            with open(log_dir / f"rank{ft.rank}.jsonl", "a") as log:
                log.write(json.dumps(record) + "\n")
            opt.step()
            opt.zero_grad(set_to_none=True)
        ft.log(loss=mean_loss)

    if args.final_state and ft.is_main:
        torch.save(model.module.state_dict(), args.final_state)
    ft.finish(result={"param_sha256": undying.param_sha256(model.module), "final_loss": mean_loss})


if __name__ == "__main__":
    main()
