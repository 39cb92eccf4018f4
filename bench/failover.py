"""Controller-failover benchmark: losing the node that hosts the controller and rank 0.

Three ``undying run --etcd`` processes on loopback (nodes 0 and 1, 2 workers each, and one
spare node) train the GPT example for 60 steps against a local etcd this script starts.
Node 0 leads. Its whole process group (controller, agent, ranks 0 and 1) is SIGKILLed at
step 35, or SIGSTOPped there and SIGCONTed once training is back. From the event log:
fault -> takeover (a candidate on another node resumed the saved state), fault -> node 0
declared lost, MTTR (fault -> every rank completed its first step after it), steps lost,
processes started after the fault, whether the final parameters equal a fault-free run's (one run of
the same job first), and the phases (the lease's expiry and the election, the dead
node declared lost by the new leader, the decision, the recovery to every rank's first step). Side by side in the same run: the same job without
failover, where losing a node costs a job-level restart (node 1 SIGKILLed at step 35: a
node-0 loss would end that job outright), and torchrun + torch.save with a worker killed.

    python bench/failover.py --repeats 3 --out bench/results/failover.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))
from phases import recovery_phases  # noqa: E402
from recovery import BASE, FAULT_STEP, PROCESS, STEPS, free_port, measure_torchrun, summarize  # noqa: E402

from undying import events as ev  # noqa: E402
from undying.etcd import EtcdClient, EtcdUnavailable  # noqa: E402
from undying.events import read_events  # noqa: E402
from undying.locate import locate_controller  # noqa: E402

TOKEN = "bench-failover-token-0123456789"
PHASES = ("phase_takeover_seconds", "phase_declared_lost_seconds", "phase_decision_seconds", "phase_recovery_seconds")
TRAIN = str(REPO / "examples" / "gpt" / "train.py")


def start_etcd(data: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("etcd")
    if binary is None:
        sys.exit("bench/failover.py needs etcd (Debian: apt-get install etcd-server)")
    client_port, peer_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{client_port}"
    process = subprocess.Popen(
        [binary, "--name", "bench", "--data-dir", str(data), "--listen-client-urls", f"http://{endpoint}",
         "--advertise-client-urls", f"http://{endpoint}", "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"bench=http://127.0.0.1:{peer_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = EtcdClient(endpoint)
    deadline = time.time() + 30
    while True:
        try:
            client.get("/probe")
            return process, endpoint
        except EtcdUnavailable:
            if time.time() > deadline:
                process.kill()
                sys.exit("etcd did not start")
            time.sleep(0.2)


def wait_event(run_dir: Path, predicate, timeout: float = 300) -> ev.Event | None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for event in read_events(run_dir):
            if predicate(event):
                return event
        time.sleep(0.1)
    return None


def measure_failover(etcd: str, freeze: bool, fault: bool = True) -> dict:
    """One run; ``fault`` False: the same job fault-free (the reference its digest is compared with)."""
    with tempfile.TemporaryDirectory(prefix="undying-failover-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        (run_dir / "token").write_text(TOKEN)
        job = f"bench-{uuid.uuid4().hex[:8]}"
        inject = [] if freeze or not fault else ["--inject", f"node:node=0:step={FAULT_STEP}"]

        def start(node: int) -> subprocess.Popen:
            command = [sys.executable, "-m", "undying.cli", "run", *BASE, *PROCESS, *inject,
                       "--run-dir", str(run_dir), "--node-rank", str(node), "--etcd", etcd, "--job-name", job,
                       "--lease-ttl", "2", "--token-file", str(run_dir / "token"),
                       *(["--standby", "1"] if node >= 2 else []), TRAIN, "--steps", str(STEPS)]
            return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)

        started = time.time()
        nodes = {0: start(0)}
        while locate_controller(etcd, job) is None:
            time.sleep(0.1)
        nodes[1], nodes[2] = start(1), start(2)
        fault_time = None
        if freeze and fault:
            wait_event(run_dir, lambda e: e.kind == ev.HEARTBEAT and e.generation == 1 and (e.step or 0) >= FAULT_STEP)
            fault_time = time.time()
            os.killpg(nodes[0].pid, signal.SIGSTOP)
            wait_event(run_dir, lambda e: e.kind == ev.FIRST_STEP and (e.generation or 0) >= 2)
            os.killpg(nodes[0].pid, signal.SIGCONT)
        codes = {node: process.wait(timeout=600) for node, process in nodes.items()}
        record: dict = {"exit_code": max(abs(code) for node, code in codes.items() if node != 0 or freeze or not fault),
                        "wall_seconds": round(time.time() - started, 3)}
        result = run_dir / "result.json"
        record["param_sha256"] = json.loads(result.read_text()).get("param_sha256") if result.exists() else None
        if not fault:
            return record
        events = read_events(run_dir)
        if not freeze:
            injection = next(e for e in events if e.kind == ev.INJECTION)
            fault_time = injection.time
        assert fault_time is not None
        takeover = next((e for e in events if e.kind == ev.CONTROLLER_TAKEOVER), None)
        lost = next((e for e in events if e.kind == ev.AGENT_LOST and e.node == 0 and e.time >= fault_time), None)
        firsts = [e for e in events if e.kind == ev.FIRST_STEP and e.time > fault_time]
        decision = next((e for e in events if e.kind == ev.DECISION and lost is not None and e.time >= lost.time), None)
        if takeover is not None:
            record["takeover_seconds"] = round(takeover.time - fault_time, 3)
        if lost is not None:
            record["detect_seconds"] = round(lost.time - fault_time, 3)
        # The phases, each from the end of the one before: the lease's expiry and the election, the
        # dead node declared lost by the new leader, the decision, the recovery to every rank's first step.
        phases = [("takeover", takeover), ("declared_lost", lost), ("decision", decision)]
        previous = fault_time
        for name, event in phases:
            if event is None:
                break
            record[f"phase_{name}_seconds"] = round(event.time - previous, 3)
            previous = event.time
        if firsts:
            generation = min(e.generation for e in firsts)
            record["mttr_seconds"] = round(max(e.time for e in firsts if e.generation == generation) - fault_time, 3)
            if decision is not None:
                record["phase_recovery_seconds"] = round(fault_time + record["mttr_seconds"] - decision.time, 3)
            record["steps_lost"] = max(0, max(e.step for e in events if e.kind == ev.HEARTBEAT and e.generation == 1)
                                       - firsts[0].details["resumed_from"]) if freeze else \
                FAULT_STEP - firsts[0].details["resumed_from"]
        record["phases"] = recovery_phases(events, fault_time)
        record["restarted_processes"] = len([e for e in events if e.kind == ev.WORKER_READY and e.time > fault_time])
        record["job_restarts"] = len([e for e in events if e.kind == ev.RESTART_BEGIN])
        return record


def measure_job_restart() -> dict:
    from recovery import measure_undying

    return measure_undying(["--inject", f"node:node=1:step={FAULT_STEP}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--failover-only", action="store_true", help="only the two failover scenarios")
    args = parser.parse_args()
    scenarios = {
        "failover: SIGKILL leader node (controller + ranks 0-1), recover onto spare":
            lambda etcd: measure_failover(etcd, freeze=False),
        "failover: SIGSTOP leader node, recover onto spare, SIGCONT after":
            lambda etcd: measure_failover(etcd, freeze=True),
        "no failover: SIGKILL node 1, job-level restart": lambda etcd: measure_job_restart(),
        "torchrun + torch.save: SIGKILL worker, restart": lambda etcd: measure_torchrun(kill=True),
    }
    if args.failover_only:
        scenarios = {name: measure for name, measure in scenarios.items() if name.startswith("failover")}
    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as data:
        etcd_process, etcd = start_etcd(Path(data))
        results = {}
        try:
            reference = measure_failover(etcd, freeze=False, fault=False)["param_sha256"]
            print(f"fault-free reference: {reference}", flush=True)
            for name, measure in scenarios.items():
                runs = []
                for repeat in range(args.repeats):
                    run = measure(etcd)
                    if "param_sha256" in run:
                        run["bitwise_equal"] = reference is not None and run["param_sha256"] == reference
                    print(f"{name} #{repeat + 1}: {json.dumps(run)}", flush=True)
                    runs.append(run)
                summary = summarize(runs)
                for key in ("takeover_seconds", "job_restarts", *PHASES):
                    values = [run[key] for run in runs if key in run]
                    if values:
                        summary[f"all_{key}"] = values
                        summary[f"median_{key}"] = round(statistics.median(values), 3)
                summary["bitwise_equal_runs"] = sum(1 for run in runs if run.get("bitwise_equal"))
                summary["runs_detail"] = runs
                results[name] = summary
        finally:
            etcd_process.terminate()
            etcd_process.wait()
    print(json.dumps({name: {k: v for k, v in s.items() if k != "runs_detail"} for name, s in results.items()},
                     indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
