"""The loop of examples/loop/train.py under torchrun and stock DDP: the baseline it is compared with.

Runs in every process torchrun starts (``torchrun --standalone --nproc-per-node 4
examples/loop/train_ddp.py``). Same model, data order (undying's ResumableLoader used as a plain
sampler), schedule, accumulation with ``no_sync``, clipping, autocast and dropout; rank 0 saves the
final parameters. ``--clip-before-average`` clips each rank's own gradients and averages them
afterwards: what a data-parallel loop computes when its gradients are averaged at the optimizer
step instead of in backward (tests/faults/test_ddp_parity.py shows it is visibly different).
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from train import MLP, synthetic_dataset, warmup_cosine

import undying
from undying.data import ResumableLoader


def main() -> None:
    parser = argparse.ArgumentParser(description="examples/loop/train.py's loop under torchrun + DDP.")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clip-before-average", action="store_true")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--final-state", required=True, help="rank 0 saves the final parameters here")
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dataset = synthetic_dataset(4096, n_in=32, n_classes=8, seed=args.seed)
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(MLP(32, 128, 8, args.dropout))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
    loader = ResumableLoader(dataset, args.batch_size, args.seed, rank, world_size, num_workers=args.num_workers,
                             persistent_workers=args.num_workers > 0)
    micro_batches = 2

    losses: list[float] = []
    for _ in range(args.steps):
        losses.clear()
        x, y = next(loader)
        chunks = list(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True))
        for index, (x_micro, y_micro) in enumerate(chunks):
            local = args.clip_before_average or index < len(chunks) - 1
            with model.no_sync() if local else nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(x_micro)
                loss = F.cross_entropy(logits.float(), y_micro)
                (loss / micro_batches).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if args.clip_before_average:
            for param in model.parameters():
                assert param.grad is not None
                dist.all_reduce(param.grad)
                param.grad.div_(world_size)
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
        global_loss = torch.tensor(sum(losses) / len(losses))
        dist.all_reduce(global_loss)
        last_loss = global_loss.item() / world_size

    if rank == 0:
        torch.save(model.module.state_dict(), args.final_state)
        print(json.dumps({"param_sha256": undying.param_sha256(model.module), "final_loss": last_loss}), flush=True)
    # DDP's reducer holds the group: released before it, with every rank done, so the group is shut
    # down here and not by the interpreter's teardown, where gloo's threads can abort the process.
    del model
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
