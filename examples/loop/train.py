"""Train an MLP with the parts a real loop has: an LR schedule, clipping, accumulation, autocast.

Runs in every worker process (one per rank), e.g. ``undying run examples/loop/train.py``.
Synthetic data from a seeded generator; AdamW; warmup + cosine LambdaLR built on the wrapped
optimizer (found by ``ft.steps()``, no ``register`` needed); ``clip_grad_norm_``; two accumulated
micro-batches per step (``no_sync`` on the first, as under DDP); bf16 autocast; dropout; a registered
counter; the loss all-reduced with ``torch.distributed``; ``--num-workers`` DataLoader processes. Apart from the ``ft.*`` calls it is an ordinary PyTorch training loop; train_ddp.py beside
it is the same loop under torchrun + DDP.
"""

from __future__ import annotations

import argparse
import math
import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import undying


class MLP(nn.Module):
    def __init__(self, n_in: int, n_hidden: int, n_classes: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_in, n_hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(n_hidden, n_hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(n_hidden, n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def synthetic_dataset(n_samples: int, n_in: int, n_classes: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    """Points labelled by a fixed random linear teacher, plus noise: learnable, not trivially."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, n_in, generator=generator)
    teacher = torch.randn(n_in, n_classes, generator=generator)
    y = (x @ teacher + 0.5 * torch.randn(n_samples, n_classes, generator=generator)).argmax(dim=1)
    return [(x[i], int(y[i])) for i in range(n_samples)]


def warmup_cosine(warmup: int, total: int, min_ratio: float = 0.1) -> Any:
    """The LR factor at a step: linear warmup, then a cosine decay to ``min_ratio``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class SamplesSeen:
    """A counter the loop keeps: registered, so a failed step's counts are wound back with it."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples = state["samples"]


def main() -> None:
    parser = argparse.ArgumentParser(description="Train an MLP under undying (a loop with an LR schedule).")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank and step; split in 2 micro-batches")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--clip", type=float, default=0.5, help="gradient-norm threshold (active: norms exceed it)")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--final-state", default=None, help="rank 0 saves the final parameters here (tests)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (see compile_cache)")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    args = parser.parse_args()

    # One thread by default: bitwise-repeatable CPU kernels, and 4 ranks fit on 2 cores.
    torch.set_num_threads(int(os.environ.get("UNDYING_THREADS") or os.environ.get("OMP_NUM_THREADS") or 1))

    ft = undying.init()
    dataset = synthetic_dataset(4096, n_in=32, n_classes=8, seed=args.seed)
    torch.manual_seed(args.seed)
    mlp = MLP(32, 128, 8, args.dropout).to(ft.device)
    model = ft.wrap_model(torch.compile(mlp) if args.compile else mlp)
    opt = ft.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
    loader = ft.dataloader(dataset, batch_size=args.batch_size, seed=args.seed, num_workers=args.num_workers,
                           persistent_workers=args.num_workers > 0)
    seen = SamplesSeen()
    ft.register("samples_seen", seen)
    micro_batches = 2

    last_loss = None
    for step in ft.steps(args.steps):
        with step:  # optional: lets `retry` re-run a step that raised, without a process restart
            losses = []
            for x, y in loader.step_batches():
                chunks = list(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True))
                for index, (x_micro, y_micro) in enumerate(chunks):
                    # As with DDP: the batch's last backward averages the gradients over the ranks,
                    # the ones before it accumulate locally.
                    with model.no_sync() if index < len(chunks) - 1 else nullcontext():
                        with torch.autocast(ft.device.type, dtype=torch.bfloat16):
                            logits = model(x_micro.to(ft.device))
                        loss = F.cross_entropy(logits.float(), y_micro.to(ft.device))
                        (loss / micro_batches).backward()
                    losses.append(loss.item())
                    seen.samples += len(x_micro)
            # The averaged gradients, as under DDP: the clipping norm is the global batch's.
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            scheduler.step()
            opt.zero_grad(set_to_none=True)
            # The loss over every rank's batch, through torch.distributed as any loop would.
            global_loss = torch.tensor(sum(losses) / len(losses), device=ft.device)
            dist.all_reduce(global_loss)
            last_loss = global_loss.item() / dist.get_world_size()
        ft.log(loss=last_loss)
        if ft.is_main and step % args.log_every == 0:
            print(f"step {step:5d} | loss {last_loss:.4f} | lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

    if args.final_state and ft.is_main:
        torch.save(model.module.state_dict(), args.final_state)
    result = {"final_loss": last_loss, "param_sha256": undying.param_sha256(model.module),
              "samples_seen": seen.samples, "last_lr": scheduler.get_last_lr()[0]}
    if args.compile:
        from torch._dynamo.utils import counters

        result["compiled_graphs"] = {"cache_hits": counters["inductor"]["fxgraph_cache_hit"],
                                     "cache_misses": counters["inductor"]["fxgraph_cache_miss"]}
    ft.finish(result=result)


if __name__ == "__main__":
    main()
