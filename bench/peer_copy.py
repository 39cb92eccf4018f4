"""Peer copies of T1 (``checkpoint.peer_copy``): what they cost per step, and what they save at a node loss.

The example GPT sharded with pure FSDP (``--mesh 1x4``: no replica of any shard) on 2 simulated
nodes x 2 workers under ``undying run``, in two sizes (n_layer x n_embd: 2x48 and 4x256), every
configuration of a size once, then all again, ``--repeats`` times, so that a change in the
machine's load falls on all of them alike. Two parts:

1. Steady state, fault-free, a T1 snapshot every step, no T2 checkpoint in the run, no warm
   standbys (their imports would share the 2 cores with the first minute of training):
   ``peer_copy: auto`` against ``off``. Step time: rank 0's, from the controller's heartbeat
   events (bench/overhead.py's ``rate``) over the steps from ``WARMUP_STEPS`` on; the overhead of
   the copies is auto's median step time against off's. From the ``peer_copy`` events (one per
   rank each time the job's anchor moves) after the warmup: bytes per copy (one rank's T1
   snapshot), seconds per copy (the transfer, beside training), and how many steps apart
   consecutive anchors are (a node loss goes back to the anchor at most).
2. Node loss: node 1 (ranks 2 and 3) SIGKILLed with its memory at ``fault_step``, a spare node
   (``--standby 1``, warm standbys on) takes its place. ``auto`` with
   ``retry,recover-in-place,recover``: the lost ranks' shards come from the copies node 0 keeps;
   ``off``: ``recover`` is refused for pure FSDP, so ``retry,recover-in-place`` and a job restart
   from the newest T2 checkpoint (every ``CHECKPOINT_INTERVAL`` steps, so one exists before the
   fault). From the events: detection (injection -> fault_detected), MTTR (injection -> every
   rank's first committed step after the recovery, ``first_step``), steps lost (committed steps
   computed again: the fault's step, the committed step when node 1 died, minus the step
   resumed from), where the lost ranks' state came from (``shard_received`` /
   ``checkpoint_load``), and whether the final ``param_sha256`` (run_dir/result.json) equals the
   fault-free runs' of part 1 (same size, same steps: bitwise expected for both configurations).

    python bench/peer_copy.py --repeats 2 --out bench/results/peer_copy.json
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from overhead import load_average, rate
from recovery import REPO, SHARDED

from undying import events as ev
from undying.events import read_events

GPT = REPO / "examples" / "gpt" / "train.py"
WARMUP_STEPS = 10
CHECKPOINT_INTERVAL = 20  # node-loss runs: T2 at 20, 40, 60: the restart without copies reads one
NO_T2 = 100_000  # steady state: longer than any run here
# n_layer, n_embd, n_head, steps, fault_step. With 4 ranks on 2 cores a step takes 0.08-0.15 s (2x48)
# and 0.3-0.5 s (4x256), quiet to busy: 8-20 s of steady state; the fault 15 steps after a T2 step.
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "2x48": (2, 48, 2, 100, 75),
    "4x256": (4, 256, 4, 50, 35),
}
BASE = ["--nnodes", "2", "--nproc-per-node", "2", "--monitor-interval", "0.5",
        "--set", "heartbeat_interval=0.5", "--set", "heartbeat_timeout=3", "--quiet"]
# The YAML of ``--set`` reads a bare off as False, which peer_copy does not accept: quoted.
PEER_COPY = {"auto": ["--set", "checkpoint.peer_copy=auto"], "off": ["--set", "checkpoint.peer_copy=off"]}
STEADY = {"peer_copy auto": PEER_COPY["auto"], "peer_copy off": PEER_COPY["off"]}
NODE_LOSS = {
    "auto, recover from peer copies": [*PEER_COPY["auto"], *SHARDED],
    "off, job restart from T2": [*PEER_COPY["off"], "--set", "process_recover=true", "--set", "pod_rescheduling=on",
                                 "--recover-strategy", "retry,recover-in-place"],
}
SPARE_NODE = 2  # the spare agent's standby log before it takes node 1's place
RUN_TIMEOUT_S = 400


def script_args(size: str) -> list[str]:
    n_layer, n_embd, n_head, steps, _ = SIZES[size]
    return ["--steps", str(steps), "--n-layer", str(n_layer), "--n-embd", str(n_embd), "--n-head", str(n_head),
            "--mesh", "1x4", "--log-every", str(NO_T2)]


def standbys_ready(run_dir: Path, nodes: int, per_node: int = 1) -> bool:
    """Has every node's (and the spare's) warm standby finished its imports?"""
    for node in range(nodes):
        log = run_dir / "logs" / f"standby{node}.log"
        if not log.exists() or log.read_text(errors="replace").count("ready") < per_node:
            return False
    return True


def run_job(options: list[str], size: str, work: Path, watch_standbys: bool) -> tuple[dict, list, dict, float | None]:
    """One ``undying run``: its record (exit code, wall time, loads), events, result.json and when its
    standbys were all up (when ``watch_standbys``)."""
    run_dir = work / "run"
    command = [sys.executable, "-m", "undying.cli", "run", *BASE, *options, "--run-dir", str(run_dir), str(GPT),
               *script_args(size)]
    load_before, started, ready_at = load_average(), time.time(), None
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as job:
        while job.poll() is None and time.time() - started < RUN_TIMEOUT_S:
            if watch_standbys and ready_at is None and standbys_ready(run_dir, SPARE_NODE + 1):
                ready_at = time.time()
            time.sleep(0.1)
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)  # the controller stops its agents and workers
        output = job.communicate(timeout=60)[0] if job.stdout else ""
    record: dict = {"exit_code": job.returncode, "wall_seconds": round(time.time() - started, 1),
                    "load_before": load_before, "load_after": load_average()}
    if job.returncode != 0:
        record["output_tail"] = output[-2000:]
    events = read_events(run_dir) if (run_dir / ev.EVENTS_FILE).exists() else []
    result_file = run_dir / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    record["param_sha256"] = result.get("param_sha256")
    record["final_step"] = result.get("final_step")
    return record, events, result, ready_at


def measure_steady(size: str, config: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="undying-peer-copy-") as tmp:
        options = [*STEADY[config], "--checkpoint-interval", str(NO_T2), "--set", "checkpoint.snapshot_interval=1",
                   "--set", "warm_standby=false"]
        record, events, _, _ = run_job(options, size, Path(tmp), watch_standbys=False)
    beats = {e.step: e.time for e in events if e.kind == ev.HEARTBEAT and e.rank == 0 and e.step is not None}
    steps_per_second = rate(beats, WARMUP_STEPS)
    record["step_ms"] = None if steps_per_second is None else round(1000 / steps_per_second, 2)
    copies = [e for e in events if e.kind == ev.PEER_COPY and e.step is not None and e.step >= WARMUP_STEPS]
    record["copy_failures"] = len([e for e in events if e.kind == ev.PEER_COPY_FAILED])
    if copies:
        record["copies"] = len(copies)
        record["copy_bytes_per_rank"] = {rank: int(statistics.median(e.details["bytes"] for e in copies
                                                                     if e.rank == rank))
                                         for rank in sorted({e.rank for e in copies})}
        seconds = [e.details["seconds"] for e in copies]
        record["copy_seconds_median"] = round(statistics.median(seconds), 4)
        record["copy_seconds_max"] = round(max(seconds), 4)
        anchors = sorted({e.step for e in copies if e.rank == 0})
        gaps = [later - earlier for earlier, later in zip(anchors, anchors[1:], strict=False)]
        record["anchors"] = len(anchors)
        if gaps:
            record["anchor_gap_steps_median"] = statistics.median(gaps)
            record["anchor_gap_steps_max"] = max(gaps)
    return record


def measure_node_loss(size: str, config: str) -> dict:
    fault_step = SIZES[size][4]
    with tempfile.TemporaryDirectory(prefix="undying-peer-copy-") as tmp:
        options = [*NODE_LOSS[config], "--standby", "1", "--checkpoint-interval", str(CHECKPOINT_INTERVAL),
                   "--set", "checkpoint.snapshot_interval=1", "--inject", f"node:node=1:step={fault_step}"]
        record, events, _, ready_at = run_job(options, size, Path(tmp), watch_standbys=True)
    injections = [e for e in events if e.kind == ev.INJECTION]
    if not injections:
        return record
    fault = injections[0]
    record["standbys_ready_before_fault"] = ready_at is not None and ready_at < fault.time
    after = [e for e in events if e.time >= fault.time]
    detected = next((e for e in after if e.kind == ev.FAULT_DETECTED), None)
    if detected is not None:
        record["detect_seconds"] = round(detected.time - fault.time, 3)
    decision = next((e for e in after if e.kind == ev.DECISION), None)
    lost = set(decision.details.get("lost_ranks", [])) if decision is not None else set()
    if decision is not None:
        record["strategy"] = decision.details["strategy"]
    firsts = [e for e in after if e.kind == ev.FIRST_STEP]
    if firsts:
        generation = firsts[0].generation
        record["mttr_seconds"] = round(max(e.time for e in firsts if e.generation == generation) - fault.time, 3)
        record["resumed_from"] = firsts[0].details["resumed_from"]
        record["steps_lost"] = fault.step - firsts[0].details["resumed_from"]
    # Where the lost ranks' state came from: copies held by the other node, or T2 storage.
    sources = {e.rank: e.details["source"] for e in after
               if e.kind in (ev.SHARD_RECEIVED, ev.CHECKPOINT_LOAD) and e.rank in lost}
    record["lost_ranks_state_from"] = sorted(set(sources.values()))
    record["t1_rollback_sources"] = sorted({e.details["source"] for e in after if e.kind == ev.T1_ROLLBACK})
    totals = [e.details["total"] for e in after if e.kind == ev.RECOVERED]
    if totals:
        record["recovered_total_seconds_max"] = round(max(totals), 3)
    record["restarted_job"] = any(e.kind == ev.RESTART_BEGIN for e in after)
    record["checkpoint_loads"] = len([e for e in after if e.kind == ev.CHECKPOINT_LOAD])
    # A copy under way to (or from) the lost node fails with it: only failures before the fault are suspect.
    failures = [e for e in events if e.kind == ev.PEER_COPY_FAILED]
    record["copy_failures_before_fault"] = len([e for e in failures if e.time < fault.time])
    record["copy_failures_after_fault"] = [e.details.get("reason", "") for e in failures if e.time >= fault.time]
    anchors = sorted({e.step for e in events if e.kind == ev.PEER_COPY and e.rank == 0 and e.time < fault.time})
    if anchors:
        record["last_anchor_before_fault"] = anchors[-1]
    return record


def median_of(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if run.get(key) is not None]
    if not values:
        return None
    median = round(statistics.median(values), 4)
    return int(median) if median == int(median) else median


def paired_overheads(runs: list[dict], size: str) -> list[float]:
    """auto's step time against off's of the same repeat (the runs next to each other), in percent."""
    overheads = []
    for repeat in sorted({run["repeat"] for run in runs}):
        pair = {run["config"]: run.get("step_ms") for run in runs
                if (run["size"], run["part"], run["repeat"]) == (size, "steady", repeat)}
        auto, off = pair.get("peer_copy auto"), pair.get("peer_copy off")
        if auto and off:
            overheads.append(round(100 * (auto / off - 1), 1))
    return overheads


def summarize(runs: list[dict]) -> dict:
    summary: dict = {"steady": {}, "node_loss": {}}
    for size in dict.fromkeys(run["size"] for run in runs):
        references = {run["param_sha256"] for run in runs if run["size"] == size and run["part"] == "steady"
                      and run["exit_code"] == 0}
        steady: dict = {}
        for config in STEADY:
            chosen = [run for run in runs if (run["size"], run["part"], run["config"]) == (size, "steady", config)]
            if not chosen:
                continue
            row: dict = {"runs": len(chosen), "failed": sum(run["exit_code"] != 0 for run in chosen),
                         "step_ms_median": median_of(chosen, "step_ms"),
                         "step_ms_all": [run.get("step_ms") for run in chosen],
                         "load_all": [run["load_before"] for run in chosen],
                         "copy_failures": sum(run.get("copy_failures", 0) for run in chosen)}
            for key in ("copy_seconds_median", "anchor_gap_steps_median"):
                if median_of(chosen, key) is not None:
                    row[key] = median_of(chosen, key)
            gaps = [run["anchor_gap_steps_max"] for run in chosen if "anchor_gap_steps_max" in run]
            if gaps:
                row["anchor_gap_steps_max"] = max(gaps)
            sizes = [bytes_ for run in chosen for bytes_ in run.get("copy_bytes_per_rank", {}).values()]
            if sizes:
                row["copy_bytes_per_rank"] = int(statistics.median(sizes))
                row["copy_bytes_per_step_job"] = int(statistics.median(sizes)) * 4
            steady[config] = row
        auto, off = steady.get("peer_copy auto"), steady.get("peer_copy off")
        if auto and off and auto["step_ms_median"] and off["step_ms_median"]:
            auto["overhead_percent"] = round(100 * (auto["step_ms_median"] / off["step_ms_median"] - 1), 2)
            auto["paired_overhead_percent_all"] = paired_overheads(runs, size)
        steady_shas = {run["param_sha256"] for run in runs if run["size"] == size and run["part"] == "steady"}
        summary["steady"][size] = {"configs": steady, "fault_free_param_sha256": sorted(references),
                                   "auto_and_off_bitwise_equal": len(steady_shas) == 1}
        node_loss: dict = {}
        for config in NODE_LOSS:
            chosen = [run for run in runs if (run["size"], run["part"], run["config"]) == (size, "node_loss", config)]
            if not chosen:
                continue
            row = {"runs": len(chosen), "failed": sum(run["exit_code"] != 0 for run in chosen),
                   "strategy": sorted({run.get("strategy", "-") for run in chosen}),
                   "lost_ranks_state_from": sorted({source for run in chosen
                                                    for source in run.get("lost_ranks_state_from", [])}),
                   "bitwise_fault_free": [run["param_sha256"] in references if references else None
                                          for run in chosen],
                   "standbys_ready_before_fault": [run.get("standbys_ready_before_fault") for run in chosen],
                   "copy_failures_before_fault": sum(run.get("copy_failures_before_fault", 0) for run in chosen),
                   "load_all": [run["load_before"] for run in chosen]}
            for key in ("detect_seconds", "mttr_seconds", "steps_lost", "recovered_total_seconds_max"):
                row[key + "_median"] = median_of(chosen, key)
                row[key + "_all"] = [run.get(key) for run in chosen]
            node_loss[config] = row
        summary["node_loss"][size] = node_loss
    return summary


def markdown_tables(summary: dict) -> str:
    lines = ["| size | peer_copy | runs (failed) | step ms (median; all) | overhead (of medians; per repeat) | bytes per copy (one rank) "
             "| copy s (median) | anchors apart, steps (median / max) | copy failures | load |",
             "|" + " --- |" * 10]
    for size, part in summary["steady"].items():
        for config, row in part["configs"].items():
            overhead = "-"
            if "overhead_percent" in row:
                paired = ", ".join(f"{value:+.1f}" for value in row["paired_overhead_percent_all"])
                overhead = f"{row['overhead_percent']:+.1f} % ({paired})"
            gaps = (f"{row['anchor_gap_steps_median']} / {row['anchor_gap_steps_max']}"
                    if "anchor_gap_steps_median" in row else "-")
            lines.append(f"| {size} | {config.split()[-1]} | {row['runs']} ({row['failed']}) | {row['step_ms_median']} "
                         f"({', '.join(map(str, row['step_ms_all']))}) | {overhead} "
                         f"| {row.get('copy_bytes_per_rank', '-')} | {row.get('copy_seconds_median', '-')} | {gaps} "
                         f"| {row['copy_failures']} | {', '.join(map(str, row['load_all']))} |")
    lines += ["", "| size | configuration | runs (failed) | strategy | detect s | MTTR s (median; all) | steps lost "
              "| lost ranks' state from | bitwise = fault-free | standbys up at fault | load |",
              "|" + " --- |" * 11]
    for size, part in summary["node_loss"].items():
        for config, row in part.items():
            lines.append(
                f"| {size} | {config} | {row['runs']} ({row['failed']}) | {', '.join(row['strategy'])} "
                f"| {row['detect_seconds_median']} | {row['mttr_seconds_median']} "
                f"({', '.join(map(str, row['mttr_seconds_all']))}) | {row['steps_lost_median']} "
                f"| {', '.join(row['lost_ranks_state_from']) or '-'} | {', '.join(map(str, row['bitwise_fault_free']))} "
                f"| {', '.join(map(str, row['standbys_ready_before_fault']))} | {', '.join(map(str, row['load_all']))} |")
    return "\n".join(lines)


def write_results(path: Path, sizes: list[str], runs: list[dict]) -> None:
    payload = {"command": "python bench/peer_copy.py " + " ".join(sys.argv[1:]),
               "time": time.strftime("%Y-%m-%d %H:%M:%S"), "warmup_steps": WARMUP_STEPS,
               "checkpoint_interval_node_loss": CHECKPOINT_INTERVAL,
               "sizes": {size: dict(zip(("n_layer", "n_embd", "n_head", "steps", "fault_step"), SIZES[size],
                                        strict=True)) for size in sizes},
               "summary": summarize(runs), "runs": runs}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of " + ", ".join(SIZES))
    parser.add_argument("--parts", default="steady,node_loss", help="comma-separated subset of steady, node_loss")
    parser.add_argument("--out", type=Path, default=None, help="write the runs and the summary here (JSON)")
    parser.add_argument("--table", type=Path, help="print the tables of an existing results file and exit")
    args = parser.parse_args()
    if args.table:
        print(markdown_tables(summarize(json.loads(args.table.read_text())["runs"])))
        return
    sizes = [size for size in args.sizes.split(",") if size]
    parts = [part for part in args.parts.split(",") if part]
    for name, given, allowed in (("--sizes", sizes, SIZES), ("--parts", parts, ("steady", "node_loss"))):
        unknown = [item for item in given if item not in allowed]
        if unknown:
            raise SystemExit(f"{name}: unknown value {unknown[0]!r}; allowed: {', '.join(allowed)}")
    plan = [(part, config) for part in parts for config in (STEADY if part == "steady" else NODE_LOSS)]
    runs: list[dict] = []
    for repeat in range(args.repeats):
        for size in sizes:
            for part, config in plan:
                measure = measure_steady if part == "steady" else measure_node_loss
                record = {"size": size, "part": part, "config": config, "repeat": repeat, **measure(size, config)}
                runs.append(record)
                print(json.dumps(record), flush=True)
                if args.out:  # after every run: an interrupted benchmark keeps what it measured
                    write_results(args.out, sizes, runs)
    print(markdown_tables(summarize(runs)))


if __name__ == "__main__":
    main()
