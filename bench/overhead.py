"""Steady-state overhead: the same GPT under torchrun + stock DDP and under undying, fault-free.

Three sizes of the example GPT (examples/gpt; n_layer x n_embd: 2x48, 4x256, 8x384), about 40,
200 and 500 ms per step with 4 ranks on a quiet 2-core machine, each under three configurations,
run interleaved (every configuration of every size once, then all again, ``--repeats`` times) so
that a change in the machine's load falls on all of them alike:

- ``torchrun``: stock ``DistributedDataParallel`` and AdamW, started by ``torchrun --standalone``
  (this file's ``--torchrun-worker`` mode), no checkpoints, each batch indexed straight from the dataset;
- ``torchrun, DataLoader`` (only with ``--configs ...,torchrun-loader``): the same reading its batches
  through torch's ``DataLoader`` with a ``DistributedSampler`` and taking each step's loss with
  ``loss.item()``, as the undying script does (its ``ft.dataloader`` is a DataLoader inside): the
  baseline a torchrun user's script pays too;
- ``undying, snapshot every step``: examples/gpt/train.py under ``undying run``, a T1 snapshot at
  every step (``checkpoint.snapshot_interval: 1``), warm standby on;
- ``undying, snapshot auto``: the same with ``snapshot_interval: auto`` (budget 1 %, the default);
- ``undying, snapshot every 2 steps`` (only with ``--configs ...,every-2``): a fixed interval of 2, what ``auto``
  chose at the largest size, to tell the interval's cost from the cadence's own;
- ``undying defaults`` (only with ``--configs ...,defaults``): ``undying run`` with no option but the
  job's shape, so T2 checkpoints every 100 steps fall in the window too (persisted in the background).

Every job has 4 ranks on one node, batch 4 x 32 tokens per rank, one thread per rank. Except with
the defaults, no T2 checkpoint falls in the runs (the checkpoint interval is longer than the run). The step rate is
rank 0's, over the steps from ``WARMUP_STEPS`` (after ``auto`` has decided once) to the last, and for
undying only from when the node's warm standby has finished its imports (the workers are forked
from it, so this is before their first step; before session 13 the standbys imported beside the
training, and the window began after them):
torchrun's from its per-step times, undying's from the controller's heartbeat events (rank 0's
committed step, logged at most every 0.5 s, each at most 0.1 s after its step; the rate is
the inverse of the fitted slope of time against step, ``rate``). The overhead of a
configuration is its median step time against torchrun's, in percent. Each run also records its
step time over every ``WINDOW_STEPS`` steps (``windows_ms``): how much one run's rate moves while
nothing in it changes; and the CPU time the whole job (every process under its launcher, every
thread) spends per step over the same window (``cpu_ms_per_step``, bench/job_cpu.py), steadier
than the step time when the machine's speed drifts: the summary gives its median, range and excess
over torchrun's (``cpu_overhead_percent``; against ``torchrun, DataLoader``, where it ran, the same
with ``_vs_loader`` in the names), and the same CPU split by part of the job
(``cpu_ms_per_step_parts``: the launcher, undying's agent and standby, the workers' training,
communication and other threads; bench/job_cpu.py's ``thread_part``).

    python bench/overhead.py --repeats 2 --out bench/results/overhead.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GPT_DIR = REPO / "examples" / "gpt"
sys.path.insert(0, str(REPO / "src"))
from undying import events as ev  # noqa: E402
from undying.events import read_events  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from job_cpu import CpuSamples  # noqa: E402

RANKS = 4
WARMUP_STEPS = 45  # auto's first decision is at step 40 (two rounds of 20 steps)
NO_T2 = 100_000  # checkpoint interval: longer than any run here
BUDGET = 0.01  # the default snapshot_budget
# n_layer x n_embd -> (n_layer, n_embd, n_head, steps). With 4 ranks on 2 quiet cores the steps take
# about 40, 200 and 500 ms (measured under a load average of 16: 51, 360 and 1600 ms); the step counts
# leave a window of about 30-40 s on a quiet machine after the standbys are up (4 standbys importing at
# low priority beside 4 busy ranks on 2 cores take about half a minute).
SIZES: dict[str, tuple[int, int, int, int]] = {
    "2x48": (2, 48, 2, 3000),
    "4x256": (4, 256, 4, 500),
    "8x384": (8, 384, 6, 150),
    # About 50, 125 and 500 ms per step on a quiet machine: the step times the defaults are held to.
    "4x128": (4, 128, 4, 900),
    "4x224": (4, 224, 4, 400),
    "8x320": (8, 320, 5, 160),
}
CONFIGS = ("torchrun", "undying, snapshot every step", "undying, snapshot auto")
TORCHRUN_LOADER = "torchrun, DataLoader"
EVERY_2 = "undying, snapshot every 2 steps"
DEFAULTS = "undying defaults"
INTERVALS = {"undying, snapshot every step": "1", "undying, snapshot auto": "auto", EVERY_2: "2", DEFAULTS: None}
SHORT_NAMES = {"torchrun": CONFIGS[0], "torchrun-loader": TORCHRUN_LOADER, "every-step": CONFIGS[1],
               "auto": CONFIGS[2], "every-2": EVERY_2, "defaults": DEFAULTS}  # --configs
WINDOW_STEPS = 20
RUN_TIMEOUT_S = 900
CPU_SAMPLE_S = 0.5  # how often the job's CPU time is read (bench/job_cpu.py)


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def rate(times: dict[int, float], first: int) -> float | None:
    """Steps per second over the recorded steps >= ``first``: the inverse of the least-squares slope
    of time against step. A heartbeat reaches the controller up to ``PROGRESS_MIN_SPACING`` after
    its step; fitted over every beat of the window, that lag averages out instead of falling on the
    two ends."""
    steps = sorted(step for step in times if step >= first)
    if len(steps) < 2:
        return None
    mean_step = sum(steps) / len(steps)
    mean_time = sum(times[step] for step in steps) / len(steps)
    spread = sum((step - mean_step) ** 2 for step in steps)
    slope = sum((step - mean_step) * (times[step] - mean_time) for step in steps) / spread
    return 1 / slope if slope > 0 else None


def windows(times: dict[int, float]) -> list[float]:
    """Milliseconds per step over each ``WINDOW_STEPS`` steps of a run (its first recorded step to its last)."""
    rows, ordered = [], sorted(times)
    for first in range(0, max(times, default=0) + 1, WINDOW_STEPS):
        steps = [step for step in ordered if first <= step < first + WINDOW_STEPS]
        if len(steps) > 1 and times[steps[-1]] > times[steps[0]]:
            rows.append(round(1000 * (times[steps[-1]] - times[steps[0]]) / (steps[-1] - steps[0]), 1))
    return rows


def model_args(size: str) -> list[str]:
    n_layer, n_embd, n_head, steps = SIZES[size]
    return ["--steps", str(steps), "--n-layer", str(n_layer), "--n-embd", str(n_embd), "--n-head", str(n_head)]


def run_torchrun(size: str, work: Path, loader: bool = False) -> dict:
    log = work / "steps.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               str(Path(__file__).resolve()), "--torchrun-worker", "--times-file", str(log), *model_args(size),
               *(["--loader"] if loader else [])]
    started = time.time()
    with subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as job:
        cpu = CpuSamples(job.pid)
        while job.poll() is None and time.time() - started < RUN_TIMEOUT_S:
            cpu.sample(time.time())
            time.sleep(CPU_SAMPLE_S)
        if job.poll() is None:
            job.kill()
        returncode = job.wait()
    times = {int(step): at for step, at in json.loads(log.read_text()).items()} if log.exists() else {}
    return {"exit_code": returncode, "steps_per_second": rate(times, WARMUP_STEPS), "windows_ms": windows(times),
            "cpu_ms_per_step": cpu_ms(cpu, times, WARMUP_STEPS),
            "cpu_ms_per_step_parts": cpu_parts_ms(cpu, times, WARMUP_STEPS)}


def cpu_parts_ms(cpu: CpuSamples, times: dict[int, float], first_step: int) -> dict[str, float] | None:
    parts = cpu.parts_per_step(times, first_step)
    return None if parts is None else {part: round(1000 * seconds, 2) for part, seconds in parts.items()}


def cpu_ms(cpu: CpuSamples, times: dict[int, float], first_step: int) -> float | None:
    seconds = cpu.per_step(times, first_step)
    return None if seconds is None else round(1000 * seconds, 2)


def standbys_ready(run_dir: Path) -> bool:
    """Has the node's warm standby finished its imports (it prints "ready" to its log)?"""
    log = run_dir / "logs" / "standby0.log"
    return log.exists() and "ready" in log.read_text(errors="replace")


