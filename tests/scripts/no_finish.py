"""A training script as it comes from torchrun: it ends with its loop, never calling ``ft.finish()``.

Runs in every worker (tests/faults/test_finish_at_exit.py). Its steps are short, so its heartbeats
(at most every 0.25 s) are several steps behind at the end. ``--then`` says how the script ends after
the loop: ``return`` (the usual end), ``raise`` (an uncaught error after training) or ``finish`` (it
calls ``ft.finish()`` itself).
"""

from __future__ import annotations

import argparse

import torch

import undying


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--then", choices=("return", "raise", "finish"), default="return")
    args = parser.parse_args()
    ft = undying.init()
    torch.manual_seed(0)
    model = ft.wrap_model(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)))
    opt = ft.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _step in ft.steps(args.steps):
        x = torch.randn(8, 16)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    if args.then == "raise":
        raise RuntimeError("evaluation failed after training")
    if args.then == "finish":
        ft.finish(result={"param_sha256": undying.param_sha256(model.module)})


if __name__ == "__main__":
    main()
