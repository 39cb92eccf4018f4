"""A small training job whose node's disk fills up part-way (tests/faults/test_checkpoint_root.py).

Runs in every worker. Rank 0 writes ``--fill FILE`` until the filesystem is full once it reaches
``--fill-at`` (something else on the node filled the checkpoint disk), and deletes it again at
``--free-at`` (the space is freed); the job trains on throughout.
"""

from __future__ import annotations

import argparse
import errno
import os

import torch

import undying


def fill(path: str) -> None:
    chunk = b"\0" * (1 << 16)
    with open(path, "wb") as filler:
        try:
            while True:
                filler.write(chunk)
                filler.flush()
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fill", default="")
    parser.add_argument("--fill-at", type=int, default=-1)
    parser.add_argument("--free-at", type=int, default=-1)
    args, _ = parser.parse_known_args()
    ft = undying.init()
    torch.manual_seed(0)
    model = ft.wrap_model(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)))
    opt = ft.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in ft.steps(args.steps):
        if ft.rank == 0 and step == args.fill_at and args.fill:
            fill(args.fill)
        if ft.rank == 0 and step == args.free_at and args.fill:
            os.remove(args.fill)
        model(torch.ones(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ft.finish()


if __name__ == "__main__":
    main()
