"""The batch script of a job on N nodes + K spares: one ``undying run`` per node, requeued when stopped.

Runs in the user's shell (``undying slurm sbatch``); the text it returns is what Slurm runs on the
allocation's first node. The script

- asks for N + K nodes, one task each, with ``--no-kill`` (a node that dies does not end the
  allocation: its ranks move to a spare) and ``srun --kill-on-bad-exit=0 --no-kill`` (nor does a
  task that ends early end the step);
- starts ``undying run --nnodes N --standby K`` on every node through ``srun``; inside the step each
  one takes its node rank, the controller's address, the run directory and the token from Slurm's
  environment (``launch.py``); the last K nodes are the spares;
- sends every task SIGTERM ``stop_warning`` seconds before the time limit (``--signal=TERM@S``, not
  ``B:``: the tasks, not this shell); every node then asks for the graceful stop, the newest
  committed step is persisted and ``undying run`` exits 75. A SIGTERM to the script's own shell
  (``--signal=B:TERM@S``, ``scancel --batch --signal=TERM``) does the same through ``undying stop``;
- requeues the job (``scontrol requeue``) on exit 75 and on nothing else: the requeued job keeps
  its id, so its ``undying run`` finds the same run directory and resumes from the persisted step;
  a crash loop (1), a refused spec or an allocation that cannot hold the job (2) or a cancelled job
  (130) ends there.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

EXIT_STOPPED = 75  # undying run: stopped with the newest step persisted (controller/state.py)


@dataclass(frozen=True)
class BatchJob:
    """What the batch script runs, and the ``#SBATCH`` options it asks Slurm for."""

    name: str
    nodes: int  # the job's nodes
    standby: int  # spare nodes
    undying: list[str]  # how to run undying on the nodes, e.g. [python, -m, undying.cli]
    run_args: list[str]  # ``undying run``'s options (--config, ...), besides --nnodes and --standby
    script: list[str]  # the training script and its arguments
    stop_warning: int  # seconds before the time limit that every task gets SIGTERM
    stop_timeout: float  # the spec's: how long the graceful stop may take
    output: str = "slurm-%j.out"
    run_dir: str | None = None  # None: undying run's default in a step, SLURM_SUBMIT_DIR/runs/slurm-JOBID
    cpus_per_task: int | None = None
    # Further #SBATCH options, each "--name=value" or "--flag" (partition, time, account, GPUs, ...).
    options: list[str] = field(default_factory=list)


def render(job: BatchJob) -> str:
    """The batch script's text."""
    total = job.nodes + job.standby
    spares = f" + {job.standby} spare{'s' * (job.standby != 1)}" if job.standby else ""
    run_dir = shlex.quote(job.run_dir) if job.run_dir else '"${SLURM_SUBMIT_DIR}/runs/slurm-${SLURM_JOB_ID}"'
    run = ["run", "--nnodes", str(job.nodes), "--standby", str(job.standby),
           *(["--run-dir", job.run_dir] if job.run_dir else []), *job.run_args, *job.script]
    srun = ["srun", '--nodes="${SLURM_JOB_NUM_NODES}"', "--ntasks-per-node=1", "--no-kill", "--kill-on-bad-exit=0",
            *([f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else [])]
    lines = [
        "#!/bin/bash",
        f"# {job.name}: {job.nodes} node{'s' * (job.nodes != 1)}{spares}, one `undying run` per node "
        "(written by `undying slurm sbatch`; docs/slurm.md).",
        f"#SBATCH --job-name={job.name}",
        f"#SBATCH --nodes={total}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --no-kill",
        "#SBATCH --requeue",
        f"#SBATCH --signal=TERM@{job.stop_warning}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={job.output}",
        *(f"#SBATCH {option}" for option in job.options),
        "#",
        "# --no-kill: a node that dies does not end the allocation; its ranks move to a spare.",
        f"# --signal=TERM@{job.stop_warning}: every task gets SIGTERM {job.stop_warning} s before the time limit; "
        "the job persists",
        f"#   its newest committed step (within stop_timeout, {job.stop_timeout:g} s) and exits 75.",
        "# --requeue: exit 75 requeues the job below; it keeps its id and resumes in the same run directory.",
        "",
        "set -u",
        f"UNDYING=({' '.join(shlex.quote(part) for part in job.undying)})",
        f"RUN_DIR={run_dir}",
        'echo "undying: job ${SLURM_JOB_ID} (requeued ${SLURM_RESTART_COUNT:-0} times) on ${SLURM_JOB_NODELIST}, '
        'run directory ${RUN_DIR}"',
        "",
        f"# One `undying run` per node{_spare_note(job.nodes, job.standby)}.",
        _continued([*srun, '"${UNDYING[@]}"', *(shlex.quote(part) for part in run)])
        + " &",
        "SRUN=$!",
        "",
        "# SIGTERM to this shell (sbatch --signal=B:TERM@..., scancel --batch --signal=TERM): the same graceful stop.",
        "STOPPING=0",
        """trap 'STOPPING=1; "${UNDYING[@]}" stop "$RUN_DIR" || true' TERM INT""",
        "while :; do",
        "    STOPPING=0",
        '    wait "$SRUN"; CODE=$?',
        '    [ "$STOPPING" = 1 ] || break',
        "done",
        "",
        "# 0 succeeded, 1 failed (a crash loop, restarts exhausted), 2 refused (a bad spec, an allocation that",
        f"# cannot hold the job), 130 cancelled: the job ends here. {EXIT_STOPPED}: stopped with its newest step "
        "persisted",
        "# (time limit, preemption, scancel --signal=TERM): requeued, it resumes from that step.",
        f'if [ "$CODE" -eq {EXIT_STOPPED} ]; then',
        '    echo "undying: stopped with the newest step persisted: requeueing job ${SLURM_JOB_ID}"',
        '    scontrol requeue "${SLURM_JOB_ID}"',
        "fi",
        'exit "$CODE"',
    ]
    return "\n".join(lines) + "\n"


def _spare_note(nodes: int, standby: int) -> str:
    if standby == 0:
        return ""
    if standby == 1:
        return f"; node {nodes} of the step (its last) is the spare"
    return f"; nodes {nodes}-{nodes + standby - 1} of the step (its last {standby}) are spares"


def _continued(words: list[str], width: int = 100) -> str:
    """``words`` as one shell command, broken with backslashes before ``width`` columns, never between
    an option and its value."""
    groups: list[str] = []
    for word in words:
        if groups and groups[-1].startswith("-") and " " not in groups[-1] and "=" not in groups[-1] \
                and not word.startswith("-"):
            groups[-1] += " " + word
        else:
            groups.append(word)
    lines: list[str] = []
    current = ""
    for word in groups:
        if current and len(current) + 1 + len(word) > width - 2:
            lines.append(current + " \\")
            current = "    " + word
        else:
            current = f"{current} {word}" if current else word
    lines.append(current)
    return "\n".join(lines)
