"""Recovery benchmark: undying's strategies against torchrun + periodic torch.save, in one run.

For each scenario the same GPT job (2 simulated nodes x 2 workers, 60 steps, a checkpoint
every 10 steps) runs with one fault injected at step 35, several times. From the event
logs it measures detection latency (fault -> detected), MTTR (fault -> every rank has
completed its first step after it) cut into its phases (bench/phases.py: detect, decide, start
processes, wait for plan, group rebuild, state transfer, first step; a job restart: restart,
restore, first step), steps lost, and the steady-state step rate of the fault-free runs. The torchrun baseline runs the same model with stock DDP under
``torchrun --max-restarts`` (2 agents on loopback) and ``torch.save`` every 10 steps. The
TorchFT rows (the ``bench`` extra) run it as 2 replica groups x 2 ranks, one torchrun each,
around a lighthouse the benchmark starts (bench/torchft_train.py).

    python bench/recovery.py --repeats 3 --out bench/results/recovery.json
    python bench/recovery.py --table bench/results/recovery.json   # its tables again, phases included
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
from collections.abc import Callable
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))
from phases import recovery_phases  # noqa: E402

from undying import events as ev  # noqa: E402
from undying.events import read_events  # noqa: E402

STEPS = 60
FAULT_STEP = 35
BASE = ["--nnodes", "2", "--nproc-per-node", "2", "--monitor-interval", "0.5", "--checkpoint-interval", "10",
        "--set", "heartbeat_interval=0.5", "--set", "heartbeat_timeout=3", "--quiet"]
PROCESS = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
           "--recover-strategy", "retry,recover-in-place,recover,dump"]
IN_PLACE = ["--set", "process_recover=true", "--recover-strategy", "retry,recover-in-place"]
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
    # Where a replacement's state comes from: its node's T1 snapshot of the step (the default, a snapshot
    # every step), or the source replica (T1 only at checkpoint steps, so it lacks the step).
    "recover-in-place, SIGKILL worker, warm standby, peer transfer": [
        *PROCESS, "--set", "checkpoint.snapshot_interval=0", "--inject", f"kill:rank=1:step={FAULT_STEP}"],
    # Pure FSDP: no replica of a shard; recover-in-place from T1, or a rollback to T1's step (every 4 steps).
    "FSDP 1x4, job-restart, SIGKILL worker": ["--inject", f"kill:rank=1:step={FAULT_STEP}", "--", "--mesh", "1x4"],
    "FSDP 1x4, recover-in-place, SIGKILL worker, warm standby": [*IN_PLACE, "--inject", f"kill:rank=1:step={FAULT_STEP}",
                                                                "--", "--mesh", "1x4"],
    "FSDP 1x4, recover-in-place, SIGKILL worker, rollback to T1 step": [
        *IN_PLACE, "--set", "checkpoint.snapshot_interval=4", "--inject", f"kill:rank=1:step={FAULT_STEP}",
        "--", "--mesh", "1x4"],
}
WIDER = ["--n-embd", "256", "--n-layer", "4"]  # the same GPT wider, where the state's bytes count
SCENARIOS.update({f"wider GPT, {name}": [*SCENARIOS[name], "--", *WIDER] for name in (
    "job-restart, SIGKILL worker", "recover-in-place, SIGKILL worker, warm standby",
    "recover-in-place, SIGKILL worker, warm standby, peer transfer")})


def measure_undying(extra: list[str], tree: Path = REPO) -> dict:
    """One run of the scenario ``extra``: undying's arguments, then after ``--`` the script's. ``tree``:
    the checkout whose undying and example run (another one: its ``src`` first on PYTHONPATH)."""
    split = extra.index("--") if "--" in extra else len(extra)
    options, script_args = extra[:split], extra[split + 1:]
    env = dict(os.environ)
    if tree != REPO:
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="undying-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        started = time.time()
        command = [sys.executable, "-m", "undying.cli", "run", *BASE, *options, "--run-dir", str(run_dir),
                   str(tree / "examples" / "gpt" / "train.py"), "--steps", str(STEPS), *script_args]
        result = subprocess.run(command, capture_output=True, text=True, cwd=tree, timeout=600, env=env)
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
            record["phases"] = recovery_phases(events, fault.time)
        record["restarted_processes"] = len([e for e in events if e.kind == ev.WORKER_READY and e.time > fault.time])
        record["warm_replacements"] = sum(log.read_text(errors="replace").count("(replacement, warm standby)")
                                          for log in (run_dir / "logs").glob("rank*.log"))
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


TORCHFT_HEARTBEAT_TIMEOUT_MS = 3000  # as undying's heartbeat_timeout here: the time to give up on a silent group


def measure_torchft(kill: bool, min_replicas: int = 1) -> dict:
    """One run of bench/torchft_train.py: TorchFT, 2 replica groups x 2 ranks, each under its own torchrun."""
    lighthouse_bin = Path(sys.executable).with_name("torchft_lighthouse")
    if not lighthouse_bin.exists():
        raise SystemExit(f"torchft scenarios: {lighthouse_bin} not found; install the bench extra: pip install -e '.[bench]'")
    with tempfile.TemporaryDirectory(prefix="torchft-bench-") as tmp:
        log = Path(tmp) / "log.jsonl"
        lighthouse_port = free_port()
        lighthouse = subprocess.Popen(
            [str(lighthouse_bin), "--min_replicas", str(min_replicas), "--bind", f"[::]:{lighthouse_port}",
             "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
             "--heartbeat_timeout_ms", str(TORCHFT_HEARTBEAT_TIMEOUT_MS)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env = dict(os.environ, BENCH_LOG=str(log), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
                   TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{lighthouse_port}")
        started = time.time()
        groups = []
        for group in range(2):
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                       "--max-restarts", "3", "--monitor-interval", "0.5", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"torchft-bench-{group}",
                       str(REPO / "bench" / "torchft_train.py"), "--steps", str(STEPS),
                       "--min-replicas", str(min_replicas), "--start-barrier", str(Path(tmp) / "barrier")]
            if kill:
                command += ["--kill-group", "1", "--kill-rank", "1", "--kill-step", str(FAULT_STEP)]
            groups.append(subprocess.Popen(command, env=dict(env, BENCH_REPLICA_GROUP=str(group)), cwd=REPO,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        codes = wait_for_groups(groups)
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
        wall = time.time() - started
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return torchft_record(records, codes, wall)


def wait_for_groups(groups: list[subprocess.Popen], grace: float = 1.0) -> list[int | None]:
    """Exit codes of the replica groups' torchruns; None for one the bench stopped. Once a group has
    finished, the others get ``grace`` seconds: a group still outside the quorum by then would
    otherwise train the job again on its own."""
    deadline = time.time() + 600
    finished_at = None
    while time.time() < deadline and any(group.poll() is None for group in groups):
        if finished_at is None and any(group.poll() == 0 for group in groups):
            finished_at = time.time()
        if finished_at is not None and time.time() > finished_at + grace:
            break
        time.sleep(0.1)
    stopped = [group.poll() is None for group in groups]
    for group, stop in zip(groups, stopped, strict=True):
        if stop:
            group.terminate()  # torchrun passes it on to its workers
    codes = [group.wait(timeout=60) for group in groups]
    return [None if stop else code for code, stop in zip(codes, stopped, strict=True)]


def torchft_record(records: list[dict], codes: list[int | None], wall: float) -> dict:
    """The recovery figures of a TorchFT run from its JSON lines (see bench/torchft_train.py)."""
    finished = [code for code in codes if code is not None]
    result: dict = {"exit_code": max(finished, key=abs) if finished else 1, "wall_seconds": round(wall, 3),
                    "groups_stopped_by_bench": codes.count(None)}
    steps = [r for r in records if r["event"] == "step"]
    survivor = {r["step"]: r["time"] for r in steps if r["committed"] and r["group"] == 0 and r["rank"] == 0}
    if 20 in survivor and STEPS in survivor:
        result["steps_per_second"] = round((STEPS - 20) / (survivor[STEPS] - survivor[20]), 2)
    done = [r for r in records if r["event"] == "done"]
    kills = [r for r in records if r["event"] == "kill"]
    if not kills:
        result["final_params_agree"] = len(done) == 4 and len({r["param_sum"] for r in done}) == 1
        return result
    fault_time, fault_step, killed_group = kills[0]["time"], kills[0]["step"], kills[0]["group"]
    # A step the survivors committed just after the kill was in flight before it: "after" is by step number.
    after = [r for r in steps if r["time"] > fault_time and r["committed"] and r["step"] > fault_step]
    surviving: dict[int, dict] = {}
    for r in after:
        if r["group"] != killed_group:
            surviving.setdefault(r["rank"], r)
    if surviving:
        # TorchFT trains on with the groups left (or waits for the rejoin if it needs both groups).
        result["continue_seconds"] = round(max(r["time"] for r in surviving.values()) - fault_time, 3)
        result["steps_lost"] = fault_step - (min(r["step"] for r in surviving.values()) - 1)
    # Steps the survivors computed and then threw away (should_commit said no).
    result["discarded_steps"] = len([r for r in steps if r["time"] > fault_time and not r["committed"]
                                     and r["group"] != killed_group and r["rank"] == 0])
    # The restarted group is back once each of its ranks has committed a step together with the other group.
    rejoined: dict[int, dict] = {}
    for r in after:
        if r["group"] == killed_group and r["restart"] > kills[0]["restart"] and r["participants"] >= 2:
            rejoined.setdefault(r["rank"], r)
    result["rejoined"] = len(rejoined) == 2
    if len(rejoined) == 2 and len(surviving) == 2:
        result["mttr_seconds"] = round(max(r["time"] for r in [*rejoined.values(), *surviving.values()])
                                       - fault_time, 3)
        result["rejoined_at_step"] = min(r["step"] for r in rejoined.values())
    # Over the ranks that trained the job to its end: the survivors and a group that rejoined them
    # (a group back after the others finished has no one to heal from and starts the job over).
    in_job = [r for r in done if r["group"] != killed_group or (r["restart"] > kills[0]["restart"]
                                                                and r["rank"] in rejoined)]
    result["final_params_agree"] = len({r["param_sum"] for r in in_job}) == 1
    result["restarted_processes"] = len([r for r in records if r["event"] == "start" and r["time"] > fault_time])
    return result


def summarize(runs: list[dict]) -> dict:
    summary: dict = {"runs": len(runs), "failed_runs": sum(1 for run in runs if run["exit_code"] != 0)}
    for key in ("detect_seconds", "continue_seconds", "mttr_seconds", "steps_lost", "restarted_processes",
                "steps_per_second", "wall_seconds"):
        values = [run[key] for run in runs if key in run]
        if values:
            summary[f"median_{key}"] = round(statistics.median(values), 3)
            summary[f"all_{key}"] = values
    if any("rejoined" in run for run in runs):
        summary["rejoined_runs"] = sum(1 for run in runs if run.get("rejoined"))
    phases = [run["phases"] for run in runs if run.get("phases")]
    if phases:
        names = list(dict.fromkeys(name for run in phases for name in run))
        summary["median_phases"] = {name: round(statistics.median(run[name] for run in phases if name in run), 3)
                                    for name in names}
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
    """The results as the table docs/benchmarks.md shows (medians; all runs in brackets). With TorchFT
    rows it has two more columns: when the surviving group trained again, and in how many runs the
    killed group rejoined before the job's last step."""
    torchft = any("rejoined_runs" in summary for summary in results.values())
    header = ["scenario", "runs (failed)", "detect s", "MTTR s", "steps lost", "restarted processes", "steps/s",
              "checkpoint stall s (median)"]
    if torchft:
        header += ["survivors training again s", "rejoined (runs)"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, summary in results.items():
        cells = [_cell(summary, key) for key in ("detect_seconds", "mttr_seconds", "steps_lost",
                                                 "restarted_processes", "steps_per_second")]
        cells.append(str(summary.get("median_checkpoint_stall_seconds", "-")))
        if torchft:
            cells += [_cell(summary, "continue_seconds"), str(summary.get("rejoined_runs", "-"))]
        lines.append(f"| {name} | {summary['runs']} ({summary['failed_runs']}) | {' | '.join(cells)} |")
    return "\n".join(lines)


# The phases in the order a recovery goes through them (a job restart: restart, restore, first step).
PHASE_ORDER = ["detect", "decide", "start_processes", "wait_for_plan", "group_rebuild", "state_transfer", "restart",
               "restore", "first_step"]


def phase_table(results: dict[str, dict]) -> str:
    """Where each scenario's MTTR goes: the median of each phase over its runs (markdown)."""
    rows = {name: summary["median_phases"] for name, summary in results.items() if summary.get("median_phases")}
    if not rows:
        return "(no phases recorded)"
    seen = {phase for phases in rows.values() for phase in phases}
    names = [phase for phase in PHASE_ORDER if phase in seen] + sorted(seen - set(PHASE_ORDER))
    lines = ["| scenario | " + " | ".join(phase.replace("_", " ") for phase in names) + " |",
             "|" + " --- |" * (len(names) + 1)]
    for scenario, phases in rows.items():
        lines.append(f"| {scenario} | " + " | ".join(str(phases.get(phase, "-")) for phase in names) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", help="print the markdown table of an existing results file and exit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="scenario names (substring match)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "recovery.json"))
    args = parser.parse_args()
    if args.table:
        table = json.loads(Path(args.table).read_text())["results"]
        print(markdown_table(table) + "\n\n" + phase_table(table))
        return
    results: dict[str, dict] = {}
    plan: list[tuple[str, Callable[[], dict]]] = [(name, partial(measure_undying, extra))
                                                  for name, extra in SCENARIOS.items()]
    plan += [("torchrun + torch.save, fault-free", partial(measure_torchrun, False)),
             ("torchrun + torch.save, SIGKILL worker", partial(measure_torchrun, True)),
             ("torchft, fault-free", partial(measure_torchft, False)),
             ("torchft, SIGKILL worker", partial(measure_torchft, True)),
             ("torchft, SIGKILL worker, commits need both groups", partial(measure_torchft, True, min_replicas=2))]
    for name, measure in plan:
        if args.only and not any(part in name for part in args.only):
            continue
        runs = []
        for repeat in range(args.repeats):
            run = measure()
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
    print("\n" + phase_table(results))


if __name__ == "__main__":
    main()
