"""MTTR when a node is a real host: one `undying run --node-rank` per node (each its own process
group, seen only through its connections), next to the same fault on simulated nodes (one
`undying run`, nodes as child processes), in one run with the scenarios interleaved.

The job: examples/gpt/train.py, 2 nodes x 2 workers and a spare node, 30 steps (0.4 s sleep per
step on real hosts, so the fault lands mid-run), recover onto the spare. MTTR: from the fault (the
injection's event, or the SIGSTOP) to every rank's first completed step after it. Runs the test
suite's harness (tests/faults/test_real_hosts.py ``Hosts``), not a copy of it.

    python bench/real_hosts.py --repeats 2
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))
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
SCENARIOS = ("real hosts: host killed, onto a spare", "simulated nodes: node killed, onto a spare",
             "real hosts: host frozen (SIGSTOP), onto a spare")


def mttr(events: list[Event], fault_time: float) -> float | None:
    firsts = [e for e in events if e.kind == ev.FIRST_STEP and e.time > fault_time]
    if not firsts:
        return None
    generation = firsts[0].generation
    return round(max(e.time for e in firsts if e.generation == generation) - fault_time, 3)


def killed_host(root: Path) -> float | None:
    cluster = Hosts(root, [*RECOVER, "--inject", f"node:node=1:step={KILL_STEP}"], script_args=STEP_SLEEP)
    try:
        for node in (0, 1):
            cluster.start(node)
        cluster.start(2, spare=True)
        cluster.wait(0)
        events = cluster.events()
    finally:
        cluster.close()
    [injection] = [e for e in events if e.kind == ev.INJECTION]
    return mttr(events, injection.time)


def simulated_node(root: Path) -> float | None:
    run = run_job(root, [*RECOVER, "--standby", "1", "--inject", f"node:node=1:step={KILL_STEP}"],
                  script_args=STEP_SLEEP)
    [injection] = run.kinds(ev.INJECTION)
    return mttr(run.events, injection.time)


def frozen_host(root: Path) -> float | None:
    cluster = Hosts(root, FROZEN_CHAIN, reschedule_wait=2.0, script_args=STEP_SLEEP)
    try:
        for node in (0, 1):
            cluster.start(node)
        cluster.start(2, spare=True)
        frozen_at = freeze_node1_after_a_few_steps(cluster)
        cluster.wait_for_event("recovery_plan", lambda e: e.kind == ev.RECOVERY_PLAN)
        cluster.signal_host(1, signal.SIGCONT)
        cluster.wait(0)
        events = cluster.events()
    finally:
        cluster.close()
    return mttr(events, frozen_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    runs = {SCENARIOS[0]: killed_host, SCENARIOS[1]: simulated_node, SCENARIOS[2]: frozen_host}
    results: dict[str, list[float | None]] = {name: [] for name in SCENARIOS}
    for _ in range(args.repeats):
        for name, scenario in runs.items():
            with tempfile.TemporaryDirectory(prefix="undying-hosts-bench-") as tmp:
                started = time.time()
                results[name].append(scenario(Path(tmp)))
                print(f"{name}: MTTR {results[name][-1]} s ({time.time() - started:.0f} s)", file=sys.stderr,
                      flush=True)
    summary = {name: {"median_mttr_seconds": statistics.median([v for v in values if v is not None] or [0.0]),
                      "all_mttr_seconds": values} for name, values in results.items()}
    print(json.dumps({"kill_step": KILL_STEP, "freeze_at_step": FREEZE_AT_STEP, "results": summary}, indent=2))


if __name__ == "__main__":
    main()
