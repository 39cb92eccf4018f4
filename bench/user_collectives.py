"""Recover-in-place of a script that calls torch.distributed itself: how soon the survivors leave.

A survivor blocked in one of the script's own collectives (``dist.all_reduce`` on torch's default
group, gloo) cannot be interrupted; it fails when a peer closes its connections, and a peer closes
them when it drops the failed generation's default group. The job is tests/scripts/dist_user.py
(an all-reduce and a barrier of the script's every step; 2 simulated nodes x 2 workers, warm
standbys, recover-in-place); rank 1 is SIGKILLed at step 20 of 40 (``--fault-step``, ``--steps``;
at step 20 the warm standby may still be importing). Measured from the event log:
the last survivor's step failure after the kill (``survivors_left_seconds``), the recovery plan,
and MTTR (the kill to every rank's first step after it).

``--baseline-tree DIR`` runs an older checkout of the project (its ``src`` first on PYTHONPATH)
interleaved with this one, for a comparison in one run:

    git worktree add /tmp/undying-before <commit>
    python bench/user_collectives.py --baseline-tree /tmp/undying-before --repeats 3 \\
        --out bench/results/user_collectives.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from interleave import interleaved, medians  # noqa: E402

from undying import events as ev  # noqa: E402
from undying.events import read_events  # noqa: E402

STEPS = 40
FAULT_STEP = 20
SCRIPT = REPO / "tests" / "scripts" / "dist_user.py"
ARGS = ["--nnodes", "2", "--nproc-per-node", "2", "--monitor-interval", "0.3", "--quiet",
        "--set", "heartbeat_interval=0.5", "--set", "heartbeat_timeout=4", "--set", "comm_timeout=20",
        "--set", "process_recover=true", "--recover-strategy", "recover-in-place"]
KEYS = ("survivors_left_seconds", "plan_seconds", "mttr_seconds")


def measure(tree: Path, steps: int = STEPS, fault_step: int = FAULT_STEP) -> dict:
    """One run of the job with the project in ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    with tempfile.TemporaryDirectory(prefix="undying-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-m", "undying.cli", "run", *ARGS, "--inject", f"kill:rank=1:step={fault_step}",
                   "--run-dir", str(run_dir), str(SCRIPT), "--steps", str(steps)]
        result = subprocess.run(command, capture_output=True, text=True, cwd=tree, env=env, timeout=600)
        record: dict = {"exit_code": result.returncode}
        events = read_events(run_dir)
    kill = next((e for e in events if e.kind == ev.INJECTION), None)
    if kill is None:
        return record
    failed = [e.time for e in events if e.kind == ev.STEP_FAILED and e.generation == kill.generation
              and e.rank != kill.rank]
    plans = [e.time for e in events if e.kind == ev.RECOVERY_PLAN and e.time > kill.time]
    firsts = [e for e in events if e.kind == ev.FIRST_STEP and e.time > kill.time]
    if failed:
        record["survivors_left_seconds"] = round(max(failed) - kill.time, 3)
    if plans:
        record["plan_seconds"] = round(plans[0] - kill.time, 3)
    if firsts:
        generation = firsts[0].generation
        record["mttr_seconds"] = round(max(e.time for e in firsts if e.generation == generation) - kill.time, 3)
    record["restarted_job"] = any(e.kind == ev.RESTART_BEGIN for e in events)
    return record


def summary(records: list[dict]) -> dict:
    failed = sum(r["exit_code"] != 0 or r.get("restarted_job", False) for r in records)
    return {"runs": len(records), "failed": failed, **medians(records, KEYS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", type=Path, help="an older checkout to run beside this one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--fault-step", type=int, default=FAULT_STEP)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"this tree": REPO}
    if args.baseline_tree is not None:
        trees = {"baseline": args.baseline_tree.resolve(), **trees}
    records = interleaved(args.repeats, trees, lambda name: measure(trees[name], args.steps, args.fault_step))
    results = {name: summary(runs) for name, runs in records.items()}
    print("| tree | runs (failed) | survivors left s | plan s | MTTR s |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in results.items():
        cells = [f"{row.get(key, '-')} ({', '.join(map(str, row.get(key + '_all', [])))})" for key in KEYS]
        print(f"| {name} | {row['runs']} ({row['failed']}) | {' | '.join(cells)} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"steps": args.steps, "fault_step": args.fault_step,
                                        "results": results, "runs": records,
                                        "trees": {name: str(tree) for name, tree in trees.items()}}, indent=1))


if __name__ == "__main__":
    main()
