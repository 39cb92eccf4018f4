"""MTTR of recover-in-place for a torch.compile'd model: a replacement rank that must compile the model
from nothing (torch's caches off: a host that never compiled it) against one that finds the graphs
in the job's ``compile_cache``, next to the same job uncompiled. Scenarios interleaved, in one run.

The job: examples/loop/train.py on 2 simulated nodes x 2 workers, rank 1 killed (SIGKILL) at step
FAULT_STEP; MTTR is fault -> every rank has completed its first step after it (event log).

    python bench/compile_cache.py --repeats 3
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from undying import events as ev  # noqa: E402
from undying.events import read_events  # noqa: E402

STEPS = 40
FAULT_STEP = 25
BASE = ["--nnodes", "2", "--nproc-per-node", "2", "--monitor-interval", "0.5", "--quiet",
        "--set", "heartbeat_interval=0.5", "--set", "heartbeat_timeout=3", "--set", "process_recover=true",
        "--recover-strategy", "recover-in-place", "--inject", f"kill:rank=1:step={FAULT_STEP}"]
SCENARIOS = ("not compiled", "compiled, caches off (cold replacement)", "compiled, compile_cache (warm)")


def run_once(scenario: str, tmp: Path) -> dict:
    run_dir = tmp / "run"
    extra: list[str] = []
    script_args: list[str] = []
    env = dict(os.environ)
    if scenario != "not compiled":
        script_args.append("--compile")
    if scenario.startswith("compiled, caches off"):
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    if scenario.endswith("(warm)"):
        extra += ["--set", f"compile_cache={tmp / 'compile-cache'}"]
    command = [sys.executable, "-m", "undying.cli", "run", *BASE, *extra, "--run-dir", str(run_dir),
               str(REPO / "examples" / "loop" / "train.py"), "--steps", str(STEPS), *script_args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    events = read_events(run_dir)
    record: dict = {"exit_code": done.returncode}
    faults = [e for e in events if e.kind == ev.INJECTION]
    if not faults:
        return record
    firsts = [e for e in events if e.kind == ev.FIRST_STEP and e.time > faults[0].time]
    if firsts:
        generation = firsts[0].generation
        record["mttr_seconds"] = round(max(e.time for e in firsts if e.generation == generation) - faults[0].time, 3)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    for _ in range(args.repeats):
        for name in SCENARIOS:
            with tempfile.TemporaryDirectory(prefix="undying-compile-bench-") as tmp:
                started = time.time()
                record = run_once(name, Path(tmp))
                record["wall_seconds"] = round(time.time() - started, 1)
                results[name].append(record)
                print(name, record, file=sys.stderr, flush=True)
    summary = {}
    for name, runs in results.items():
        mttrs = [run["mttr_seconds"] for run in runs if "mttr_seconds" in run]
        summary[name] = {"runs": len(runs), "failed": sum(run["exit_code"] != 0 for run in runs),
                         "median_mttr_seconds": round(statistics.median(mttrs), 3) if mttrs else None,
                         "all_mttr_seconds": mttrs}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
