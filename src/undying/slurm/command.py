"""``undying slurm sbatch``: check a Slurm request, write its batch script (``batch.py``), submit it.

Runs in the user's shell process; ``cli.py`` only wires the subcommand here. Every bad request is
one ``undying: error:`` line and exit 2, before anything is written or submitted: a spec that does
not load, a node count that disagrees with the spec's ``nnodes``, a malformed time, or (with
``--submit``) more nodes than the partition holds. Without ``--submit`` nothing talks to Slurm.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from undying.config import load_job_spec
from undying.slurm.batch import BatchJob, render
from undying.slurm.errors import SlurmError

# The margin of the default --stop-warning over the spec's stop_timeout: the step in flight and
# the requeue itself also take time, and Slurm may send the signal up to a minute early or late.
STOP_WARNING_MARGIN_S = 60
TIME_FORMATS = "MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES or " \
               "DAYS-HOURS:MINUTES:SECONDS"
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
SLURM_TIMEOUT_S = 30.0


def add_sbatch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="JOB.yaml", help="the job spec (as for undying run --config)")
    parser.add_argument("--nodes", type=int, help="the job's nodes, spares not counted (default: the spec's nnodes)")
    parser.add_argument("--standby", type=int, default=0, metavar="K",
                        help="spare nodes in the allocation: a lost node's ranks move to one (default 0)")
    parser.add_argument("--nproc-per-node", help="workers per node (default: the spec's, or --gpus-per-node)")
    parser.add_argument("--job-name", help="Slurm's job name (default: the spec file's name)")
    parser.add_argument("--partition", help="sbatch --partition")
    parser.add_argument("--time", help="sbatch --time, the time limit: " + TIME_FORMATS)
    parser.add_argument("--account", help="sbatch --account")
    parser.add_argument("--qos", help="sbatch --qos")
    parser.add_argument("--gpus-per-node", type=int, help="sbatch --gpus-per-node; one worker per GPU by default")
    parser.add_argument("--cpus-per-task", type=int, help="sbatch --cpus-per-task: CPUs for each node's undying run "
                        "and its workers (passed to srun too)")
    parser.add_argument("--mem", help="sbatch --mem, memory per node (e.g. 200G)")
    parser.add_argument("--sbatch-option", action="append", default=[], metavar="OPTION",
                        help="another #SBATCH line, e.g. --sbatch-option=--exclusive (repeatable)")
    parser.add_argument("--stop-warning", type=int, metavar="SECONDS",
                        help="SIGTERM to every task this long before the time limit, to persist the newest step "
                             "(default: the spec's stop_timeout + 60)")
    parser.add_argument("--output", default="slurm-%j.out", help="sbatch --output (default slurm-%%j.out)")
    parser.add_argument("--run-dir", help="undying run's --run-dir (default in the step: "
                        "SLURM_SUBMIT_DIR/runs/slurm-JOBID)")
    parser.add_argument("--python", default=sys.executable,
                        help="the Python with undying installed on the nodes (default: this one)")
    parser.add_argument("--out", metavar="FILE", help="write the script here (default: stdout; with --submit "
                        "JOB_NAME.sbatch)")
    parser.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    parser.add_argument("script", help="the training script (path from the directory the job is submitted from)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def run_sbatch(args: argparse.Namespace) -> int:
    """Write, or submit, the batch script; ``SpecError`` or ``SlurmError`` (one line) when the request is bad."""
    job = batch_job(args)
    text = render(job)
    if args.out is None and not args.submit:
        sys.stdout.write(text)
        return 0
    path = Path(args.out or f"{job.name}.sbatch")
    if args.submit:
        check_capacity(args.partition, job.nodes, job.standby)
    path.write_text(text)
    path.chmod(0o755)
    if not args.submit:
        print(path)
        return 0
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True,
                          timeout=SLURM_TIMEOUT_S)
    if done.returncode != 0:
        reason = " ".join(done.stderr.split()) or f"exit code {done.returncode}"
        raise SlurmError(f"sbatch refused {path}: {reason}")
    job_id = done.stdout.strip().split(";")[0]
    spares = f" + {job.standby} spare{'s' * (job.standby != 1)}" if job.standby else ""
    print(f"undying: submitted batch job {job_id} ({job.nodes} node{'s' * (job.nodes != 1)}{spares}; script {path}, "
          f"output {args.output.replace('%j', job_id)})")
    return 0


def batch_job(args: argparse.Namespace) -> BatchJob:
    """The checked request as a ``BatchJob``; ``SpecError`` or ``SlurmError`` (one line) when it is bad."""
    spec = load_job_spec(args.spec, {})
    nodes = args.nodes
    if nodes is None:
        if "nnodes" not in spec.model_fields_set:
            raise SlurmError(f"--nodes: required (the job's nodes, spares not counted), or nnodes in {args.spec}")
        nodes = spec.nnodes
    elif nodes < 1:
        raise SlurmError(f"--nodes: allowed 1 or more (got {nodes})")
    elif "nnodes" in spec.model_fields_set and nodes != spec.nnodes:
        raise SlurmError(f"--nodes {nodes}: {args.spec} says nnodes: {spec.nnodes}; give one of them")
    if args.standby < 0:
        raise SlurmError(f"--standby: allowed 0 or more spare nodes (got {args.standby})")
    name = args.job_name or default_job_name(args.spec)
    if not _NAME.fullmatch(name):
        raise SlurmError(f"--job-name: allowed 1-64 letters, digits, '.', '_' or '-' (got {name!r})")
    limit = time_limit_seconds(args.time) if args.time is not None else None
    warning = args.stop_warning if args.stop_warning is not None else \
        math.ceil(spec.stop_timeout) + STOP_WARNING_MARGIN_S
    if warning < 1 or warning > 65535:
        raise SlurmError(f"--stop-warning: allowed 1..65535 seconds (got {warning})")
    if limit is not None and warning >= limit:
        raise SlurmError(f"--stop-warning {warning} s leaves no training time within --time {args.time} "
                         f"({limit} s): give a longer --time or a shorter --stop-warning")
    for option in args.sbatch_option:
        if not option.startswith("-") or any(char in option for char in "\n\r"):
            raise SlurmError(f"--sbatch-option: allowed one sbatch option such as --exclusive (got {option!r})")
    script = Path(args.script)
    if not script.is_file():
        raise SlurmError(f"script {args.script!r} not found (give its path from the directory you submit from)")
    nproc = args.nproc_per_node or (str(args.gpus_per_node) if args.gpus_per_node else None)
    run_args = ["--config", str(Path(args.spec).resolve()), *(["--nproc-per-node", nproc] if nproc else [])]
    options = [f"--{flag}={value}" for flag, value in (
        ("partition", args.partition), ("time", args.time), ("account", args.account), ("qos", args.qos),
        ("gpus-per-node", args.gpus_per_node), ("cpus-per-task", args.cpus_per_task), ("mem", args.mem))
        if value is not None]
    return BatchJob(name=name, nodes=nodes, standby=args.standby, undying=[args.python, "-m", "undying.cli"],
                    run_args=run_args, script=[str(script.resolve()), *args.script_args], stop_warning=warning,
                    stop_timeout=spec.stop_timeout, output=args.output, run_dir=args.run_dir,
                    cpus_per_task=args.cpus_per_task, options=[*options, *args.sbatch_option])


def default_job_name(spec_path: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", Path(spec_path).stem).strip("-.")
    return stem[:64] or "undying-job"


def time_limit_seconds(text: str) -> int:
    """sbatch --time's value in seconds; ``SlurmError`` naming the formats when it is none of them."""
    match = _TIME.fullmatch(text)
    if match is None:
        raise SlurmError(f"--time: allowed {TIME_FORMATS} (got {text!r})")
    days, first, second, third = (int(part) if part is not None else None for part in match.groups())
    if days is not None:  # DAYS-HOURS[:MINUTES[:SECONDS]]
        return days * 86400 + (first or 0) * 3600 + (second or 0) * 60 + (third or 0)
    if third is not None:  # HOURS:MINUTES:SECONDS
        return (first or 0) * 3600 + (second or 0) * 60 + third
    if second is not None:  # MINUTES:SECONDS
        return (first or 0) * 60 + second
    return (first or 0) * 60  # MINUTES


