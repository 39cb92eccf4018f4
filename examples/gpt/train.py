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
    parser.add_argument("--start-sleep", type=float, default=0.0,
                        help="seconds to sleep before the first step: stretches the start (tests)")
    parser.add_argument("--final-state", default=None, help="rank 0 saves the final parameters here (tests)")
    parser.add_argument("--final-optimizer-state", default=None,
                        help="rank 0 saves the final optimizer state here, by parameter name (tests)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb: smaller buckets, more all-reduces per step (tests)")
    parser.add_argument("--mesh", default=None, metavar="RxS",
                        help="shard the model with FSDP2 over a (replicate R, shard S) mesh, e.g. 2x2 (HSDP)")
    parser.add_argument("--keep-unsharded", action="store_true",
                        help="with --mesh: parameters stay whole from forward to backward "
                             "(fully_shard's reshard_after_forward=False, as ZeRO-2)")
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
    model = GPT(config).to(ft.device)
    ddp_options = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    model = ft.wrap_model(sharded(model, ft, args.mesh, not args.keep_unsharded) if args.mesh else model,
                          **ddp_options)
    opt = ft.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))
    loader = ft.dataloader(dataset, batch_size=args.batch_size, seed=args.seed)

    if args.start_sleep:
        time.sleep(args.start_sleep)
    last_loss = None
    for step in ft.steps(args.steps):
        with step:  # optional: lets `retry` re-run a step that raised, without a process restart
            losses = []
            # One batch per step; more micro-batches when an elastic shrink keeps the global batch.
            for x, y in loader.step_batches():
                _, loss = model(x.to(ft.device), y.to(ft.device))
                ft.check(loss=loss)  # a loss that is not finite fails the step on every rank, which replays it
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

    if args.final_state:
        final = full_state(model.module)  # every rank: gathering a sharded model is a collective
        if ft.is_main:
            torch.save(final, args.final_state)
    if args.final_optimizer_state:
        final = full_optimizer_state(model.module, opt)
        if ft.is_main:
            torch.save(final, args.final_optimizer_state)
    ft.finish(result={"final_loss": last_loss, "param_sha256": undying.param_sha256(model.module)})


def sharded(model: torch.nn.Module, ft: undying.Runtime, mesh_shape: str,
            reshard_after_forward: bool = True) -> torch.nn.Module:
    """``model`` sharded with FSDP2: each transformer block, then the whole model, over undying's mesh."""
    from torch.distributed.fsdp import fully_shard

    replicate, shard = (int(part) for part in mesh_shape.lower().split("x"))
    mesh = ft.device_mesh(replicate=replicate, shard=shard)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state_dict with sharded tensors gathered whole."""
    return {name: value.full_tensor() if hasattr(value, "full_tensor") else value
            for name, value in module.state_dict().items()}


def full_optimizer_state(module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's state by parameter name and key (``transformer.wte.weight.exp_avg``), sharded
    tensors gathered whole: comparable across meshes."""
    # In the model's parameter order on every rank: gathering a sharded tensor is a collective.
    return {f"{name}.{key}": value.full_tensor() if hasattr(value, "full_tensor") else value
            for name, param in module.named_parameters()
            for key, value in sorted(opt.state.get(param, {}).items())}


if __name__ == "__main__":
    main()
