"""MTTR when a node is a real host: one `undying run --node-rank` per node (each its own process
group, seen only through its connections), next to the same fault on simulated nodes (one
`undying run`, nodes as child processes), in one run with the scenarios interleaved.

The job: examples/gpt/train.py, 2 nodes x 2 workers (and a spare node where the row says so), 30
steps, 0.4 s sleep per step so that the fault lands mid-run. Faults: a host killed (SIGKILL of its
process group), frozen (SIGSTOP of it: seen only by its silence) or leaving (SIGTERM to its
`undying run`, a preempted pod: it announces its leave). Recovery onto the spare (recover), or
without one the job trains on without the node (elastic training); a frozen host is waited for
2 s (the controller's reschedule wait shortened from its 30 s floor) before the shrink. MTTR: from
the fault (the injection's event, the SIGSTOP or the SIGTERM) to every rank's first completed step
after it; detection: from the fault to the controller's first ``agent_lost`` or ``fault_detected``.
Heartbeats as in the test suite (every 0.5 s, timeout 4 s) unless the row says the spec's defaults
(every 1 s, timeout 10 s). Each run's final parameters (``param_sha256`` of its result) are
compared with a fault-free run of the same job made first (``bitwise_equal``; an elastic shrink
trains on fewer replicas, so only the rows onto a spare are expected equal). Runs the test suite's
harness (tests/faults/test_real_hosts.py ``Hosts``), not a copy.

    python bench/real_hosts.py --repeats 2 --out bench/results/real_hosts.json
    python bench/real_hosts.py --only frozen --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))
from phases import recovery_phases  # noqa: E402

from tests.conftest import run_job  # noqa: E402
from tests.faults.test_real_hosts import (  # noqa: E402
    FREEZE_AT_STEP,
    FROZEN_CHAIN,
    RECOVER,
    STEP_SLEEP,
    Hosts,
    freeze_node1_after_a_few_steps,
)
from undying import events as ev  # noqa: E402
from undying.events import Event  # noqa: E402

KILL_STEP = 12
LEAVE_AT_STEP = 8  # the heartbeat step after which node 1's `undying run` gets SIGTERM
RESCHEDULE_WAIT = 2.0
# recover before elastic training: a spare takes the node's place if there is one, else the job shrinks.
ELASTIC_CHAIN = FROZEN_CHAIN
# The spec's defaults, in place of the test harness's shorter heartbeats (0.5 s, timeout 4 s).
DEFAULT_HEARTBEATS = ["--set", "heartbeat_interval=1.0", "--set", "heartbeat_timeout=10"]


def final_digest(run_dir: Path) -> str | None:
    """The job's final parameter digest (rank 0's result.json in ``run_dir``), None without one."""
    result = run_dir / "result.json"
    return json.loads(result.read_text()).get("param_sha256") if result.exists() else None


def outcome(events: list[Event], fault_time: float) -> dict[str, Any]:
    """MTTR (None if no step followed the fault) and how the job recovered: the first plan after
    the fault (its strategy and world size), whether a spare was adopted, whether the job restarted."""
    firsts = [e for e in events if e.kind == ev.FIRST_STEP and e.time > fault_time]
    mttr = None
    if firsts:
        generation = firsts[0].generation
        mttr = round(max(e.time for e in firsts if e.generation == generation) - fault_time, 3)
    plans = [e for e in events if e.kind == ev.RECOVERY_PLAN and e.time > fault_time]
    seen = [e for e in events if e.kind in (ev.AGENT_LOST, ev.FAULT_DETECTED) and e.time > fault_time]
    return {"mttr_seconds": mttr,
            "detect_seconds": round(seen[0].time - fault_time, 3) if seen else None,
            "detected_as": (seen[0].details.get("why") or seen[0].details.get("reason")) if seen else None,
            "strategy": plans[0].details["strategy"] if plans else None,
            "world_size": plans[0].details["world_size"] if plans else None,
            "spare_adopted": any(e.kind == ev.STANDBY_ADOPT for e in events),
            "job_restart": any(e.kind == ev.RESTART_BEGIN for e in events),
            "phases": recovery_phases(events, fault_time)}


def on_hosts(root: Path, extra: list[str], spare: bool, fault: Callable[[Hosts], float],
             reschedule_wait: float | None = None) -> dict[str, Any]:
    """Nodes 0 and 1 (and a spare) as real hosts; ``fault`` acts on them and returns its time."""
    cluster = Hosts(root, extra, reschedule_wait=reschedule_wait, script_args=STEP_SLEEP)
    try:
        for node in (0, 1):
            cluster.start(node)
        if spare:
            cluster.start(2, spare=True)
            cluster.wait_for_event("the spare's hello", lambda e: e.kind == ev.AGENT_REGISTERED
                                   and e.details["standby"])
        fault_time = fault(cluster)
        cluster.wait(0)
        events = cluster.events()
    finally:
        cluster.close()
    return {**outcome(events, fault_time), "param_sha256": final_digest(cluster.run_dir(0))}


def injected(cluster: Hosts) -> float:
    """The fault is the job's own injection (node 1 killed at KILL_STEP): its event's time."""
    injection = cluster.wait_for_event("the injection", lambda e: e.kind == ev.INJECTION)
    return injection.time


def frozen(until: str) -> Callable[[Hosts], float]:
    """SIGSTOP of node 1's process group; SIGCONT once the controller logged ``until``."""
    def fault(cluster: Hosts) -> float:
        frozen_at = freeze_node1_after_a_few_steps(cluster)
        cluster.wait_for_event(until, lambda e: e.kind == until)
        cluster.signal_host(1, signal.SIGCONT)
        return frozen_at
    return fault


