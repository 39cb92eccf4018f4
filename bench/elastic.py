"""Elastic-training benchmark: throughput while shrunk, and how long a shrink and a grow take.

Runs the example GPT job (2 simulated nodes x 2 workers) three ways: fault-free; node 1
killed at step 20 and kept away (the job shrinks to 1 node after the reschedule wait and
finishes there); node 1 killed and back a few seconds later (shrink, then grow back). Each
in ``accumulate`` and ``grow`` mode. From the sample log (``sample_log: true``: a line per
rank per committed step, with a timestamp) it reports steps/s and samples/s at full size and
while shrunk, and from the events the shrink's and the grow's timings, and the shrink's MTTR cut
into its phases (bench/phases.py: detect, decide, ... first step).

    python bench/elastic.py --steps 200 --grow-steps 600 --out bench/results/elastic.json

The reschedule wait is shortened to 2 s (``--wait``) by running ``undying`` through
tests/short_reschedule.py, so the run stays short; with the spec's floor of 30 s only the idle
wait grows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))
from phases import recovery_phases  # noqa: E402

from undying import events as ev  # noqa: E402
from undying.events import read_events  # noqa: E402

FAULT_STEP = 20
BASE = ["--nnodes", "2", "--nproc-per-node", "2", "--monitor-interval", "0.5", "--checkpoint-interval", "1000",
        "--set", "heartbeat_interval=0.5", "--set", "heartbeat_timeout=3", "--set", "warm_standby=false",
        "--set", "sample_log=true", "--set", "process_recover=true", "--recover-strategy", "elastic-training",
        "--quiet"]
BATCH_PER_RANK = 4  # examples/gpt/train.py's default
# `undying` with the reschedule wait below the spec's 30 s floor (its first argument, seconds).
SHORT_RESCHEDULE = REPO / "tests" / "short_reschedule.py"


def step_times(run_dir: Path) -> dict[int, tuple[float, int]]:
    """step -> (time the last rank committed it, replicas that trained it)."""
    steps: dict[int, tuple[float, int]] = {}
    for log in (run_dir / "samples").glob("*.jsonl"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            known = steps.get(record["step"], (0.0, record["replicas"]))
            steps[record["step"]] = (max(known[0], record["time"]), record["replicas"])
    return steps


def rate(steps: dict[int, tuple[float, int]], first: int, last: int, world: int) -> dict:
    span = steps[last][0] - steps[first][0]
    count = last - first
    return {"steps": count, "steps_per_second": round(count / span, 2),
            "samples_per_second": round(count * BATCH_PER_RANK * world / span, 1)}


def measure(mode: str, down: int | None, total_steps: int, wait: float) -> dict:
    inject = [] if down is None else ["--inject", f"node:node=1:step={FAULT_STEP}:down={down}"]
    with tempfile.TemporaryDirectory(prefix="undying-elastic-") as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, str(SHORT_RESCHEDULE), str(wait), "run", *BASE, "--set", f"elastic_batch={mode}", *inject,
                   "--run-dir", str(run_dir), str(REPO / "examples" / "gpt" / "train.py"),
                   "--steps", str(total_steps)]
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=900)
        if result.returncode != 0:
            raise SystemExit(f"run failed ({mode}, down={down}):\n{result.stdout}{result.stderr}")
        events = read_events(run_dir)
        steps = step_times(run_dir)
        world = 4
        record: dict = {"mode": mode, "down_seconds": down, "steps": total_steps}
        full = sorted(step for step, (_, replicas) in steps.items() if replicas == world)
        shrunk = sorted(step for step, (_, replicas) in steps.items() if replicas < world)
        if down is None:
            record["full_size"] = rate(steps, 10, total_steps - 1, world)
            return record
        record["full_size_before_fault"] = rate(steps, 5, FAULT_STEP - 1, world)
        # Skip the first shrunk step (it carries the regrouping) for the steady rate.
        if len(shrunk) > 10:
            record["shrunk"] = rate(steps, shrunk[1], shrunk[-1], world)
        fault = next(e for e in events if e.kind == ev.INJECTION)
        shrink = next((e for e in events if e.kind == ev.ELASTIC_SHRINK), None)
        if shrink is not None:
            record["shrink_after_fault_seconds"] = round(shrink.time - fault.time, 3)
            resumed = min(steps[step][0] for step in shrunk)
            record["first_shrunk_step_after_fault_seconds"] = round(resumed - fault.time, 3)
            record["first_shrunk_step_after_shrink_seconds"] = round(resumed - shrink.time, 3)
            record["shrink_phases"] = recovery_phases(events, fault.time)
        grow = next((e for e in events if e.kind == ev.ELASTIC_GROW), None)
        if grow is not None:
            returned = next(e for e in events if e.kind == ev.AGENT_REGISTERED and e.time > fault.time)
            regrown = [step for step in full if step > shrunk[-1]]
            record["grow_after_node_back_seconds"] = round(grow.time - returned.time, 3)
            record["first_full_step_after_node_back_seconds"] = round(steps[regrown[0]][0] - returned.time, 3)
            if len(regrown) > 10:
                record["full_size_after_grow"] = rate(steps, regrown[1], regrown[-1], world)
        return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--wait", type=float, default=2.0, help="reschedule wait (below the spec's floor), seconds")
    parser.add_argument("--down", type=int, default=6, help="seconds node 1 stays away in the grow run")
    parser.add_argument("--grow-steps", type=int, default=600,
                        help="steps of the grow runs (long enough for the node to come back and rejoin)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = []
    for mode in ("accumulate", "grow"):
        for down in (None, 100000, args.down):
            if down is None and mode == "grow":
                continue  # the fault-free run does not depend on the mode
            started = time.time()
            steps = args.grow_steps if down == args.down else args.steps
            record = measure(mode, down, steps, args.wait)
            record["wall_seconds"] = round(time.time() - started, 1)
            print(json.dumps(record), flush=True)
            results.append(record)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2))


if __name__ == "__main__":
    main()
