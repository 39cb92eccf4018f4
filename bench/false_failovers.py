"""No false fault with the failover settings: fault-free `undying run --etcd` jobs beside busy loops.

Three ``undying run --etcd`` processes on loopback (nodes 0 and 1, 2 workers each, and one spare
node), the default ``--lease-ttl`` (2 s) and heartbeat settings, train the GPT example for
``--steps`` steps against a local etcd this script starts, ``--runs`` times, while ``--busy``
processes spin on the same cores. A run is clean when its event log holds no controller takeover
or deposition, no lost agent, no fault detected and no decision, and the job succeeded. ``--set
KEY=VALUE`` (repeatable) goes to every node's ``undying run`` (e.g. ``warm_standby=false``: each
worker a fresh process importing torch at the start, beside its agent).

    python bench/false_failovers.py --runs 20 --steps 40 --busy 2 --out bench/results/false_failovers.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))
from failover import TOKEN, TRAIN, start_etcd  # noqa: E402

from undying import events as ev  # noqa: E402
from undying.events import read_events  # noqa: E402
from undying.locate import locate_controller  # noqa: E402

FALSE = (ev.CONTROLLER_TAKEOVER, ev.CONTROLLER_DEPOSED, ev.AGENT_LOST, ev.FAULT_DETECTED, ev.DECISION)


def spin() -> None:
    while True:
        pass


def one_run(etcd: str, steps: int, settings: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="undying-false-failover-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        (run_dir / "token").write_text(TOKEN)
        job = f"bench-{uuid.uuid4().hex[:8]}"

        def start(node: int) -> subprocess.Popen:
            command = [sys.executable, "-m", "undying.cli", "run", "--nnodes", "2", "--nproc-per-node", "2",
                       "--quiet", "--run-dir", str(run_dir), "--node-rank", str(node), "--etcd", etcd,
                       "--job-name", job, "--token-file", str(run_dir / "token"),
                       *(["--standby", "1"] if node >= 2 else []),
                       *(option for setting in settings for option in ("--set", setting)), TRAIN, "--steps", str(steps)]
            return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})

        started = time.time()
        nodes = {0: start(0)}
        while locate_controller(etcd, job) is None:
            time.sleep(0.1)
        nodes[1], nodes[2] = start(1), start(2)
        codes = [process.wait(timeout=900) for process in nodes.values()]
        events = read_events(run_dir)
        false = [f"{e.kind} {e.details.get('why') or e.details.get('description') or ''}"[:160]
                 for e in events if e.kind in FALSE]
        return {"exit_codes": codes, "seconds": round(time.time() - started, 1), "false": false,
                "clean": not false and codes == [0, 0, 0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the jobs")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a spec setting for every node's undying run (repeatable)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    spinners = [mp.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    runs, loads = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-etcd-") as data:
            etcd_process, etcd = start_etcd(Path(data))
            try:
                for index in range(args.runs):
                    runs.append(one_run(etcd, args.steps, args.settings))
                    loads.append(round(os.getloadavg()[0], 2))
                    print(index, runs[-1], flush=True)
            finally:
                etcd_process.terminate()
                etcd_process.wait()
    finally:
        for spinner in spinners:
            spinner.terminate()
    report = {"runs": args.runs, "steps": args.steps, "busy": args.busy, "settings": args.settings,
              "clean_runs": sum(1 for run in runs if run["clean"]), "load_average": [min(loads), max(loads)],
              "details": runs}
    print(json.dumps({key: value for key, value in report.items() if key != "details"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
