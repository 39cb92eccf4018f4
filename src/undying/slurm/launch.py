"""``undying run`` in a Slurm step: what the flags left unsaid, taken from the step.

Runs in ``undying run`` (the CLI process) on every node of the step, before the job spec is final.
A flag always wins; only what no flag gave comes from the step (``env.SlurmStep``):

- ``--node-rank``: ``SLURM_NODEID``; ``--nnodes``: the step's nodes less the ``--standby K`` spares
  (the step's last K nodes), unless the spec or ``--nnodes`` says, and then the step must hold
  exactly that many nodes plus the spares;
- ``--master-addr``/``--master-port`` (unless ``--controller`` or ``--etcd``): the step's first
  node at its NodeAddr, on the port derived from the job id; ``--controller-bind``: ``0.0.0.0`` on
  node 0 (every node with ``--etcd``), where the other nodes reach it;
- ``--run-dir``: ``SLURM_SUBMIT_DIR/runs/slurm-JOBID``, shared by the nodes, which keeps the T2
  checkpoints by default (so the nodes pass the root check, and a requeued job resumes there);
- ``--token-file``: ``RUN_DIR/job.token``, made once for every node (``shared_token.py``);
- ``--job-name`` (with ``--etcd``): ``slurm-JOBID``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from undying.config import JobSpec
from undying.slurm.env import ENV_STEP_NUM_NODES, SlurmStep, controller_port, node_address
from undying.slurm.errors import SlurmError
from undying.slurm.shared_token import shared_token

TOKEN_NAME = "job.token"
BIND_ALL = "0.0.0.0"


class SlurmPlacementError(SlurmError):
    """The step cannot hold the job as asked; one line naming the numbers and the fix."""


@dataclass(frozen=True)
class Placement:
    """This node's part of the job in the step."""

    node_rank: int
    nnodes: int  # the job's nodes (spares not counted)
    spare: bool  # one of the step's last ``standby`` nodes


def place(step: SlurmStep, node_rank: int | None, nnodes: int | None, standby: int) -> Placement:
    """This node's rank, the job's node count and whether this node is a spare. ``nnodes`` is the
    count the spec or ``--nnodes`` gave (None: the step decides)."""
    have = len(step.nodes)
    if step.tasks != have:
        raise SlurmPlacementError(f"undying run runs once per node of the Slurm step: start it with srun "
                                  f"--ntasks-per-node=1 (this step has {step.tasks} tasks on {have} nodes)")
    if nnodes is None:
        nnodes = have - standby
        if nnodes < 1:
            raise SlurmPlacementError(f"--standby {standby} leaves no node for the job: the Slurm step has "
                                      f"{have} node{'s' * (have != 1)} ({ENV_STEP_NUM_NODES[0]})")
    elif nnodes + standby != have:
        spares = f" + {standby} spare{'s' * (standby != 1)}" if standby else ""
        fix = (f"allocate {nnodes + standby} (sbatch --nodes {nnodes + standby})" if nnodes + standby > have
               else f"use them all (--nnodes {have - standby}, or --standby {have - nnodes})")
        raise SlurmPlacementError(f"the job needs {nnodes} node{'s' * (nnodes != 1)}{spares} = {nnodes + standby}, "
                                  f"the Slurm step has {have} ({ENV_STEP_NUM_NODES[0]}): {fix}")
    rank = step.node_id if node_rank is None else node_rank
    return Placement(rank, nnodes, spare=rank >= nnodes)


def place_in_step(args: argparse.Namespace, step: SlurmStep, spec: JobSpec,
                  respec: Callable[[int], JobSpec]) -> JobSpec:
    """Place this node in ``step`` and fill the flags in ``args`` accordingly; returns the spec at the
    job's node count (``respec(nnodes)`` loads it again when the step decided the count)."""
    given = spec.nnodes if "nnodes" in spec.model_fields_set else None  # by the spec file, --set or --nnodes
    placement = place(step, args.node_rank, given, args.standby)
    if placement.nnodes != spec.nnodes:
        spec = respec(placement.nnodes)
    apply_step(args, step, placement)
    return spec


def apply_step(args: argparse.Namespace, step: SlurmStep, placement: Placement,
               address_of: Callable[[str], str] | None = None) -> None:
    """Fill ``undying run``'s unset flags in ``args`` from the step and this node's placement
    (``address_of``: a node name's address, by default its NodeAddr from ``scontrol``)."""
    args.node_rank = placement.node_rank
    # The CLI's --standby K on a node of its own is "this node is a spare".
    args.standby = args.standby if placement.spare else 0
    if args.run_dir is None:
        args.run_dir = str(step.run_dir)
    if args.token_file is None and not os.environ.get("UNDYING_TOKEN"):
        token_file = Path(args.run_dir) / TOKEN_NAME
        shared_token(token_file)
        args.token_file = str(token_file)
    if args.etcd is not None:
        args.job_name = args.job_name or step.job_name
        if args.controller_bind is None:
            args.controller_bind = BIND_ALL
        return
    if args.controller is None:
        if args.master_addr is None:
            args.master_addr = (address_of or node_address)(step.nodes[0])
        if args.master_port is None:
            args.master_port = controller_port(step.job_id)
    if args.controller_bind is None and placement.node_rank == 0:
        args.controller_bind = BIND_ALL
