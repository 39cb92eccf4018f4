"""An image classifier trained the way torchvision's reference script trains one, under undying.

Runs in every worker process (``undying run tests/scripts/classify.py``), for
tests/faults/test_ddp_surface.py. As in torchvision's ``references/classification/train.py``: a
small CNN with BatchNorm (``--sync-bn`` converts it with ``SyncBatchNorm.convert_sync_batchnorm``),
DDP's default ``broadcast_buffers`` (``--no-broadcast-buffers`` turns it off), cross-entropy with
label smoothing, SGD with momentum and no weight decay on the norm layers, a linear warmup then
cosine schedule stepped once per epoch, ``model.module`` kept as ``model_without_ddp`` for the
checkpoint, and an evaluation at each epoch's end in ``eval()`` mode whose accuracy is all-reduced
with ``torch.distributed``. classify_ddp.py is the same script under torchrun + stock DDP.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import undying

CLASSES, SIZE = 10, 12


class Shapes:
    """Synthetic images: each class a fixed random pattern, each sample that pattern plus noise."""

    def __init__(self, count: int, seed: int) -> None:
        patterns = torch.randn(CLASSES, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1234))
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (count,), generator=generator)
        self.images = patterns[self.labels] + 0.8 * torch.randn(count, 3, SIZE, SIZE, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


def small_cnn() -> nn.Module:
    def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(*block(3, 8, 1), *block(8, 16, 2), *block(16, 16, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, CLASSES))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """torchvision's ``set_weight_decay`` with ``norm_weight_decay=0``: no decay on norm layers."""
    norm, other = [], []
    for module in model.modules():
        for param in module.parameters(recurse=False):
            (norm if isinstance(module, nn.modules.batchnorm._BatchNorm) else other).append(param)
    return [{"params": other, "weight_decay": weight_decay}, {"params": norm, "weight_decay": 0.0}]


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, Any, nn.Module]:
    """Model (before DDP), optimizer, scheduler, criterion: torchvision's choices, per epoch."""
    torch.manual_seed(args.seed)
    model = small_cnn()
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.SGD(parameter_groups(model, args.weight_decay), lr=args.lr, momentum=0.9)
    epochs = args.steps // args.steps_per_epoch
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=args.warmup_epochs)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, epochs - args.warmup_epochs))
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[args.warmup_epochs])
    return model, optimizer, scheduler, nn.CrossEntropyLoss(label_smoothing=0.1)


def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy over every rank's share of the held-out set, all-reduced as torchvision's metric logger does."""
    model.eval()
    with torch.inference_mode():
        correct = (model(images).argmax(dim=1) == labels).sum()
    model.train()
    totals = torch.stack([correct.double(), torch.tensor(float(len(labels)), dtype=torch.float64)])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A torchvision-style image classifier.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--steps-per-epoch", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--clip-grad-norm", type=float, default=1.0)
    parser.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm.convert_sync_batchnorm(model)")
    parser.add_argument("--no-broadcast-buffers", action="store_true", help="DDP(..., broadcast_buffers=False)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--final-state", default=None, help="rank 0 saves the final model_without_ddp state here")
    return parser.parse_args()


def held_out(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    test = Shapes(64, seed=99)
    return test.images[rank::world_size], test.labels[rank::world_size]


def main() -> None:
    args = arguments()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    ft = undying.init()
    model, optimizer, scheduler, criterion = build(args)
    model = ft.wrap_model(model.to(ft.device), **({"broadcast_buffers": False} if args.no_broadcast_buffers else {}))
    model_without_ddp = model.module
    optimizer = ft.wrap_optimizer(optimizer)
    loader = ft.dataloader(Shapes(4096, seed=args.seed), batch_size=args.batch_size, seed=args.seed)
    test_images, test_labels = held_out(ft.rank, ft.world_size)

    accuracy, last_loss = 0.0, 0.0
    for step in ft.steps(args.steps):
        with step:
            image, target = next(loader)
            output = model(image.to(ft.device))
            loss = criterion(output, target.to(ft.device))
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()
            last_loss = loss.item()
            if (step + 1) % args.steps_per_epoch == 0:  # an epoch's end: schedule, evaluate
                scheduler.step()
                accuracy = evaluate(model, test_images.to(ft.device), test_labels.to(ft.device))
    if args.final_state and ft.is_main:
        torch.save({"model": model_without_ddp.state_dict()}, args.final_state)
    ft.finish(result={"param_sha256": undying.param_sha256(model_without_ddp), "accuracy": accuracy,
                      "final_loss": last_loss})
    if ft.is_main:
        print(json.dumps({"accuracy": accuracy}), flush=True)


if __name__ == "__main__":
    main()