def run_undying(size: str, interval: str | None, work: Path) -> dict:
    """One undying run; ``interval`` None: the defaults (T2 every 100 steps included)."""
    run_dir = work / "run"
    options = [] if interval is None else [
        "--checkpoint-interval", str(NO_T2), "--set", "warm_standby=true",
        "--set", f"checkpoint.snapshot_interval={interval}", "--set", f"checkpoint.snapshot_budget={BUDGET}"]
    command = [sys.executable, "-m", "undying.cli", "run", "--nnodes", "1", "--nproc-per-node", str(RANKS),
               *options, "--quiet", "--run-dir", str(run_dir), str(GPT_DIR / "train.py"), *model_args(size),
               "--log-every", str(NO_T2)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.time()
    ready_at: float | None = None
    with subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as job:
        cpu = CpuSamples(job.pid)
        # Steady state begins once the standby is up (the workers are forked from it).
        while job.poll() is None and time.time() - started < RUN_TIMEOUT_S:
            if ready_at is None and standbys_ready(run_dir):
                ready_at = time.time()
            cpu.sample(time.time())
            time.sleep(CPU_SAMPLE_S)
        if job.poll() is None:
            job.kill()
        output = job.stdout.read() if job.stdout else ""
        returncode = job.wait()
    events = read_events(run_dir) if (run_dir / ev.EVENTS_FILE).exists() else []
    beats = {event.step: event.time for event in events if event.kind == ev.HEARTBEAT and event.rank == 0
             and event.step is not None and (ready_at is None or event.time >= ready_at)}
    changes = [{"step": event.step, "interval": event.details["interval"], "stall": event.details["stall"],
                "step_seconds": event.details["step_seconds"]}
               for event in events if event.kind == ev.SNAPSHOT_INTERVAL and event.rank == 0]
    record: dict = {"exit_code": returncode, "steps_per_second": rate(beats, WARMUP_STEPS),
                    "standbys_ready_seconds": None if ready_at is None else round(ready_at - started, 1),
                    "measured_beats": len([step for step in beats if step >= WARMUP_STEPS]),
                    "windows_ms": windows(beats), "cpu_ms_per_step": cpu_ms(cpu, beats, WARMUP_STEPS),
                    "cpu_ms_per_step_parts": cpu_parts_ms(cpu, beats, WARMUP_STEPS)}
    if ready_at is None:
        record["steps_per_second"] = None  # the run ended before its standbys were up: no steady state
    if changes:
        record["interval_changes"] = changes
    if returncode != 0:
        record["output_tail"] = output[-2000:]
    return record


def run_once(size: str, config: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="undying-overhead-") as tmp:
        load = load_average()
        started = time.time()
        if config in ("torchrun", TORCHRUN_LOADER):
            record = run_torchrun(size, Path(tmp), loader=config == TORCHRUN_LOADER)
        else:
            record = run_undying(size, INTERVALS[config], Path(tmp))
        record.update(size=size, config=config, wall_seconds=round(time.time() - started, 1),
                      load_before=load, load_after=load_average())
        if record["steps_per_second"] is not None:
            record["step_ms"] = round(1000 / record["steps_per_second"], 2)
            record["steps_per_second"] = round(record["steps_per_second"], 3)
        return record


def summarize(runs: list[dict]) -> dict:
    summary: dict = {}
    for size in dict.fromkeys(run["size"] for run in runs):
        rows: dict = {}
        for config in dict.fromkeys(run["config"] for run in runs):
            rates = [run["steps_per_second"] for run in runs
                     if (run["size"], run["config"]) == (size, config) and run["steps_per_second"]]
            if rates:
                median = statistics.median(rates)
                rows[config] = {"runs": len(rates), "median_steps_per_second": round(median, 3),
                                "median_step_ms": round(1000 / median, 2)}
            cpu = sorted(run["cpu_ms_per_step"] for run in runs
                         if (run["size"], run["config"]) == (size, config) and run.get("cpu_ms_per_step"))
            if cpu and config in rows:
                rows[config].update(median_cpu_ms_per_step=round(statistics.median(cpu), 2), cpu_ms_range=[cpu[0], cpu[-1]])
            parts = [run["cpu_ms_per_step_parts"] for run in runs
                     if (run["size"], run["config"]) == (size, config) and run.get("cpu_ms_per_step_parts")]
            if parts and config in rows:
                rows[config]["median_cpu_ms_per_step_parts"] = {
                    part: round(statistics.median(run.get(part, 0.0) for run in parts), 2)
                    for part in sorted({part for run in parts for part in run})}
        for suffix, baseline in (("", rows.get("torchrun")), ("_vs_loader", rows.get(TORCHRUN_LOADER))):
            for config, row in rows.items():
                if baseline and not config.startswith("torchrun"):
                    row[f"overhead{suffix}_percent"] = round(100 * (baseline["median_steps_per_second"]
                                                                    / row["median_steps_per_second"] - 1), 2)
                    if "median_cpu_ms_per_step" in row and "median_cpu_ms_per_step" in baseline:
                        row[f"cpu_overhead{suffix}_percent"] = round(
                            100 * (row["median_cpu_ms_per_step"] / baseline["median_cpu_ms_per_step"] - 1), 2)
        summary[size] = rows
    return summary


def print_table(summary: dict) -> None:
    print(f"{'size':>6} {'configuration':<30} {'steps/s':>8} {'step ms':>8} {'overhead':>9} {'CPU ms/step':>12} "
          f"{'CPU extra':>10}")
    for size, rows in summary.items():
        for config, row in rows.items():
            overhead = " / ".join(f"{row[key]:+.1f} %" for key in ("overhead_percent", "overhead_vs_loader_percent")
                                  if key in row) or "-"
            cpu_extra = " / ".join(f"{row[key]:+.1f} %" for key in ("cpu_overhead_percent",
                                                                    "cpu_overhead_vs_loader_percent") if key in row) or "-"
            print(f"{size:>6} {config:<30} {row['median_steps_per_second']:>8} {row['median_step_ms']:>8} "
                  f"{overhead:>9} {row.get('median_cpu_ms_per_step', '-'):>12} {cpu_extra:>10}")
    print("CPU ms per step by part of the job, medians of the runs:")
    for size, rows in summary.items():
        for config, row in rows.items():
            parts = ", ".join(f"{part} {ms}" for part, ms in row.get("median_cpu_ms_per_step_parts", {}).items())
            print(f"{size:>6} {config:<30} {parts}")


def _indexed_batches(dataset: Any, rank: int, world: int) -> Iterator[tuple[Any, Any]]:
    """This rank's batches of 4, indexed straight from the dataset in one fixed shuffled order."""
    import torch

    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
    for step in itertools.count():
        start = (step * world + rank) * 4 % (len(order) - 4)  # wraps around: long runs outlast one epoch
        batch = [dataset[int(i)] for i in order[start:start + 4]]
        yield torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])


