"""``undying demo``: a small GPT on 2 simulated nodes x 2 workers, a worker killed mid-run, recovery shown.

Runs in the CLI process: it launches the example job with process-level recovery
(the killed rank is replaced from the node's warm standby; the other ranks keep their
processes), and, unless told not to, a fault-free reference run; then it prints from
the event log what happened and whether the recovered run ended bitwise equal to the
fault-free one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from undying.events import read_events
from undying.report import render_summary, summarize, write_report

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt" / "train.py"
DEMO_FLAGS = ["--nnodes", "2", "--nproc-per-node", "2", "--monitor-interval", "0.5",
              "--checkpoint-interval", "20", "--set", "heartbeat_interval=0.5", "--set", "heartbeat_timeout=5",
              "--set", "process_recover=true", "--set", "pod_rescheduling=on",
              "--recover-strategy", "retry,recover-in-place,recover,dump"]


def _run(run_dir: Path, steps: int, injections: list[str], quiet: bool) -> int:
    command = [sys.executable, "-m", "undying.cli", "run", *DEMO_FLAGS, "--run-dir", str(run_dir)]
    for injection in injections:
        command += ["--inject", injection]
    if quiet:
        command += ["--quiet", "--redirects", "3"]  # nothing on the console: the workers' lines stay in logs/
    command += [str(EXAMPLE), "--steps", str(steps), "--log-every", "10"]
    return subprocess.call(command)


def run_demo(args: argparse.Namespace) -> int:
    if not EXAMPLE.is_file():
        print(f"undying: error: the demo needs the repository's examples/ ({EXAMPLE} not found)", file=sys.stderr)
        return 2
    base = Path(args.run_dir) if args.run_dir else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    faulty_dir = base / "with-fault"
    print(f"== undying demo: GPT on 2 nodes x 2 workers, {args.steps} steps, fault: {args.inject}", flush=True)
    code = _run(faulty_dir, args.steps, [args.inject], quiet=False)
    if code != 0:
        print(f"undying demo: the job failed (exit {code}); logs in {faulty_dir}/logs", file=sys.stderr)
        return code
    summary = summarize(read_events(faulty_dir))
    print("\n== what happened (from the event log)")
    print(render_summary(summary))
    print(f"timeline picture: {write_report(faulty_dir)}")
    from undying.report.png import write_png

    print(f"report picture: {write_png(faulty_dir)}")
    result = json.loads((faulty_dir / "result.json").read_text())
    if args.no_compare:
        return 0
    print("\n== fault-free reference run, same seed and world size", flush=True)
    reference_dir = base / "reference"
    code = _run(reference_dir, args.steps, [], quiet=True)
    if code != 0:
        return code
    reference = json.loads((reference_dir / "result.json").read_text())
    same = reference["param_sha256"] == result["param_sha256"]
    print(f"recovered run  param_sha256 {result['param_sha256']}")
    print(f"fault-free run param_sha256 {reference['param_sha256']}")
    print("bitwise equal: " + ("yes - nothing was lost" if same else "NO"))
    return 0 if same else 1
