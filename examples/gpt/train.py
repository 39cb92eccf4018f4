"""Train a small character GPT with undying: the example script and the benchmark workload.

Runs in every worker process (one per rank), e.g. ``undying run examples/gpt/train.py``.
Apart from the ``ft.*`` calls it is an ordinary single-process PyTorch training loop.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import undying

# model.py and data.py sit beside this script; the worker may run it by path (runpy), not as __main__.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from data import CharDataset  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a character GPT under undying.")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout rate (> 0 draws random numbers every step: tests of the RNG mirror)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds to sleep in each step: stretches a run (tests) without changing its numbers")
    parser.add_argument("--final-state", default=None, help="rank 0 saves the final parameters here (tests)")
    args = parser.parse_args()

    # One thread by default: bitwise-repeatable CPU kernels, and 4 ranks fit on 2 cores.
    torch.set_num_threads(int(os.environ.get("UNDYING_THREADS") or os.environ.get("OMP_NUM_THREADS") or 1))

    ft = undying.init()
    dataset = CharDataset((HERE / "input.txt").read_text(), args.block_size)
    torch.manual_seed(args.seed)
    config = GPTConfig(
        vocab_size=dataset.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
    )
    model = ft.wrap_model(GPT(config).to(ft.device))
    opt = ft.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))
    loader = ft.dataloader(dataset, batch_size=args.batch_size, seed=args.seed)

    last_loss = None
    for step in ft.steps(args.steps):
        with step:  # optional: lets `retry` re-run a step that raised, without a process restart
            losses = []
            # One batch per step; more micro-batches when an elastic shrink keeps the global batch.
            for x, y in loader.step_batches():
                _, loss = model(x.to(ft.device), y.to(ft.device))
                loss.backward()
                losses.append(loss.item())
            if args.step_sleep:
                time.sleep(args.step_sleep)
            opt.step()
            opt.zero_grad(set_to_none=True)
            last_loss = sum(losses) / len(losses)
        ft.log(loss=last_loss)
        if ft.is_main and step % args.log_every == 0:
            print(f"step {step:5d} | loss {last_loss:.4f}", flush=True)

    if args.final_state and ft.is_main:
        torch.save(model.module.state_dict(), args.final_state)
    ft.finish(result={"final_loss": last_loss, "param_sha256": undying.param_sha256(model.module)})


if __name__ == "__main__":
    main()