def _loader_batches(dataset: Any, rank: int, world: int) -> Iterator[tuple[Any, Any]]:
    """This rank's batches of 4 through torch's DataLoader and a DistributedSampler, epoch after epoch."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler: DistributedSampler[Any] = DistributedSampler(dataset, world, rank, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def torchrun_worker(args: argparse.Namespace) -> None:
    """One rank of the baseline: the example's GPT under stock DDP, rank 0 logging each step's end."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(GPT_DIR))
    from data import CharDataset
    from model import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = CharDataset((GPT_DIR / "input.txt").read_text(), 32)
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(GPTConfig(vocab_size=dataset.vocab_size, block_size=32, n_layer=args.n_layer,
                                                  n_head=args.n_head, n_embd=args.n_embd)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ended: dict[int, float] = {}
    for step, (inputs, targets) in enumerate(_loader_batches(dataset, rank, world) if args.loader
                                             else _indexed_batches(dataset, rank, world)):
        if step == args.steps:
            break
        _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.loader:
            loss.item()
        ended[step + 1] = time.time()
    if rank == 0:
        Path(args.times_file).write_text(json.dumps(ended))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of " + ", ".join(SIZES))
    parser.add_argument("--out", default=None, help="write the runs and the summary here (JSON)")
    parser.add_argument("--run-steps", type=int, help="steps of every run instead of the size's own count")
    parser.add_argument("--configs", default="torchrun,every-step,auto",
                        help="comma-separated, in run order; allowed: " + ", ".join(SHORT_NAMES))
    parser.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--times-file", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n-layer", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n-embd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n-head", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--loader", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torchrun_worker:
        torchrun_worker(args)
        return
    sizes = [size for size in args.sizes.split(",") if size]
    unknown = [size for size in sizes if size not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown size {unknown[0]!r}; allowed: {', '.join(SIZES)}")
    names = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [name for name in names if name not in SHORT_NAMES]
    if unknown or not names:
        raise SystemExit(f"--configs: unknown configuration {unknown[0] if unknown else ''!r}; "
                         f"allowed: {', '.join(SHORT_NAMES)}")
    configs = [SHORT_NAMES[name] for name in names]
    if args.run_steps is not None:
        if args.run_steps <= WARMUP_STEPS + 10:
            raise SystemExit(f"--run-steps: must be more than {WARMUP_STEPS + 10} (the warmup, then a window)")
        for size in sizes:
            SIZES[size] = (*SIZES[size][:3], args.run_steps)
    runs: list[dict] = []
    for repeat in range(args.repeats):
        for size in sizes:
            for config in configs:
                record = run_once(size, config)
                record["repeat"] = repeat
                runs.append(record)
                print(json.dumps(record), flush=True)
                if args.out:  # after every run: an interrupted benchmark keeps what it measured
                    write_results(Path(args.out), sizes, runs)
    print_table(summarize(runs))


def write_results(path: Path, sizes: list[str], runs: list[dict]) -> None:
    payload = {"command": "python bench/overhead.py " + " ".join(sys.argv[1:]), "ranks": RANKS,
               "warmup_steps": WARMUP_STEPS, "budget": BUDGET,
               "sizes": {size: dict(zip(("n_layer", "n_embd", "n_head", "steps"), SIZES[size], strict=True))
                         for size in sizes},
               "summary": summarize(runs), "runs": runs}
    path.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
