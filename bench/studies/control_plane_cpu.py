"""What the job's parts besides its training spend per second: the controller (``undying run``'s
process), the node agent, and the workers' own threads other than training and gloo's (the
heartbeat, mirror and T2 persister threads), each in CPU milliseconds per second of the job.

One node of 4 ranks, the example GPT at 4 x 128 (bench/overhead.py's 45 ms size, ``undying run``
with its defaults), and a window of ``--window`` seconds from ``--settle`` seconds after the start
(after the warm standbys' imports and ``snapshot_interval: auto``'s first decision). Per-second
costs do not depend on the step time, so they are what is left of undying's overhead at long steps.
``--baseline-tree DIR`` runs another checkout beside this one (its ``src`` first on PYTHONPATH),
interleaved round by round. The persister is reported apart (rank 0 writes the job's T2 checkpoint
every 100 steps): it is the thread of rank 0's worker, other than its training and gloo's, that spent
the most.

    python bench/studies/control_plane_cpu.py --rounds 3 --baseline-tree /tmp/base --out bench/results/control_plane_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from job_cpu import thread_parts  # noqa: E402

PARTS = ("controller", "agent", "workers' heartbeat and mirror threads", "rank 0's persister")


def one_run(tree: Path, settle: float, window: float, scratch: Path) -> dict[str, float]:
    command = [sys.executable, "-m", "undying.cli", "run", "--nnodes", "1", "--nproc-per-node", "4", "--quiet",
               "--run-dir", str(scratch / "run"), str(tree / "examples" / "gpt" / "train.py"), "--steps", "100000",
               "--n-layer", "4", "--n-embd", "128", "--n-head", "4", "--log-every", "100000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree / "src"))
    with subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as job:
        try:
            roles: dict[int, str] = {}
            time.sleep(settle)
            before = thread_parts(job.pid, roles)
            time.sleep(window)
            after = thread_parts(job.pid, roles)
        finally:
            job.terminate()
            job.wait(60)
    spent = {key: (seconds - before.get(key, (part, 0.0))[1]) * 1000 / window for key, (part, seconds) in after.items()}
    workers = sorted({pid for (pid, _), (part, _) in after.items() if part.startswith("worker ")})
    others = {key: ms for key, ms in spent.items() if after[key][0] == "worker other threads"}
    rank0_others = [key for key in others if key[0] == workers[0]] if workers else []
    persister = max(rank0_others, key=lambda key: others[key]) if rank0_others else None
    return {
        "controller": sum(ms for key, ms in spent.items() if after[key][0] == "launcher"),
        "agent": sum(ms for key, ms in spent.items() if after[key][0] == "agent"),
        "workers' heartbeat and mirror threads": sum(ms for key, ms in others.items() if key != persister),
        "rank 0's persister": others[persister] if persister is not None else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=35.0, help="seconds from the start to the window")
    parser.add_argument("--window", type=float, default=30.0, help="seconds of CPU measured")
    parser.add_argument("--baseline-tree", type=Path, help="another checkout, run beside this one")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"this tree": REPO} | ({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for name, tree in reversed(trees.items()):
                result = one_run(tree, args.settle, args.window, Path(scratch) / f"{name}-{round_index}")
                runs[name].append(result)
                print(f"round {round_index} {name:10} " + "  ".join(f"{part} {ms:.1f}" for part, ms in result.items()),
                      flush=True)
    summary = {name: {part: {"median": round(statistics.median(run[part] for run in found), 1),
                             "runs": [round(run[part], 1) for run in found]} for part in PARTS}
               for name, found in runs.items()}
    for name, parts in summary.items():
        print(f"{name:10} " + "  ".join(f"{part} {figures['median']}" for part, figures in parts.items()))
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(["python", "bench/studies/control_plane_cpu.py", *sys.argv[1:]]),
                                        "ms_per_second": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
