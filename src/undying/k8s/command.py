"""``undying k8s render``: its options and what it does with them.

Runs in the user's shell process; ``cli.py`` only wires the subcommand to these two functions.
Writes manifests (to ``--out DIR`` or stdout); never contacts a cluster.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from undying.config import load_job_spec
from undying.k8s.pod import Flavor, RenderOptions
from undying.k8s.render import dump_manifests, render_job, write_manifests


def add_render_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="JOB.yaml", help="the job spec (as for undying run --config)")
    parser.add_argument("--flavor", required=True, choices=[flavor.value for flavor in Flavor],
                        help="the cluster engine: JobSet, Kubeflow PyTorchJob or Volcano Job")
    parser.add_argument("--image", default="undying:latest", help="container image with undying, torch and the script")
    parser.add_argument("--name", help="the job's name, prefix of every object (default: the spec file's name)")
    parser.add_argument("--nodes", type=int, help="nodes (overrides the spec's nnodes)")
    parser.add_argument("--standby", type=int, default=0, metavar="K", help="spare pods (needs pod_rescheduling: on)")
    parser.add_argument("--state-gib", type=float, default=1.0,
                        help="one rank's parameters + optimizer state in GiB: sizes /dev/shm for T1 snapshots")
    parser.add_argument("--gpu-resource", help="extended resource per rank, e.g. nvidia.com/gpu")
    parser.add_argument("--etcd", metavar="HOST:PORT[,...]", help="controller failover through etcd")
    parser.add_argument("--out", help="write one file per object here (default: YAML on stdout)")
    parser.add_argument("--script", required=True, metavar="'SCRIPT ARGS...'",
                        help="the training script in the image and its arguments, as one shell-quoted string "
                             "(what follows the options of `undying run`), e.g. '/app/train.py --steps 100'")


def default_job_name(spec_path: str) -> str:
    stem = Path(spec_path).stem.lower().replace("_", "-").replace(".", "-")
    return stem.strip("-")[:40].strip("-") or "undying-job"


def run_render(args: argparse.Namespace) -> int:
    """Render the job; raises ``SpecError`` or ``RenderError`` (one line each) on bad input."""
    script = shlex.split(args.script)
    spec = load_job_spec(args.spec, {"nnodes": args.nodes})
    options = RenderOptions(name=args.name or default_job_name(args.spec), flavor=Flavor(args.flavor),
                            image=args.image, script=script, standby=args.standby, state_gib=args.state_gib,
                            gpu_resource=args.gpu_resource, etcd=args.etcd)
    objects = render_job(spec, options)
    if spec.checkpoint.dir is None:
        print("undying: note: checkpoint.dir is not set: each pod keeps its T2 checkpoints in its own "
              "emptyDir, lost with the pod; set it to shared storage or an object-store URL", file=sys.stderr)
    if args.out is None:
        sys.stdout.write(dump_manifests(objects))
        return 0
    for path in write_manifests(objects, args.out):
        print(path)
    return 0
