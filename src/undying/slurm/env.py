"""What a Slurm step tells ``undying run`` about its place in the job, read from the environment.

Runs in ``undying run`` (the CLI process) on every node of a step that ``srun`` started with one
task per node. Outside a step (no ``SLURM_STEP_ID``: a login node, the batch script itself, a
machine without Slurm), and in one with ``UNDYING_SLURM=0`` (a shell that ``srun --pty`` started,
where ``undying run`` is to simulate its nodes as anywhere else), ``SlurmStep.from_environ``
returns None and nothing here is used.

- the step's nodes: ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``), expanded as
  ``scontrol show hostnames`` does (``hostlist.py``); this node's index in it: ``SLURM_NODEID``;
- the controller's address: the step's first node, at the address Slurm reaches it by (its
  ``NodeAddr``, from ``scontrol show node -o NAME``; the name itself when that says nothing), on
  ``controller_port(SLURM_JOB_ID)``, a port every node derives alike;
- the job's own directory: ``SLURM_SUBMIT_DIR/runs/slurm-SLURM_JOB_ID``, on the storage the job was
  submitted from, which a cluster shares between its nodes; a requeued job keeps its id, so it
  finds its checkpoints there again.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from undying.slurm.errors import SlurmError
from undying.slurm.hostlist import HostlistError, expand

ENV_JOB_ID = "SLURM_JOB_ID"
ENV_STEP_ID = "SLURM_STEP_ID"  # set by srun in every task of a step; absent in the batch script
ENV_NODE_ID = "SLURM_NODEID"  # this node's index among the step's nodes
ENV_STEP_NODES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")  # the first one set is read
ENV_STEP_NUM_NODES = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES")
ENV_STEP_NUM_TASKS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
ENV_SUBMIT_DIR = "SLURM_SUBMIT_DIR"
ENV_RESTART_COUNT = "SLURM_RESTART_COUNT"  # how often the job was requeued (absent: never)
ENV_USE_SLURM = "UNDYING_SLURM"  # "0": ignore the step

# The controller's port: CONTROLLER_PORT_BASE + job id mod CONTROLLER_PORT_SPAN (20000-29999),
# below Linux's ephemeral range (32768-60999), so no outgoing connection of the node holds it;
# two jobs clash on one node only if their ids are a multiple of 10000 apart.
CONTROLLER_PORT_BASE = 20000
CONTROLLER_PORT_SPAN = 10000
RUNS_DIR = "runs"
SCONTROL_TIMEOUT_S = 10.0


class SlurmEnvError(SlurmError):
    """The step's environment cannot place this node; the message names the variable or flag."""


@dataclass(frozen=True)
class SlurmStep:
    """This task's step, as its environment describes it."""

    job_id: str
    node_id: int  # this node's index among ``nodes``
    nodes: tuple[str, ...]  # the step's nodes, in node-id order
    tasks: int  # the step's tasks (one per node for undying run)
    submit_dir: Path  # where the job was submitted from
    restart_count: int = 0  # requeues so far

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> SlurmStep | None:
        """The step this process runs in, or None outside one; ``SlurmEnvError`` when its variables
        contradict each other."""
        if not environ.get(ENV_JOB_ID) or ENV_STEP_ID not in environ or environ.get(ENV_USE_SLURM) == "0":
            return None
        job_id = environ[ENV_JOB_ID]
        if not job_id.isdigit():
            raise SlurmEnvError(f"{ENV_JOB_ID}: expected a number (got {job_id!r})")
        nodelist_var = next((name for name in ENV_STEP_NODES if environ.get(name)), None)
        if nodelist_var is None:
            raise SlurmEnvError(f"{' and '.join(ENV_STEP_NODES)} are unset: cannot tell the step's nodes")
        try:
            nodes = tuple(expand(environ[nodelist_var]))
        except HostlistError as error:
            raise SlurmEnvError(f"{nodelist_var}: {error}") from None
        node_id = _integer(environ, (ENV_NODE_ID,))
        count = _integer(environ, ENV_STEP_NUM_NODES, default=len(nodes))
        if count != len(nodes):
            raise SlurmEnvError(f"{nodelist_var} names {len(nodes)} nodes, {ENV_STEP_NUM_NODES[0]} says {count}")
        if node_id is None or not 0 <= node_id < len(nodes):
            raise SlurmEnvError(f"{ENV_NODE_ID}: expected 0..{len(nodes) - 1} (got {environ.get(ENV_NODE_ID)!r})")
        tasks = _integer(environ, ENV_STEP_NUM_TASKS, default=len(nodes))
        assert tasks is not None
        submit_dir = Path(environ.get(ENV_SUBMIT_DIR) or ".")
        restarts = _integer(environ, (ENV_RESTART_COUNT,), default=0) or 0
        return cls(job_id, node_id, nodes, tasks, submit_dir, restarts)

    @property
    def node_name(self) -> str:
        return self.nodes[self.node_id]

    @property
    def run_dir(self) -> Path:
        """The job's directory on the submit directory's (shared) storage."""
        return self.submit_dir / RUNS_DIR / f"slurm-{self.job_id}"

    @property
    def job_name(self) -> str:
        """The name a failover job's state is kept under in etcd (``--job-name``)."""
        return f"slurm-{self.job_id}"


def _integer(environ: Mapping[str, str], names: tuple[str, ...], default: int | None = None) -> int | None:
    name = next((name for name in names if environ.get(name)), None)
    if name is None:
        return default
    try:
        return int(environ[name])
    except ValueError:
        raise SlurmEnvError(f"{name}: expected an integer (got {environ[name]!r})") from None


def controller_port(job_id: str) -> int:
    """The port of the controller of Slurm job ``job_id``: the same on every node, without talking."""
    return CONTROLLER_PORT_BASE + int(job_id) % CONTROLLER_PORT_SPAN


def node_address(name: str, run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> str:
    """The address Slurm reaches node ``name`` by (its NodeAddr), else ``name`` (a cluster whose
    node names resolve, or ``scontrol`` unavailable)."""
    try:
        done = run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True,
                   timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return name
    match = re.search(r"(?:^|\s)NodeAddr=(\S+)", done.stdout) if done.returncode == 0 else None
    if match is None or match.group(1) in ("(null)", "N/A"):
        return name
    return match.group(1)
