"""Where a worker's training thread spends its CPU in a step: the example GPT under ``undying run``
with the runtime's per-step functions timed by the thread's own CPU clock.

The driver starts ``undying run`` (4 ranks on one node, the defaults) with this file as the
training script (``--worker``): it wraps the functions listed in ``TIMED`` so that each call adds
its thread CPU time (``time.thread_time_ns``), less that of timed calls nested in it, to its name
(calls from other threads are not counted), then runs examples/gpt/train.py. From step
``FIRST_STEP`` on, over ``--window`` steps, each rank writes what each name took per step, and the
training thread's whole CPU time per step, to ``anatomy-<rank>.json``; the driver prints the mean
over the ranks. The model's own work is ``Tensor.backward`` (without the gradient hooks timed
inside it), ``FixedLayoutDDP.forward`` and ``AdamW.step``; the rest is the runtime's, and what is
not timed at all (the script's loop, the wrappers' own cost) is the remainder. The timing itself
costs a few microseconds per timed call. ``Reporter._beat`` counts only on the training thread, so
its calls per step are the commit fence's asks to the controller (the heartbeat thread's own beats
are not counted).

    python bench/step_anatomy.py --size 4x128 --out bench/results/step_anatomy.json
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPT_DIR = REPO / "examples" / "gpt"
RANKS = 4
FIRST_STEP = 300  # after auto's first decisions and the warm-up
SIZES = {"4x128": ("4", "128", "4"), "4x224": ("4", "224", "4"), "8x320": ("8", "320", "5")}
MODEL_WORK = ("Tensor.backward", "FixedLayoutDDP.forward", "AdamW.step")
# (module, class, methods): the runtime's per-step work, and the model's for comparison.
TIMED = (
    ("undying.runtime.step_transaction", "StepTransaction",
     ("begin", "commit", "end", "committed", "forward_done", "_buffers_and_vote", "_gradients_to_check")),
    ("undying.runtime.step_loop", "StepLoop", ("_mark_commit_boundary",)),
    ("undying.runtime.ddp", "FixedLayoutDDP", ("_gradient_ready", "_complete", "forward", "sync_buffers", "begin_step")),
    ("undying.runtime.ddp_buckets", "Bucket", ("gather", "start", "finish")),
    ("undying.runtime.pg", "GenerationGroup", ("start_allreduce", "wait_work", "allreduce_sum")),
    ("undying.runtime.optim", "CommitOptimizer", ("step", "zero_grad")),
    ("torch.optim", "AdamW", ("step",)),
    ("undying.runtime.snapshots", "CheckpointEngine", ("at_commit",)),
    ("undying.runtime.rng_mirror", "RngMirror", ("write_rng", "start_write_rng", "wait")),
    ("undying.runtime.training_state", "TrainingState", ("mark_commit_boundary", "rng_to_mirror")),
    ("undying.data.loader", "ResumableLoader", ("step_batches", "__next__")),
    ("undying.runtime.reporter", "Reporter", ("update", "confirm_generation", "_beat")),
    ("undying.runtime.core", "Runtime", ("log", "check")),
    ("torch", "Tensor", ("backward", "item")),
)


class Timers:
    """Thread CPU per name, exclusive of nested timed calls, on one thread only."""

    def __init__(self, thread: int) -> None:
        self.thread = thread
        self.spent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._nested: list[int] = []

    def wrap(self, owner: type, method: str) -> None:
        original = getattr(owner, method)
        name = f"{owner.__name__}.{method}"

        def timed(*args: object, **kwargs: object) -> object:
            if threading.get_ident() != self.thread:
                return original(*args, **kwargs)
            began = time.thread_time_ns()
            self._nested.append(0)
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.thread_time_ns() - began
                inner = self._nested.pop()
                self.spent[name] += spent - inner
                self.calls[name] += 1
                if self._nested:
                    self._nested[-1] += spent

        setattr(owner, method, timed)


def worker(window: int, out_dir: Path, script_args: list[str]) -> None:
    """One rank: the script with the runtime's functions timed (run by ``undying run``)."""
    import importlib

    from undying.runtime import step_loop

    timers = Timers(threading.get_ident())
    for module, owner, methods in TIMED:
        cls = getattr(importlib.import_module(module), owner)
        for method in methods:
            timers.wrap(cls, method)
    original_steps = step_loop.StepLoop.steps
    began: list[int] = []

    def steps(self: step_loop.StepLoop, *args: object, **kwargs: object) -> object:
        for index, step in enumerate(original_steps(self, *args, **kwargs)):  # type: ignore[arg-type]
            if index == FIRST_STEP:
                timers.spent.clear()
                timers.calls.clear()
                began.append(time.thread_time_ns())
            elif index == FIRST_STEP + window:
                rank = os.environ.get("RANK", "0")
                (out_dir / f"anatomy-{rank}.json").write_text(json.dumps({
                    "thread_us_per_step": (time.thread_time_ns() - began[0]) / 1000 / window,
                    "us_per_step": {name: spent / 1000 / window for name, spent in timers.spent.items()},
                    "calls_per_step": {name: calls / window for name, calls in timers.calls.items()}}))
            yield step

    step_loop.StepLoop.steps = steps  # type: ignore[method-assign]
    sys.argv = [str(GPT_DIR / "train.py"), *script_args]
    runpy.run_path(str(GPT_DIR / "train.py"), run_name="__main__")


