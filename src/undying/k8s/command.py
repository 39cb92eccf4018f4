"""``undying k8s render``: its options and what it does with them.

Runs in the user's shell process; ``cli.py`` only wires the subcommand to these two functions.
Writes manifests (to ``--out DIR`` or stdout) and its notes to stderr; never contacts a cluster.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from undying.config import load_job_spec
from undying.k8s.names import option_error
from undying.k8s.options import (
    DEFAULT_JOB_RETRIES,
    DEFAULT_POD_RETRIES,
    VOLUME_FORMS,
    Flavor,
    Placement,
    RenderOptions,
    Resources,
    Retries,
    parse_metadata,
    parse_node_selector,
    parse_toleration,
    parse_volume,
)
from undying.k8s.render import dump_manifests, kept_token, render_with_notes, write_manifests


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
    storage = parser.add_argument_group("storage")
    storage.add_argument("--checkpoint-volume", metavar="KIND:...",
                         help=f"mounted at checkpoint.dir on every pod: {VOLUME_FORMS}")
    storage.add_argument("--run-volume", metavar="KIND:...",
                         help="keeps the run directories (events, logs, result.json) as runs/POD_NAME "
                              "(default: the checkpoint volume)")
    storage.add_argument("--checkpoint-secret", metavar="SECRET",
                         help="object-store credentials: every key of this Secret becomes a variable")
    placement = parser.add_argument_group("placement and scheduling")
    placement.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                           help="run only on nodes with this label (repeatable)")
    placement.add_argument("--toleration", action="append", default=[], metavar="KEY[=VALUE][:EFFECT]",
                           help="tolerate this taint (repeatable)")
    placement.add_argument("--one-pod-per-node", action=argparse.BooleanOptionalAction, default=True,
                           help="no two pods of the job on one node (default: on)")
    placement.add_argument("--exclusive-topology", metavar="NODE_LABEL",
                           help="JobSet: the job alone in one domain of this node label")
    placement.add_argument("--priority-class", metavar="NAME", help="the pods' PriorityClass")
    placement.add_argument("--queue", metavar="NAME", help="Volcano's queue, or Kueue's LocalQueue (JobSet, PyTorchJob)")
    placement.add_argument("--service-account", metavar="NAME", help="the pods' ServiceAccount")
    placement.add_argument("--image-pull-secret", action="append", default=[], metavar="SECRET",
                           help="a Secret to pull the image with (repeatable)")
    placement.add_argument("--cpu-request", metavar="QUANTITY")
    placement.add_argument("--cpu-limit", metavar="QUANTITY")
    placement.add_argument("--memory-request", metavar="QUANTITY", help="default: /dev/shm's size, its least")
    placement.add_argument("--memory-limit", metavar="QUANTITY")
    engine = parser.add_argument_group("engine budgets, token and metadata")
    engine.add_argument("--pod-retries", type=int, default=DEFAULT_POD_RETRIES, metavar="N",
                        help="recreations of a pod that died (drains and stops not counted where the engine can tell)")
    engine.add_argument("--job-retries", type=int, default=DEFAULT_JOB_RETRIES, metavar="N",
                        help="restarts of the whole job after failures")
    engine.add_argument("--token-secret", metavar="SECRET",
                        help="an existing Secret with the token under key 'token' (no Secret rendered)")
    tls = parser.add_argument_group("TLS (existing Secrets, mounted read-only in every pod)")
    tls.add_argument("--tls-secret", metavar="SECRET",
                     help="the controller's certificate: keys tls.crt, tls.key and ca.crt (a cert-manager "
                          "Certificate's Secret); without --etcd it must name NAME-ctl and 127.0.0.1 "
                          "(docs/kubernetes.md, TLS)")
    tls.add_argument("--etcd-tls-secret", metavar="SECRET",
                     help="with --etcd: etcd's CA under key ca.crt (etcd reached over HTTPS)")
    tls.add_argument("--etcd-client-cert", action="store_true",
                     help="--etcd-tls-secret also holds this job's client certificate for etcd (tls.crt, tls.key)")
    engine.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                        help="on the job and its pods (repeatable); the seeds' keys set the spec")
    engine.add_argument("--annotation", action="append", default=[], metavar="KEY=VALUE",
                        help="on the job and its pods (repeatable); the seeds' keys set the spec")


def default_job_name(spec_path: str) -> str:
    stem = Path(spec_path).stem.lower().replace("_", "-").replace(".", "-")
    return stem.strip("-")[:40].strip("-") or "undying-job"


def render_options(args: argparse.Namespace) -> RenderOptions:
    """The options as given on the command line, each text parsed (one ``RenderError`` line)."""
    try:
        script = shlex.split(args.script)
    except ValueError as error:
        raise option_error("--script", "one shell-quoted string, e.g. '/app/train.py --name \"a b\"'",
                           args.script, str(error)) from None
    name = args.name if args.name is not None else default_job_name(args.spec)
    token = kept_token(args.out, name) if args.out is not None and args.token_secret is None else None
    placement = Placement(node_selector=parse_node_selector(args.node_selector),
                          tolerations=tuple(parse_toleration(text) for text in args.toleration),
                          one_pod_per_node=args.one_pod_per_node, exclusive_topology=args.exclusive_topology,
                          priority_class=args.priority_class, queue=args.queue)
    return RenderOptions(
        name=name, flavor=Flavor(args.flavor), image=args.image, script=script, standby=args.standby,
        state_gib=args.state_gib, gpu_resource=args.gpu_resource, etcd=args.etcd, token=token,
        token_secret=args.token_secret, tls_secret=args.tls_secret, etcd_tls_secret=args.etcd_tls_secret,
        etcd_client_cert=args.etcd_client_cert,
        checkpoint_volume=parse_volume("--checkpoint-volume", args.checkpoint_volume) if args.checkpoint_volume else None,
        run_volume=parse_volume("--run-volume", args.run_volume) if args.run_volume else None,
        checkpoint_secret=args.checkpoint_secret, service_account=args.service_account,
        image_pull_secrets=tuple(args.image_pull_secret), placement=placement,
        resources=Resources(args.cpu_request, args.cpu_limit, args.memory_request, args.memory_limit),
        retries=Retries(pod=args.pod_retries, job=args.job_retries),
        job_labels=parse_metadata("--label", args.label, labels=True),
        job_annotations=parse_metadata("--annotation", args.annotation, labels=False))


def run_render(args: argparse.Namespace) -> int:
    """Render the job; raises ``SpecError`` or ``RenderError`` (one line each) on bad input."""
    options = render_options(args)
    spec = load_job_spec(args.spec, {"nnodes": args.nodes})
    objects, notes = render_with_notes(spec, options)
    for note in notes:
        print(f"undying: note: {note}", file=sys.stderr)
    if args.out is None:
        sys.stdout.write(dump_manifests(objects))
        return 0
    for path in write_manifests(objects, args.out, options.name):
        print(path)
    return 0

