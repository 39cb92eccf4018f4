"""Prints numbered lines on stdout and on stderr from every rank, each written in pieces, for the
tests of worker output on the console (tests/e2e/test_console.py); with ``--steps`` it then trains
a tiny model for that many steps (the progress line's tests).

Runs in every worker process (``undying run tests/scripts/print_lines.py``). A line reads
``out|err I of rank R: `` and ``--width`` letters, written a few letters per ``write`` call, so a
console that passed on partial writes would interleave ranks mid-line.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import undying


def write_in_pieces(stream: object, text: str, piece: int = 7) -> None:
    for start in range(0, len(text), piece):
        stream.write(text[start:start + piece])  # type: ignore[attr-defined]
        stream.flush()  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description="Print lines on both streams from every rank.")
    parser.add_argument("--lines", type=int, default=3)
    parser.add_argument("--width", type=int, default=200)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ft = undying.init()
    for index in range(args.lines):
        for name, stream in (("out", sys.stdout), ("err", sys.stderr)):
            write_in_pieces(stream, f"{name} {index} of rank {ft.rank}: {'abcdefghij' * (args.width // 10)}\n")
    model = ft.wrap_model(torch.nn.Linear(4, 1))
    opt = ft.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in ft.steps(args.steps):
        with step:
            loss = model(torch.ones(2, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        ft.log(loss=loss.item())
        time.sleep(args.step_sleep)
    ft.finish(result={"param_sha256": undying.param_sha256(model.module)})


if __name__ == "__main__":
    main()
