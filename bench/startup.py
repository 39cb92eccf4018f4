"""Spurious faults at start: N starts of a 2 x 2 job with a short comm_timeout, counting any fault.

Four workers importing torch on 2 cores arrive at the start-up restore seconds apart; a start-up
rendezvous bounded by comm_timeout instead of start_timeout failed 1 start in 25 with
comm_timeout 5 (a spurious job restart). Each start runs the example for a few steps and counts
the fault_detected and restart_begin events in its log.

    python bench/startup.py --starts 50 --comm-timeout 5 --out bench/results/startup.json
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
EXAMPLE = REPO / "examples" / "gpt" / "train.py"


def one_start(comm_timeout: float, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="undying-startup-") as tmp:
        run_dir = Path(tmp) / "run"
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "undying.cli", "run", "--nnodes", "2", "--nproc-per-node", "2", "--quiet",
             "--set", f"comm_timeout={comm_timeout}", "--run-dir", str(run_dir), str(EXAMPLE),
             "--steps", str(steps)], capture_output=True, text=True, cwd=REPO, timeout=600)
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    faults = [event["details"].get("description", "") for event in events if event["kind"] == "fault_detected"]
    return {"exit_code": result.returncode, "seconds": round(time.monotonic() - started, 2), "faults": faults,
            "restarts": sum(event["kind"] == "restart_begin" for event in events)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=50)
    parser.add_argument("--comm-timeout", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = []
    for index in range(args.starts):
        run = one_start(args.comm_timeout, args.steps)
        runs.append(run)
        print(f"start {index + 1}/{args.starts}: {json.dumps(run)}", flush=True)
    spurious = sum(bool(run["faults"]) or run["exit_code"] != 0 for run in runs)
    print(f"{spurious} of {len(runs)} starts had a fault or failed (comm_timeout {args.comm_timeout:g} s)")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "comm_timeout": args.comm_timeout,
                                        "starts": len(runs), "spurious": spurious, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