def leave(cluster: Hosts) -> float:
    """SIGTERM to node 1's `undying run` (only it: it stops its own workers after saying so)."""
    cluster.wait_for_event(f"a heartbeat at step {LEAVE_AT_STEP}",
                           lambda e: e.kind == ev.HEARTBEAT and (e.step or 0) >= LEAVE_AT_STEP)
    left_at = time.time()
    os.kill(cluster.processes[1].pid, signal.SIGTERM)
    return left_at


def simulated_node(root: Path) -> dict[str, Any]:
    run = run_job(root, [*RECOVER, "--standby", "1", "--inject", f"node:node=1:step={KILL_STEP}"],
                  script_args=STEP_SLEEP)
    [injection] = run.kinds(ev.INJECTION)
    return {**outcome(run.events, injection.time), "param_sha256": final_digest(run.run_dir)}


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "real hosts: host killed, onto a spare": lambda root: on_hosts(
        root, [*RECOVER, "--inject", f"node:node=1:step={KILL_STEP}"], True, injected),
    "simulated nodes: node killed, onto a spare": simulated_node,
    "real hosts: host frozen (SIGSTOP), onto a spare": lambda root: on_hosts(
        root, FROZEN_CHAIN, True, frozen(ev.RECOVERY_PLAN), RESCHEDULE_WAIT),
    "real hosts: host frozen (SIGSTOP), onto a spare, default heartbeat settings": lambda root: on_hosts(
        root, [*FROZEN_CHAIN, *DEFAULT_HEARTBEATS], True, frozen(ev.RECOVERY_PLAN), RESCHEDULE_WAIT),
    "real hosts: host frozen (SIGSTOP), elastic shrink, no spare": lambda root: on_hosts(
        root, FROZEN_CHAIN, False, frozen(ev.ELASTIC_SHRINK), RESCHEDULE_WAIT),
    "real hosts: planned leave (SIGTERM), elastic shrink, no spare": lambda root: on_hosts(
        root, ELASTIC_CHAIN, False, leave),
    "real hosts: planned leave (SIGTERM), onto a spare": lambda root: on_hosts(
        root, ELASTIC_CHAIN, True, leave),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here too")
    parser.add_argument("--only", nargs="*", default=None, help="run the scenarios whose names contain one of these")
    args = parser.parse_args()
    chosen = {name: run for name, run in SCENARIOS.items()
              if args.only is None or any(part in name for part in args.only)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    with tempfile.TemporaryDirectory(prefix="undying-hosts-reference-") as tmp:
        reference = final_digest(run_job(Path(tmp), RECOVER).run_dir)
    print(f"fault-free reference: {reference}", file=sys.stderr, flush=True)
    for _ in range(args.repeats):
        for name, scenario in chosen.items():
            with tempfile.TemporaryDirectory(prefix="undying-hosts-bench-") as tmp:
                started = time.time()
                record = scenario(Path(tmp))
                record["bitwise_equal"] = record["param_sha256"] is not None and record["param_sha256"] == reference
                runs[name].append(record)
                print(f"{name}: {runs[name][-1]} ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    summary = {}
    for name, records in runs.items():
        values = [record["mttr_seconds"] for record in records]
        detects = [record["detect_seconds"] for record in records if record["detect_seconds"] is not None]
        summary[name] = {"median_mttr_seconds": statistics.median([v for v in values if v is not None] or [0.0]),
                         "median_detect_seconds": statistics.median(detects) if detects else None,
                         "median_phases": {phase: statistics.median(record["phases"][phase] for record in records
                                                                    if phase in record["phases"])
                                           for phase in {key for record in records for key in record["phases"]}},
                         "all_mttr_seconds": values,
                         "bitwise_equal_runs": sum(1 for record in records if record["bitwise_equal"]),
                         "runs": records}
    report = {"command": " ".join(["python", "bench/real_hosts.py", *sys.argv[1:]]), "kill_step": KILL_STEP,
              "freeze_at_step": FREEZE_AT_STEP, "leave_at_step": LEAVE_AT_STEP,
              "reschedule_wait_seconds": RESCHEDULE_WAIT, "fault_free_param_sha256": reference, "results": summary}
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
