"""The baseline users run today: the same GPT under torchrun, stock DDP, periodic torch.save.

Started by bench/recovery.py with ``torchrun --max-restarts N``. Resumes from the newest
``torch.save`` checkpoint on restart; logs JSON lines (step times, saves, the resume) to
``$BENCH_LOG`` so the benchmark can time the recovery the same way it times undying's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

HERE = Path(__file__).resolve().parents[1] / "examples" / "gpt"
sys.path.insert(0, str(HERE))
from data import CharDataset  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def log(**record: object) -> None:
    with open(os.environ["BENCH_LOG"], "a") as handle:
        handle.write(json.dumps({"time": time.time(), "rank": int(os.environ["RANK"]), **record}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = CharDataset((HERE / "input.txt").read_text(), 32)
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(GPTConfig(vocab_size=dataset.vocab_size, block_size=32, n_layer=2,
                                                  n_head=2, n_embd=48)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    path = Path(args.checkpoint_dir) / "ckpt.pt"
    start = 0
    if path.exists():
        state = torch.load(path, weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        log(event="resumed", step=start, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(dataset), generator=generator)
    for step in range(start, args.steps):
        if step == args.kill_step and rank == args.kill_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            log(event="kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        batch = [dataset[int(i)] for i in order[(step * world + rank) * 4:(step * world + rank + 1) * 4]]
        x = torch.stack([b[0] for b in batch])
        y = torch.stack([b[1] for b in batch])
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        log(event="step", step=step + 1)
        if (step + 1) % args.checkpoint_every == 0 and rank == 0:
            started = time.time()
            tmp = path.with_suffix(".tmp")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, path)
            log(event="save", step=step + 1, seconds=time.time() - started)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
