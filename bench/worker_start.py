"""Workers forked from the node's warm standby against plain ``python`` workers: start, restart, memory.

Runs in the benchmark's own process (python bench/worker_start.py). The same job as
bench/recovery.py (the example GPT, 2 simulated nodes x 2 workers, 60 steps, T1 every step),
``warm_standby`` true (each agent's standby imports torch once and forks the node's workers) and
false (every worker its own ``python`` process), interleaved:

- ``start``: fault-free; seconds from ``undying run`` to the last rank ready to train (its
  ``worker_ready``: imports, ``undying.init()``, groups built, state restored), the steady
  step rate, and at step 20 the memory of every process of the job (controller, agents, standbys,
  workers): resident (RSS) and proportional (PSS: a page shared by k processes counts 1/k), from
  /proc/PID/smaps_rollup;
- ``job restart``: rank 1 SIGKILLed at step 35, the whole job restarted (recovery.py's
  ``measure_undying``: MTTR from the kill to every rank's first step after it).

    python bench/worker_start.py --repeats 3 --out bench/results/worker_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from interleave import interleaved, medians
from recovery import BASE, FAULT_STEP, REPO, STEPS, measure_undying

sys.path.insert(0, str(REPO / "src"))
from undying import events as ev  # noqa: E402
from undying.events import read_events  # noqa: E402

MARK = "UNDYING_BENCH_MARK"
MEMORY_AT_STEP = 20
CASES = [("start", "forked"), ("start", "plain"), ("job restart", "forked"), ("job restart", "plain")]
STANDBY = {"forked": ["--set", "warm_standby=true"], "plain": ["--set", "warm_standby=false"]}


def memory_of(mark: str) -> dict:
    """RSS and PSS (MiB) summed over the live processes whose environment carries ``mark``."""
    rss = pss = 0
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"{MARK}={mark}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            rollup = (entry / "smaps_rollup").read_text()
        except OSError:
            continue
        fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup.splitlines()[1:] if line.endswith("kB")}
        rss, pss, count = rss + fields.get("Rss", 0), pss + fields.get("Pss", 0), count + 1
    return {"processes": count, "rss_mib": round(rss / 1024), "pss_mib": round(pss / 1024)}


def measure_start(kind: str) -> dict:
    mark = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="undying-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-m", "undying.cli", "run", *BASE, *STANDBY[kind], "--run-dir", str(run_dir),
                   str(REPO / "examples" / "gpt" / "train.py"), "--steps", str(STEPS)]
        started = time.time()
        memory: dict = {}
        with subprocess.Popen(command, cwd=REPO, env=dict(os.environ, **{MARK: mark}),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as job:
            while job.poll() is None:
                events = read_events(run_dir) if (run_dir / ev.EVENTS_FILE).exists() else []
                if not memory and any(e.kind == ev.HEARTBEAT and (e.step or 0) >= MEMORY_AT_STEP for e in events):
                    memory = memory_of(mark)
                time.sleep(0.1)
        events = read_events(run_dir)
    readies = [e.time for e in events if e.kind == ev.WORKER_READY and e.generation == 1]
    saves = {e.step: e.time for e in events if e.kind == ev.CHECKPOINT_SAVE}
    record = {"exit_code": job.returncode, "start_seconds": round(max(readies) - started, 3), **memory}
    if 20 in saves and STEPS in saves:
        record["steps_per_second"] = round((STEPS - 20) / (saves[STEPS] - saves[20]), 2)
    return record


def measure(case: tuple[str, str]) -> dict:
    what, kind = case
    if what == "start":
        return measure_start(kind)
    return measure_undying([*STANDBY[kind], "--inject", f"kill:rank=1:step={FAULT_STEP}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    records = interleaved(args.repeats, CASES, measure)
    keys = ("start_seconds", "steps_per_second", "rss_mib", "pss_mib", "processes", "mttr_seconds",
            "detect_seconds", "restarted_processes")
    results = {f"{what}, {kind}": {"runs": len(runs), "failed": sum(r["exit_code"] != 0 for r in runs),
                                   **medians(runs, keys)} for (what, kind), runs in records.items()}
    print("| case | runs (failed) | start s | steps/s | RSS MiB | PSS MiB | MTTR s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, s in results.items():
        cells = [f"{s[k]} ({', '.join(map(str, s[k + '_all']))})" if k in s else "-"
                 for k in ("start_seconds", "steps_per_second", "rss_mib", "pss_mib", "mttr_seconds")]
        print(f"| {name} | {s['runs']} ({s['failed']}) | {' | '.join(cells)} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "results": results,
                                        "runs": {", ".join(case): runs for case, runs in records.items()}},
                                       indent=1))


if __name__ == "__main__":
    main()
