"""Recovery benchmark: undying's strategies against torchrun + periodic torch.save, in one run.

For each scenario the same GPT job (2 simulated nodes x 2 workers, 60 steps, a checkpoint
every 10 steps) runs with one fault injected at step 35, several times. From the event
logs it measures detection latency (fault -> detected), MTTR (fault -> every rank has
completed its first step after it), steps lost, and the steady-state step rate of the
fault-free runs. The torchrun baseline runs the same model with stock DDP under
``torchrun --max-restarts`` (2 agents on loopback) and ``torch.save`` every 10 steps.

    python bench/recovery.py --repeats 3 --out bench/results/recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from undying import events as ev  # noqa: E402
from undying.events import read_events  # noqa: E402

STEPS = 60
FAULT_STEP = 35
BASE = ["--nnodes", "2", "--nproc-per-node", "2", "--monitor-interval", "0.5", "--checkpoint-interval", "10",
        "--set", "heartbeat_interval=0.5", "--set", "heartbeat_timeout=3", "--quiet"]
PROCESS = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
           "--recover-strategy", "retry,recover-in-place,recover,dump"]
# A sharded job refuses dump and elastic training (docs/sharding.md).
SHARDED = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
           "--recover-strategy", "retry,recover-in-place,recover"]
SCENARIOS: dict[str, list[str]] = {
    "fault-free": [],
    "fault-free, warm standby off": ["--set", "warm_standby=false"],
    "job-restart, SIGKILL worker": ["--inject", f"kill:rank=1:step={FAULT_STEP}"],
    "job-restart, SIGKILL worker, warm standby off": ["--set", "warm_standby=false",
                                                      "--inject", f"kill:rank=1:step={FAULT_STEP}"],
    "job-restart, SIGSTOP worker (hang)": ["--inject", f"hang:rank=1:step={FAULT_STEP}"],
    "retry, exception in step": [*PROCESS, "--inject", f"raise:rank=1:step={FAULT_STEP}"],
    "recover-in-place, SIGKILL worker, cold": [*PROCESS, "--set", "warm_standby=false",
                                              "--inject", f"kill:rank=1:step={FAULT_STEP}"],
    "recover-in-place, SIGKILL worker, warm standby": [*PROCESS, "--inject", f"kill:rank=1:step={FAULT_STEP}"],
    "recover-in-place, SIGSTOP worker (hang)": [*PROCESS, "--inject", f"hang:rank=1:step={FAULT_STEP}"],
    "recover, SIGKILL node": [*PROCESS, "--inject", f"node:node=1:step={FAULT_STEP}"],
    "recover, SIGKILL node, onto a standby agent": [*PROCESS, "--standby", "1",
                                                    "--inject", f"node:node=1:step={FAULT_STEP}"],
    "dump, SIGKILL worker": ["--set", "process_recover=true", "--recover-strategy", "dump",
                             "--inject", f"kill:rank=1:step={FAULT_STEP}"],
    # The same model sharded with FSDP2 over a 2 x 2 HSDP mesh (after "--": the script's arguments).
    "HSDP 2x2, fault-free": ["--", "--mesh", "2x2"],
    "HSDP 2x2, recover-in-place, SIGKILL worker, warm standby": [*SHARDED, "--inject", f"kill:rank=1:step={FAULT_STEP}",
                                                                "--", "--mesh", "2x2"],
    "HSDP 2x2, recover, SIGKILL node, onto a standby agent": [*SHARDED, "--standby", "1",
                                                              "--inject", f"node:node=1:step={FAULT_STEP}",
                                                              "--", "--mesh", "2x2"],
}


def measure_undying(extra: list[str]) -> dict:
    """One run of the scenario ``extra``: undying's arguments, then after ``--`` the script's."""
    split = extra.index("--") if "--" in extra else len(extra)
    options, script_args = extra[:split], extra[split + 1:]
    with tempfile.TemporaryDirectory(prefix="undying-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        started = time.time()
        command = [sys.executable, "-m", "undying.cli", "run", *BASE, *options, "--run-dir", str(run_dir),
                   str(REPO / "examples" / "gpt" / "train.py"), "--steps", str(STEPS), *script_args]
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)
        wall = time.time() - started
        events = read_events(run_dir)
        record: dict = {"exit_code": result.returncode, "wall_seconds": round(wall, 3)}
        saves = {e.step: e.time for e in events if e.kind == ev.CHECKPOINT_SAVE}
        if 20 in saves and 60 in saves:
            record["steps_per_second"] = round(40 / (saves[60] - saves[20]), 2)
        saves = [e for e in events if e.kind == ev.CHECKPOINT_SAVE]
        # What the training loop waited for: the T1 snapshot copy plus any wait for the previous
        # checkpoint's background write; the write itself (``seconds``) runs beside training.
        record["checkpoint_stall_seconds"] = [round(e.details.get("stall", e.details["seconds"])
                                                    + e.details.get("waited", 0.0), 6) for e in saves]
        record["checkpoint_persist_seconds"] = [e.details["seconds"] for e in saves]
        injections = [e for e in events if e.kind == ev.INJECTION]
        if not injections:
            return record
        fault = injections[0]
        detected = next((e for e in events if e.kind == ev.FAULT_DETECTED and e.time >= fault.time), None)
        firsts = [e for e in events if e.kind == ev.FIRST_STEP and e.time > fault.time]
        if detected is not None:
            record["detect_seconds"] = round(detected.time - fault.time, 3)
        if firsts:
            generation = firsts[0].generation
            last_first = max(e.time for e in firsts if e.generation == generation)
            record["mttr_seconds"] = round(last_first - fault.time, 3)
            record["steps_lost"] = fault.step - firsts[0].details["resumed_from"]
        record["restarted_processes"] = len([e for e in events if e.kind == ev.WORKER_READY and e.time > fault.time])
        return record


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_torchrun(kill: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="torchrun-bench-") as tmp:
        log = Path(tmp) / "log.jsonl"
        env = dict(os.environ, BENCH_LOG=str(log), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
        port = free_port()
        started = time.time()
        agents = []
        for _node in range(2):
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                       "--max-restarts", "3", "--monitor-interval", "0.5", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
                       str(REPO / "bench" / "torchrun_train.py"), "--steps", str(STEPS),
                       "--checkpoint-dir", tmp]
            if kill:
                command += ["--kill-rank", "1", "--kill-step", str(FAULT_STEP)]
            agents.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           cwd=REPO))
            time.sleep(0.2)
        codes = [agent.wait(timeout=600) for agent in agents]
        wall = time.time() - started
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        result: dict = {"exit_code": max(codes), "wall_seconds": round(wall, 3)}
        steps = {r["step"]: r["time"] for r in records if r["event"] == "step" and r["rank"] == 0}
        if 20 in steps and 60 in steps and not kill:
            result["steps_per_second"] = round(40 / (steps[60] - steps[20]), 2)
        result["checkpoint_stall_seconds"] = [round(r["seconds"], 4) for r in records if r["event"] == "save"]
        kills = [r for r in records if r["event"] == "kill"]
        resumes = [r for r in records if r["event"] == "resumed"]
        if kills and resumes:
            fault_time = kills[0]["time"]
            resumed = resumes[0]["step"]
            first = [r["time"] for r in records if r["event"] == "step" and r["time"] > fault_time
                     and r["step"] == resumed + 1]
            if first:
                result["mttr_seconds"] = round(max(first) - fault_time, 3)
            result["steps_lost"] = kills[0]["step"] - resumed
        return result


def summarize(runs: list[dict]) -> dict:
    summary: dict = {"runs": len(runs), "failed_runs": sum(1 for run in runs if run["exit_code"] != 0)}
    for key in ("detect_seconds", "mttr_seconds", "steps_lost", "restarted_processes", "steps_per_second",
                "wall_seconds"):
        values = [run[key] for run in runs if key in run]
        if values:
            summary[f"median_{key}"] = round(statistics.median(values), 3)
            summary[f"all_{key}"] = values
    stalls = [stall for run in runs for stall in run.get("checkpoint_stall_seconds", [])]
    if stalls:
        summary["median_checkpoint_stall_seconds"] = round(statistics.median(stalls), 4)
    return summary


def _cell(summary: dict, key: str) -> str:
    if f"median_{key}" not in summary:
        return "-"
    values = ", ".join(str(value) for value in summary[f"all_{key}"])
    return f"{summary[f'median_{key}']} ({values})"


def markdown_table(results: dict[str, dict]) -> str:
    """The results as the table docs/benchmarks.md shows (medians; all runs in brackets)."""
    lines = ["| scenario | runs (failed) | detect s | MTTR s | steps lost | restarted processes | steps/s "
             "| checkpoint stall s (median) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, summary in results.items():
        cells = [_cell(summary, key) for key in ("detect_seconds", "mttr_seconds", "steps_lost",
                                                 "restarted_processes", "steps_per_second")]
        cells.append(str(summary.get("median_checkpoint_stall_seconds", "-")))
        lines.append(f"| {name} | {summary['runs']} ({summary['failed_runs']}) | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", help="print the markdown table of an existing results file and exit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="scenario names (substring match)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "recovery.json"))
    args = parser.parse_args()
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())["results"]))
        return
    results: dict[str, dict] = {}
    plan: list[tuple[str, object]] = [(name, extra) for name, extra in SCENARIOS.items()]
    plan += [("torchrun + torch.save, fault-free", False), ("torchrun + torch.save, SIGKILL worker", True)]
    for name, extra in plan:
        if args.only and not any(part in name for part in args.only):
            continue
        runs = []
        for repeat in range(args.repeats):
            run = measure_torchrun(extra) if isinstance(extra, bool) else measure_undying(extra)  # type: ignore[arg-type]
            runs.append(run)
            print(f"{name} [{repeat + 1}/{args.repeats}]: {json.dumps(run)}", flush=True)
        results[name] = summarize(runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()) if out.exists() and args.only else {"results": {}, "commands": []}
    merged = {**previous.get("results", {}), **results}
    commands = [*previous.get("commands", []), " ".join(["python", *sys.argv])]
    out.write_text(json.dumps({"commands": commands, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "results": merged}, indent=2))
    results = merged
    print(f"\n{'scenario':48} {'detect s':>9} {'MTTR s':>8} {'lost':>5} {'steps/s':>8}")
    for name, summary in results.items():
        print(f"{name:48} {summary.get('median_detect_seconds', '-'):>9} {summary.get('median_mttr_seconds', '-'):>8} "
              f"{summary.get('median_steps_lost', '-'):>5} {summary.get('median_steps_per_second', '-'):>8}")


if __name__ == "__main__":
    main()
