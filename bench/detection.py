"""Detection benchmark: how fast a stopped rank is acted on with the default heartbeat settings,
whether load makes heartbeats late enough for a false fault, and where a retry's time goes.

The GPT example on 2 simulated nodes x 2 workers, with the job spec's own ``heartbeat_interval``,
``heartbeat_timeout`` and ``monitor_interval`` (bench/recovery.py shortens them). Modes:

- ``hang``: SIGSTOP of rank 1 at step 35 (recover-in-place, and job restart): detect and MTTR seconds.
- ``load``: a fault-free run with a spare agent, warm standbys and ``--hogs`` busy processes beside
  it (the machine's cores oversubscribed), then the same with a SIGSTOP: every heartbeat's arrival
  at the controller is recorded, giving each rank's longest gap between two beats, and any fault
  the controller detected when none was injected.
- ``retry``: an exception in rank 1's step 35: the phases from fault to the first step after it.
- ``start``: fault-free starts under load, without warm standbys (each worker imports torch beside
  its agent) and with them, the first step compiling (examples/loop/train.py ``--compile``): each
  node's longest silence while its ranks were starting, and after (the phase each beat said).

    python bench/detection.py --mode hang retry load --repeats 3 --out bench/results/detection.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from undying import events as ev  # noqa: E402
from undying.events import Event, read_events  # noqa: E402

FAULT_STEP = 35
PROCESS = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
           "--recover-strategy", "retry,recover-in-place,recover,dump"]
BASE = ["--nnodes", "2", "--nproc-per-node", "2", "--checkpoint-interval", "10", "--quiet"]
HANG = ["--inject", f"hang:rank=1:step={FAULT_STEP}"]
# The controller process, with every heartbeat's arrival recorded (rank, pid, monotonic time, the
# phase it said), and every request of an agent (poll, report, beat) as rank -1 - node.
RECORD_BEATS = """
import atexit, json, os, sys, time
from undying.controller import machine
arrivals = []
original = machine.JobMachine.heartbeat
def heartbeat(self, now, beat):
    arrivals.append((beat.rank, beat.pid, time.monotonic(), str(beat.phase)))
    return original(self, now, beat)
machine.JobMachine.heartbeat = heartbeat
reported = machine.JobMachine.agent_report
def agent_report(self, now, poll):
    arrivals.append((-1 - poll.node, poll.pid, time.monotonic(), ""))  # any request of node N's agent
    return reported(self, now, poll)
