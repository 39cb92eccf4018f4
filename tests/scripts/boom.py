"""A training script with a bug: one rank raises ``RuntimeError("boom")`` in its step.

Runs in every worker (tests/faults/test_crash_loop.py). ``--guarded`` raises inside ``with step:``
(with ``retry`` the rank votes no and keeps its process), else the exception ends the process.
``--from-step`` raises only from that step on (the steps before it commit).
"""

from __future__ import annotations

import argparse

import torch

import undying


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rank", type=int, default=2, help="the rank that raises")
    parser.add_argument("--from-step", type=int, default=0)
    parser.add_argument("--guarded", action="store_true")
    args = parser.parse_args()
    ft = undying.init()
    torch.manual_seed(0)
    model = ft.wrap_model(torch.nn.Linear(4, 1))
    opt = ft.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def body(step: int) -> None:
        if ft.rank == args.rank and step >= args.from_step:
            raise RuntimeError("boom")
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    for step in ft.steps(args.steps):
        if args.guarded:
            with step:
                body(step)
        else:
            body(step)
    ft.finish()


if __name__ == "__main__":
    main()
