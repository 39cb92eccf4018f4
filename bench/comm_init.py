"""Communicator init against world size: what rebuilding the process groups costs a recovery at 4, 8, 16 ranks.

Every recovery builds the new generation's groups: the training group and torch's default group
(runtime/membership.py, runtime/default_group.py), both gloo over the job's store here. This runs
the example GPT (2 x 48, one thread per rank) as 2 simulated nodes of W/2 workers for each world
size W, with ``retry`` and an exception on rank 1 at step ``FAULT_STEP`` (so no process starts:
the recovery is the regroup and the roll-back), and reads from the event log:

- ``rebuild``: each rank's time to build the new generation's groups (event ``recovered``);
  median and maximum over the ranks;
- ``repair`` and ``wait for plan``: the rest of each rank's part (medians);
- ``plans reached the ranks over``: from the first rank's plan to the last's, and ``groups built
  after the last plan``: from the last rank's plan to the last rank's groups built (the build is a
  rendezvous: a rank's rebuild includes waiting for the last rank to have its plan);
- ``MTTR``: from the exception to the last rank's first step of the new generation.

All ranks share this machine's cores (2 here), so a larger world also means slower ranks; the
step time of the fault-free stretch is reported beside it for that reason.

    python bench/comm_init.py --worlds 4 8 16 --repeats 2 --out bench/results/comm_init.json
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
from interleave import medians  # noqa: E402

from undying import events as ev  # noqa: E402
from undying.events import Event, read_events  # noqa: E402

STEPS = 30
FAULT_STEP = 20
RUN_TIMEOUT_S = 900


def step_seconds(events: list[Event], before: float) -> float | None:
    """Median time per step of rank 0 before the fault, from its heartbeat events."""
    beats = sorted((e.step, e.time) for e in events
                   if e.kind == ev.HEARTBEAT and e.rank == 0 and e.step is not None and e.time < before)
    if len(beats) < 2 or beats[-1][0] <= beats[0][0]:
        return None
    return (beats[-1][1] - beats[0][1]) / (beats[-1][0] - beats[0][0])


def run_once(world: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="undying-comm-init-") as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-m", "undying.cli", "run", "--nnodes", "2", "--nproc-per-node", str(world // 2),
                   "--set", "process_recover=true", "--recover-strategy", "retry,recover-in-place",
                   "--set", "warm_standby=false", "--checkpoint-interval", "1000", "--quiet",
                   "--inject", f"raise:rank=1:step={FAULT_STEP}", "--run-dir", str(run_dir),
                   str(REPO / "examples" / "gpt" / "train.py"), "--steps", str(STEPS),
                   "--n-layer", "2", "--n-embd", "48", "--n-head", "2", "--log-every", "1000"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        started = time.time()
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=RUN_TIMEOUT_S)
        events = read_events(run_dir) if (run_dir / ev.EVENTS_FILE).exists() else []
        record: dict = {"world": world, "exit_code": result.returncode, "wall_seconds": round(time.time() - started, 2)}
        if result.returncode != 0:
            record["output_tail"] = result.stdout[-1500:] + result.stderr[-1500:]
        fault = next((e for e in events if e.kind == ev.INJECTION), None)
        recovered = [e for e in events if e.kind == ev.RECOVERED]
        if fault is None or len(recovered) < world:
            return record
        rebuild = [e.details["rebuild"] for e in recovered]
        record["rebuild_median"] = round(statistics.median(rebuild), 4)
        record["rebuild_max"] = round(max(rebuild), 4)
        record["repair_median"] = round(statistics.median(e.details["repair"] for e in recovered), 4)
        record["wait_for_plan_median"] = round(statistics.median(e.details["wait_for_plan"] for e in recovered), 4)
        # When each rank had its plan and when its groups were built (its event's time less its parts):
        # the build is a rendezvous, so a rank's rebuild includes waiting for the last rank's plan.
        planned = [e.time - e.details["repair"] - e.details["rebuild"] for e in recovered]
        built = [e.time - e.details["repair"] for e in recovered]
        record["plan_spread"] = round(max(planned) - min(planned), 4)
        record["build_after_last_plan"] = round(max(built) - max(planned), 4)
        firsts = [e.time for e in events if e.kind == ev.FIRST_STEP and e.time > fault.time]
        if len(firsts) >= world:
            record["mttr_seconds"] = round(max(firsts) - fault.time, 4)
        seconds = step_seconds(events, fault.time)
        if seconds is not None:
            record["step_seconds"] = round(seconds, 4)
        return record


def summarize(records: list[dict]) -> dict:
    keys = ("rebuild_median", "rebuild_max", "repair_median", "wait_for_plan_median", "plan_spread",
            "build_after_last_plan", "mttr_seconds", "step_seconds")
    return {"runs": len(records), "failed": sum(r["exit_code"] != 0 for r in records), **medians(records, keys, 4)}


def markdown(results: dict[int, dict]) -> str:
    lines = ["| world | step s | rebuild s: median (max) | plans reached the ranks over s | groups built s after the last plan "
             "| repair s | wait for plan s | MTTR s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for world, s in sorted(results.items()):
        lines.append(f"| {world} | {s.get('step_seconds', '-')} | {s.get('rebuild_median', '-')} "
                     f"({s.get('rebuild_max', '-')}) | {s.get('plan_spread', '-')} | {s.get('build_after_last_plan', '-')} "
                     f"| {s.get('repair_median', '-')} | "
                     f"{s.get('wait_for_plan_median', '-')} | {s.get('mttr_seconds', '-')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if any(world < 2 or world % 2 for world in args.worlds):
        parser.error("--worlds: each world size must be an even number >= 2 (two simulated nodes)")
    records: dict[int, list[dict]] = {world: [] for world in args.worlds}
    for repeat in range(args.repeats):
        for world in args.worlds:  # interleaved: a change in the machine's load falls on every size
            record = run_once(world)
            record["load_average"] = round(os.getloadavg()[0], 2)
            records[world].append(record)
            print(f"repeat {repeat + 1}/{args.repeats} world {world}: {json.dumps(record)[:400]}", flush=True)
    results = {world: summarize(runs) for world, runs in records.items()}
    print(markdown(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"results": {str(w): s for w, s in results.items()},
                                        "runs": {str(w): r for w, r in records.items()}}, indent=1))


if __name__ == "__main__":
    main()
