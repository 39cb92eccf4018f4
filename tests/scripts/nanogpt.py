"""A GPT trained the way nanoGPT's train.py trains one, under undying.

Runs in every worker process (``undying run tests/scripts/nanogpt.py``), for
tests/faults/test_ddp_surface.py. As in nanoGPT: each rank seeds ``1337 + rank`` and draws its
batches with ``torch.randint`` (``get_batch``), the next batch prefetched at the end of each
micro-step; gradient accumulation through ``model.require_backward_grad_sync = (micro_step ==
last)``; its own warmup + cosine ``get_lr`` assigned to every ``param_group['lr']``; AdamW with
decay only on matrices; a ``GradScaler`` built disabled (what fp32 and bf16 runs do); clipping
after ``unscale_``; ``estimate_loss`` on rank 0 alone; ``raw_model = model.module``.
nanogpt_ddp.py is the same loop under torchrun + stock DDP.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

import undying

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt"
sys.path.insert(0, str(EXAMPLE))
from model import GPT, GPTConfig  # noqa: E402


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A nanoGPT-style training loop.")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per rank and step")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--eval-interval", type=int, default=5)
    parser.add_argument("--final-state", default=None, help="rank 0 saves raw_model's state here")
    return parser.parse_args()


class Setup:
    """What nanoGPT builds before its loop, for a rank of a world: data, batches, model, optimizer, lr."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args = args
        text = (EXAMPLE / "input.txt").read_text()
        chars = sorted(set(text))
        data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
        split = int(0.9 * len(data))
        self.data = {"train": data[:split], "val": data[split:]}
        torch.manual_seed(1337 + rank)  # nanoGPT's seed_offset: every rank its own batches
        self.model = GPT(GPTConfig(vocab_size=len(chars), block_size=args.block_size, n_layer=2, n_head=2,
                                   n_embd=48, dropout=0.0))

    def optimizer(self) -> torch.optim.Optimizer:
        """nanoGPT's configure_optimizers: weight decay on every tensor of 2 or more dimensions."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.args.lr, betas=(0.9, 0.95))

    def get_batch(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        data, block = self.data[split], self.args.block_size
        ix = torch.randint(len(data) - block, (self.args.batch_size,))
        return (torch.stack([data[i:i + block] for i in ix]), torch.stack([data[i + 1:i + 1 + block] for i in ix]))

    def get_lr(self, iteration: int) -> float:
        warmup, total, lr = self.args.warmup, self.args.steps, self.args.lr
        if iteration < warmup:
            return lr * (iteration + 1) / (warmup + 1)
        ratio = (iteration - warmup) / max(1, total - warmup)
        return 0.1 * lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * 0.9 * lr

    @torch.no_grad()
    def estimate_loss(self, model: torch.nn.Module) -> float:
        model.eval()
        losses = [model(*self.get_batch("val"))[1].item() for _ in range(2)]
        model.train()
        return sum(losses) / len(losses)


def train_step(setup: Setup, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               batch: tuple[torch.Tensor, torch.Tensor], iteration: int, master: bool) -> tuple[torch.Tensor, ...]:
    """One iteration of nanoGPT's loop body; returns the prefetched next batch."""
    args = setup.args
    lr = setup.get_lr(iteration)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iteration % args.eval_interval == 0 and master:
        print(f"step {iteration}: val loss {setup.estimate_loss(model):.4f}", flush=True)
    x, y = batch
    for micro_step in range(args.accumulation):
        model.require_backward_grad_sync = micro_step == args.accumulation - 1  # type: ignore[assignment]
        _, loss = model(x, y)
        loss = loss / args.accumulation
        x, y = setup.get_batch("train")  # prefetched while the backward runs, as nanoGPT
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return x, y


def main() -> None:
    args = arguments()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    ft = undying.init()
    setup = Setup(args, ft.rank)
    model = ft.wrap_model(setup.model)
    raw_model = model.module
    optimizer = ft.wrap_optimizer(setup.optimizer())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batch = setup.get_batch("train")
    for step in ft.steps(args.steps):
        with step:
            batch = train_step(setup, model, optimizer, scaler, batch, step, ft.is_main)
    if args.final_state and ft.is_main:
        torch.save(raw_model.state_dict(), args.final_state)
    ft.finish(result={"param_sha256": undying.param_sha256(raw_model)})


if __name__ == "__main__":
    main()