machine.JobMachine.agent_report = agent_report
atexit.register(lambda: open(os.environ["BENCH_BEATS"], "w").write(json.dumps(arrivals)))
from undying.cli import main
sys.exit(main())
"""


GPT = [str(REPO / "examples" / "gpt" / "train.py")]
COMPILING = [str(REPO / "examples" / "loop" / "train.py"), "--compile", "--warmup", "1"]


def run_job(options: list[str], steps: int, hogs: int = 0, keep: Path | None = None,
            script: list[str] = GPT) -> tuple[int, float, list[Event], list[list]]:
    """One job: its exit code, wall seconds, events and heartbeat arrivals (its event log and
    agent logs copied to ``keep`` when given)."""
    with tempfile.TemporaryDirectory(prefix="undying-detect-") as tmp:
        run_dir = Path(tmp) / "run"
        beats_file = Path(tmp) / "beats.json"
        command = [sys.executable, "-c", RECORD_BEATS, "run", *BASE, *options, "--run-dir", str(run_dir),
                   *script, "--steps", str(steps)]
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        started = time.time()
        try:
            result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=900,
                                    env={**os.environ, "BENCH_BEATS": str(beats_file)})
        finally:
            for process in busy:
                process.kill()
                process.wait()
        wall = time.time() - started
        beats = json.loads(beats_file.read_text()) if beats_file.exists() else []
        if keep is not None:
            shutil.copytree(run_dir, keep, ignore=shutil.ignore_patterns("checkpoints"), dirs_exist_ok=True)
        return result.returncode, round(wall, 3), read_events(run_dir), beats


def node_of(rank: int, per_node: int) -> int:
    """The node of an arrival: a rank's, or -1 - node for a request of that node's agent."""
    return -1 - rank if rank < 0 else rank // per_node


def silences_by_phase(beats: list[list], per_node: int = 2) -> dict[str, float]:
    """Each node's longest silence (no request from its agent or any of its ranks), split by what
    its ranks' newest beats said when the silence began: all still ``starting`` (or none beat
    yet), or later (training, the first step's compile included)."""
    longest = {"max_node_silence_starting": 0.0, "max_node_silence_later": 0.0}
    nodes: dict[int, list[list]] = {}
    for arrival in beats:
        nodes.setdefault(node_of(int(arrival[0]), per_node), []).append(arrival)
    for arrivals in nodes.values():
        arrivals.sort(key=lambda arrival: arrival[2])
        phases: dict[int, str] = {}
        for earlier, later in pairwise(arrivals):
            if earlier[0] >= 0:
                phases[int(earlier[0])] = earlier[3]
            starting = all(phase == "starting" for phase in phases.values())
            key = "max_node_silence_starting" if starting else "max_node_silence_later"
            longest[key] = max(longest[key], round(later[2] - earlier[2], 3))
    return longest


def beat_gaps(beats: list[list], per_node: int = 2) -> dict[str, float]:
    """The longest and the 99th-percentile gap between two heartbeats of one process, over all ranks;
    the longest gap between two agent requests; and the longest silence of a whole node (its agent
    and all its ranks at once), which the controller takes for a frozen host past
    ``host_silence_timeout``."""
    by_process: dict[tuple[int, int], list[float]] = {}
    by_node: dict[int, list[float]] = {}
    for rank, pid, at, *_ in beats:
        by_process.setdefault((int(rank), int(pid)), []).append(at)
        by_node.setdefault(node_of(int(rank), per_node), []).append(at)

    def gaps_of(groups: list[list[float]]) -> list[float]:
        return sorted(later - earlier for times in groups for earlier, later in pairwise(sorted(times)))

    gaps = gaps_of([times for (rank, _), times in by_process.items() if rank >= 0])
    if not gaps:
        return {}
    agents = gaps_of([times for (rank, _), times in by_process.items() if rank < 0])
    nodes = gaps_of(list(by_node.values()))
    return {"max_beat_gap": round(gaps[-1], 3), "p99_beat_gap": round(gaps[int(len(gaps) * 0.99)], 3),
            "beats": len(gaps) + len(by_process),
            **({"max_agent_gap": round(agents[-1], 3)} if agents else {}),
            **({"max_node_silence": round(nodes[-1], 3)} if nodes else {})}


def fault_timings(events: list[Event]) -> dict[str, float]:
    """Seconds from the injected fault to its detection and to every rank's first step after it."""
    injections = [e for e in events if e.kind == ev.INJECTION]
    if not injections:
        return {}
    fault = injections[0]
    record: dict[str, float] = {}
    detected = next((e for e in events if e.kind == ev.FAULT_DETECTED and e.time >= fault.time), None)
    if detected is not None:
        record["detect_seconds"] = round(detected.time - fault.time, 3)
    firsts = [e for e in events if e.kind == ev.FIRST_STEP and e.time > fault.time]
    if firsts:
        last_first = max(e.time for e in firsts if e.generation == firsts[0].generation)
        record["mttr_seconds"] = round(last_first - fault.time, 3)
    return record


def retry_phases(events: list[Event]) -> dict[str, float]:
    """A retry's time, phase by phase, from the injected exception (event times, seconds)."""
    record = fault_timings(events)
    injections = [e for e in events if e.kind == ev.INJECTION]
    if not injections:
        return record
    start = injections[0].time

    def first(kind: str) -> Event | None:
        return next((e for e in events if e.kind == kind and e.time >= start), None)

    for kind in (ev.STEP_FAILED, ev.FAULT_DETECTED, ev.DECISION, ev.RECOVERY_PLAN):
        found = first(kind)
        if found is not None:
            record[f"to_{kind}"] = round(found.time - start, 4)
    recovered = [e for e in events if e.kind == ev.RECOVERED and e.time >= start]
    for phase in ("wait_for_plan", "rebuild", "repair", "total"):
        values = [e.details[phase] for e in recovered if phase in e.details]
        if values:
            record[f"max_{phase}"] = max(values)
    return record


def summarize(runs: list[dict]) -> dict:
    summary: dict = {"runs": len(runs), "failed_runs": sum(1 for run in runs if run["exit_code"] != 0)}
    for key in sorted({key for run in runs for key in run if key != "exit_code"}):
        values = [run[key] for run in runs if isinstance(run.get(key), (int, float))]
        if values:
            summary[key] = {"median": round(statistics.median(values), 4), "all": values}
    return summary


def scenarios(modes: list[str], hogs: int) -> list[tuple[str, list[str], int, int, list[str]]]:
    """(name, options, steps, hogs, script) of each run the modes ask for."""
    plan = []
    if "hang" in modes:
        plan += [("recover-in-place, SIGSTOP worker, default heartbeats", [*PROCESS, *HANG], 60, 0, GPT),
                 ("job-restart, SIGSTOP worker, default heartbeats", HANG, 60, 0, GPT)]
    if "load" in modes and "hang" in modes:
        plan.append((f"job-restart, SIGSTOP worker under load ({hogs} busy processes)", HANG, 60, hogs, GPT))
    if "retry" in modes:
        plan.append(("retry, exception in step", [*PROCESS, "--inject", f"raise:rank=1:step={FAULT_STEP}"], 60, 0, GPT))
    if "load" in modes:
        plan += [(f"fault-free under load ({hogs} busy processes, spare agent)",
                  [*PROCESS, "--standby", "1"], 600, hogs, GPT),
                 (f"recover-in-place, SIGSTOP worker under load ({hogs} busy processes)",
                  [*PROCESS, "--standby", "1", *HANG], 200, hogs, GPT)]
    if "start" in modes:
        plan += [(f"fault-free start, no warm standby, compiling ({hogs} busy processes)",
                  ["--set", "warm_standby=false"], 8, hogs, COMPILING),
                 (f"fault-free start, warm standby, compiling ({hogs} busy processes)", [], 8, hogs, COMPILING)]
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", nargs="+", choices=["hang", "retry", "load", "start"],
                        default=["hang", "retry", "load"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=4, help="busy processes beside the job in mode load")
    parser.add_argument("--only", nargs="*", help="scenario names (substring match)")
    parser.add_argument("--keep", help="copy each run's event log and logs under this folder")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "detection.json"))
    args = parser.parse_args()
    results: dict[str, dict] = {}
    for name, options, steps, hogs, script in scenarios(args.mode, args.hogs):
        if args.only and not any(part in name for part in args.only):
            continue
        runs = []
        for repeat in range(args.repeats):
            keep = Path(args.keep) / f"{len(results)}-{repeat}" if args.keep else None
            code, wall, events, beats = run_job(options, steps, hogs, keep, script)
            run: dict = {"exit_code": code, "wall_seconds": wall, **beat_gaps(beats), **silences_by_phase(beats),
                         **(retry_phases(events) if "retry" in name else fault_timings(events))}
            run["faults_detected"] = len([e for e in events if e.kind == ev.FAULT_DETECTED])
            runs.append(run)
            print(f"{name} [{repeat + 1}/{args.repeats}] load {os.getloadavg()[0]:.2f}: {json.dumps(run)}",
                  flush=True)
        results[name] = summarize(runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "load_average": os.getloadavg(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