def check_capacity(partition: str | None, nodes: int, standby: int,
                   run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> None:
    """``SlurmError`` when the partition (the default one without ``--partition``) cannot hold
    ``nodes + standby`` nodes; nothing when Slurm cannot say (sbatch then decides)."""
    try:
        done = run(["scontrol", "show", "partition", "-o", *([partition] if partition else [])],
                   capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return
    if done.returncode != 0:
        if partition is not None:
            raise SlurmError(f"--partition {partition}: {' '.join(done.stderr.split()) or 'unknown partition'}")
        return
    records = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in done.stdout.splitlines() if line.strip()]
    record = next((r for r in records if partition is None and r.get("Default") == "YES"), None) \
        if partition is None else (records[0] if records else None)
    if record is None:
        return
    wanted = nodes + standby
    name = record.get("PartitionName", partition or "default")
    spares = f" + --standby {standby}" if standby else ""
    for field, limit in (("TotalNodes", record.get("TotalNodes")), ("MaxNodes", record.get("MaxNodes"))):
        if limit is not None and limit.isdigit() and wanted > int(limit):
            raise SlurmError(f"--nodes {nodes}{spares} = {wanted} nodes: partition {name} holds at most {limit} "
                             f"({field}); ask for fewer nodes or spares, or another --partition")
