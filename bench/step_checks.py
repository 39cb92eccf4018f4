"""What the step-time reports and the bad-step check cost each step, against a 125 ms step.

Two parts, each timing exactly the work these features add to a step (whole-job runs on a shared
2-core machine move by more than the 1 % this is about, see docs/benchmarks.md):

1. In one process (one thread), the example GPT at the size whose step takes about 125 ms with 4
   ranks on 2 cores (examples/gpt, 4 layers x 256, batch 4 x 32 tokens): a training step
   (forward, backward, AdamW), and on its gradients the check's work (``ft.check(loss=...)``,
   ``StepCheck.vote_report`` on rank 0's share of the gradients of ``--world`` ranks: the gradient
   norm read back, ``verdict``, ``committed``) and the step timer's (``StepTimer.begin``,
   ``committed``, ``typical``), over ``--steps`` steps.
2. ``--world`` gloo processes on loopback: the commit vote as it is without the check (one float32)
   and with it (float64: the vote and the check's counts packed, runtime/vote_sums.py, and the
   loss), over ``--votes`` rounds.

Each time is given as its median and its minimum: on a machine other jobs load, the median carries
their share of the cores and the minimum is what the work itself takes.

    python bench/step_checks.py --out bench/results/step_checks.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "examples" / "gpt"))
from spawn_ranks import spawn_ranks  # noqa: E402

REFERENCE_STEP_S = 0.125


def in_process(steps: int, world: int) -> dict[str, float]:
    import torch
    from data import CharDataset
    from model import GPT, GPTConfig

    from undying.config.loading import validate_job_spec
    from undying.runtime.step_check import StepCheck, gradients_of
    from undying.runtime.step_timing import StepTimer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dataset = CharDataset((REPO / "examples" / "gpt" / "input.txt").read_text(), 32)
    model = GPT(GPTConfig(vocab_size=dataset.vocab_size, block_size=32, n_layer=4, n_head=4, n_embd=256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    check = StepCheck(validate_job_spec({}), rank=0)
    timer = StepTimer(10, lambda: 0.0)
    batch = [dataset[index] for index in range(4)]
    x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
    step_s, check_s, timer_s = [], [], []
    for _ in range(steps):
        started = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        check.begin_step()
        check.watch({"loss": loss})
        report = check.vote_report(gradients_of([model], (0, world)))
        assert check.verdict(list(report)) is None
        check.committed(list(report))
        check_s.append(time.perf_counter() - started)
        optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        timer.begin()
        timer.committed()
        timer.typical()
        timer_s.append(time.perf_counter() - started)
    parameters = sum(param.numel() for param in model.parameters())
    return {"parameters": parameters, **spread("step", step_s), **spread("check", check_s), **spread("timer", timer_s)}


def spread(name: str, seconds: list[float]) -> dict[str, float]:
    return {f"{name}_ms": statistics.median(seconds) * 1e3, f"{name}_min_ms": min(seconds) * 1e3}


def vote_worker(rank: int, world: int, rounds: int, port: int, queue: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from undying.runtime.step_check import COUNT_LIMITS, report_parts
    from undying.runtime.vote_sums import pack_counts, unpack_counts

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=60))
    group = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), rank, world, datetime.timedelta(seconds=60))
    plain, checked = [], []
    for _ in range(rounds):
        group.barrier().wait()
        started = time.perf_counter()
        vote = torch.full((1,), 1.0, dtype=torch.float32)
        group.allreduce([vote]).wait()
        assert int(vote.item()) == world
        plain.append(time.perf_counter() - started)
        group.barrier().wait()
        started = time.perf_counter()
        counts, floats = report_parts((0.0, 2.5, 1.0, 0.0, 0.0))
        votes = torch.tensor([*pack_counts([1, *counts], [1, *COUNT_LIMITS], world), *floats], dtype=torch.float64)
        group.allreduce([votes]).wait()
        assert unpack_counts(votes.tolist()[:-1], [1, *COUNT_LIMITS], world)[:3] == [world, 0, world]
        checked.append(time.perf_counter() - started)
    queue.put((rank, {"plain": statistics.median(plain), "checked": statistics.median(checked),
                      "plain_min": min(plain), "checked_min": min(checked)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--votes", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    local = in_process(args.steps, args.world)
    votes = spawn_ranks(args.world, vote_worker, args.world, args.votes)[0]
    report: dict[str, float | int] = {"load_average": round(os.getloadavg()[0], 2),
                                      "model_parameters": local["parameters"]}
    for stat, suffix in (("median", ""), ("min", "_min")):
        vote_extra_ms = (votes[f"checked{suffix}"] - votes[f"plain{suffix}"]) * 1e3
        added_ms = local[f"check{suffix}_ms"] + max(0.0, vote_extra_ms)
        report.update({
            f"{stat}_train_step_one_rank_ms": round(local[f"step{suffix}_ms"], 3),
            f"{stat}_bad_step_check_ms": round(local[f"check{suffix}_ms"], 4),
            f"{stat}_step_timer_ms": round(local[f"timer{suffix}_ms"], 5),
            f"{stat}_vote_plain_ms": round(votes[f"plain{suffix}"] * 1e3, 4),
            f"{stat}_vote_with_check_ms": round(votes[f"checked{suffix}"] * 1e3, 4),
            f"{stat}_bad_step_check_of_125ms_percent": round(100 * added_ms / (REFERENCE_STEP_S * 1e3), 3),
            f"{stat}_step_timer_of_125ms_percent": round(100 * local[f"timer{suffix}_ms"] / (REFERENCE_STEP_S * 1e3), 4),
        })
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