def drive(size: str, window: int, out: Path | None) -> None:
    n_layer, n_embd, n_head = SIZES[size]
    with tempfile.TemporaryDirectory(prefix="undying-anatomy-") as tmp:
        work = Path(tmp)
        steps = FIRST_STEP + window + 20
        command = [sys.executable, "-m", "undying.cli", "run", "--nnodes", "1", "--nproc-per-node", str(RANKS),
                   "--quiet", "--run-dir", str(work / "run"), str(Path(__file__).resolve()), "--worker",
                   "--window", str(window), "--out-dir", str(work), "--", "--steps", str(steps),
                   "--n-layer", n_layer, "--n-embd", n_embd, "--n-head", n_head, "--log-every", str(steps)]
        result = subprocess.run(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                capture_output=True, text=True, timeout=1800)
        files = sorted(work.glob("anatomy-*.json"))
        if result.returncode != 0 or len(files) != RANKS:
            raise SystemExit(f"the job failed (exit {result.returncode}):\n{result.stdout[-3000:]}")
        ranks = [json.loads(path.read_text()) for path in files]
    names = sorted({name for rank in ranks for name in rank["us_per_step"]},
                   key=lambda name: -sum(rank["us_per_step"].get(name, 0.0) for rank in ranks))
    mean = {name: round(sum(rank["us_per_step"].get(name, 0.0) for rank in ranks) / RANKS, 1) for name in names}
    calls = {name: ranks[0]["calls_per_step"].get(name, 0.0) for name in names}
    thread = round(sum(rank["thread_us_per_step"] for rank in ranks) / RANKS, 1)
    model = round(sum(mean.get(name, 0.0) for name in MODEL_WORK), 1)
    runtime = round(sum(value for name, value in mean.items() if name not in MODEL_WORK and name != "Tensor.item"), 1)
    print(f"training thread: {thread} us of CPU per step (mean of {RANKS} ranks, {window} steps); model work "
          f"{model} us, runtime's timed work {runtime} us, untimed {round(thread - model - runtime - mean.get('Tensor.item', 0.0), 1)} us")
    for name in names:
        print(f"  {mean[name]:9.1f} us  {calls[name]:5.1f} calls  {name}")
    if out is not None:
        out.write_text(json.dumps({"command": "python bench/step_anatomy.py " + " ".join(sys.argv[1:]),
                                   "size": size, "window": window, "ranks": RANKS, "thread_us_per_step": thread,
                                   "model_us_per_step": model, "runtime_us_per_step": runtime,
                                   "us_per_step": mean, "calls_per_step": calls, "per_rank": ranks}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="4x128", choices=sorted(SIZES))
    parser.add_argument("--window", type=int, default=1000, help="steps measured, after the first FIRST_STEP")
    parser.add_argument("--out", type=Path, default=None, help="write the result here (JSON)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("script_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.window, args.out_dir, args.script_args)
    else:
        drive(args.size, args.window, args.out)


if __name__ == "__main__":
    main()
