"""What stragglers, bad steps, health checks and a job restart's wait for a commit cost, with real processes.

Runs examples/gpt/train.py under ``undying run`` (2 simulated nodes x 2 ranks, a spare, checkpoints
every 10 steps; steps stretched by ``--step-sleep`` so that the step rate is the job's, not the busy
machine's) in these scenarios, interleaved, ``--repeats`` times each:

- ``fault-free``: the step rate (rank 0's heartbeats, steps 14..end);
- ``straggler-report``: rank 3 slowed by half from step 6 (``slow:...:factor=1.5``), reported only:
  how many steps and seconds after the slowdown the straggler is reported, the step rate slowed;
- ``straggler-switch``: the same with ``straggler_strategy: switch``: also the switch's time (its
  start to the first step after it) and the step rate after it, against ``fault-free``;
- ``nan-transient``: a NaN in rank 1's output at step 12: what the replay cost (the bad step's event
  to the replay's commit);
- ``check-failed``: node 1's health check fails (``check:node=1``): each check's time, and when
  the first generation starts with the spare in node 1's place;
- ``restart`` and ``restart-no-check``: rank 3 killed at step 12 (a job restart), with the health
  check after the stop and without (``node_check: false``): MTTR (fault detected -> first step);
- ``restart-drain``: the same while rank 0's persister waits 2 s before committing step 10
  (``stall ... at=persist``): how long the restart held its stop orders, and MTTR.

    python bench/incidents.py --repeats 2 --out bench/results/incidents.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from undying import events as ev  # noqa: E402
from undying.events import Event, read_events  # noqa: E402

STEPS = 40
SLOW_AT = 6
BASE = ["--nnodes", "2", "--nproc-per-node", "2", "--monitor-interval", "0.3", "--checkpoint-interval", "10",
        "--set", "heartbeat_interval=0.5", "--set", "heartbeat_timeout=4", "--standby", "1",
        "--set", "process_recover=true", "--set", "straggler_window=5", "--set", "straggler_threshold=1.4"]
SCENARIOS: dict[str, list[str]] = {
    "fault-free": [],
    "straggler-report": ["--inject", f"slow:rank=3:step={SLOW_AT}:factor=1.5"],
    "straggler-switch": ["--set", "straggler_strategy=switch", "--inject", f"slow:rank=3:step={SLOW_AT}:factor=1.5"],
    "nan-transient": ["--inject", "nan:rank=1:step=12"],
    "check-failed": ["--inject", "check:node=1"],
    "restart": ["--inject", "kill:rank=3:step=12"],
    "restart-no-check": ["--set", "node_check=false", "--inject", "kill:rank=3:step=12"],
    "restart-drain": ["--inject", "stall:rank=0:step=10:at=persist:seconds=2", "--inject", "kill:rank=3:step=12"],
}


def run(name: str, step_sleep: float, root: Path) -> list[Event]:
    run_dir = root / name
    command = [sys.executable, "-m", "undying.cli", "run", *BASE, *SCENARIOS[name], "--run-dir", str(run_dir),
               str(REPO / "examples" / "gpt" / "train.py"), "--steps", str(STEPS), "--step-sleep", str(step_sleep)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed: {done.stderr[-2000:]}")
    return read_events(run_dir)


def rate(events: list[Event], first: int) -> float | None:
    """Rank 0's steps per second from its first heartbeat at step >= ``first`` to its last heartbeat
    (heartbeats come every 0.5 s: the last may be a few steps before the end)."""
    beats = [(e.time, e.step) for e in events if e.kind == ev.HEARTBEAT and e.rank == 0 and e.step is not None]
    start = next(((t, s) for t, s in beats if s >= first), None)
    if start is None or not beats or beats[-1][1] <= start[1]:
        return None
    return (beats[-1][1] - start[1]) / (beats[-1][0] - start[0])


def first(events: list[Event], kind: str, **where: Any) -> Event | None:
    return next((e for e in events if e.kind == kind and all(getattr(e, k) == v for k, v in where.items())), None)


def mttr(events: list[Event]) -> float | None:
    fault, resumed = first(events, ev.FAULT_DETECTED), [e for e in events if e.kind == ev.FIRST_STEP]
    return None if fault is None or not resumed else round(max(e.time for e in resumed) - fault.time, 3)


def measure(name: str, events: list[Event]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if name in ("fault-free", "straggler-report"):
        result["steps_per_second"] = rate(events, 14)
    if name.startswith("straggler"):
        injected, straggler = first(events, ev.INJECTION, rank=3), first(events, ev.STRAGGLER, rank=3)
        if straggler is not None and injected is not None:
            result["detected_after_steps"] = (straggler.step or 0) - SLOW_AT
            result["detected_after_seconds"] = round(straggler.time - injected.time, 3)
    if name == "straggler-switch":
        begin = first(events, ev.SWITCH_BEGIN)
        resumed = [e for e in events if e.kind == ev.FIRST_STEP and begin is not None and e.time > begin.time]
        if begin is not None and resumed:
            result["switch_seconds"] = round(max(e.time for e in resumed) - begin.time, 3)
            after = max(e.step or 0 for e in resumed) + 3
            result["steps_per_second_after"] = rate(events, max(after, 14))
    if name == "nan-transient":
        bad = [e for e in events if e.kind == ev.BAD_STEP]
        if len(bad) == 2:
            result["replay_seconds"] = round(bad[1].time - bad[0].time, 3)
        result["steps_per_second"] = rate(events, 14)
    if name == "check-failed":
        failed, started = first(events, ev.NODE_CHECK_FAILED), first(events, ev.GENERATION_START)
        checks = [e.details.get("check", {}).get("check_seconds") for e in events if e.kind == ev.AGENT_REGISTERED]
        result["check_seconds"] = [seconds for seconds in checks if seconds is not None]
        result["slowest_check_seconds"] = max(result["check_seconds"], default=None)
        if failed is not None and started is not None:
            result["failed_to_generation_seconds"] = round(started.time - failed.time, 3)
    if name.startswith("restart"):
        result["mttr_seconds"] = mttr(events)
        drain = first(events, ev.COMMIT_DRAIN)
        if drain is not None:
            result["drain_seconds"] = drain.details["seconds"]
            result["drain_outcome"] = drain.details["outcome"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    names = args.scenarios.split(",")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    loads = []
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            for name in names:
                loads.append(os.getloadavg()[0])
                runs[name].append(measure(name, run(name, args.step_sleep, Path(root) / f"{repeat}")))
                print(name, runs[name][-1], flush=True)
    summary = {name: {key: statistics.median(values) for key in results[0]
                      if isinstance(results[0][key], int | float)
                      and (values := [r[key] for r in results if isinstance(r.get(key), int | float)])}
               for name, results in runs.items() if results}
    report = {"repeats": args.repeats, "step_sleep": args.step_sleep, "load_average": [min(loads), max(loads)],
              "medians": summary, "runs": runs}
    print(json.dumps(report["medians"], indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
