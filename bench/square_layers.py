"""The state the T2 benchmarks write and load (bench/t2_load.py, bench/studies/t2_pipeline.py): a stack of
bias-free square linear layers and an AdamW state over them, built without paying for a step.

Runs in the benchmark's own process.
"""

from __future__ import annotations

import torch

WIDTH = 2048  # bias-free square layers of 2048 x 2048: 4.19M parameters each (48 layers: 201M)


def build(layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for parameter in model.parameters():  # AdamW's own state layout, without paying for a step
        optimizer.state[parameter] = {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(parameter),
                                      "exp_avg_sq": torch.rand_like(parameter)}
    return model, optimizer
