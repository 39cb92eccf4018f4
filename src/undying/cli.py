"""The ``undying`` command: run, demo, report, status, stop, k8s render, slurm sbatch.

Runs in the user's shell process. Every bad input ends in one line
``undying: error: ...`` and exit code 2, before anything is started or written.
Each command's work is in its package: ``undying.launch`` (run, status, stop, demo),
``undying.report``, ``undying.k8s``, ``undying.slurm``.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from undying import __version__
from undying.agent.console_streams import StreamOptionError, console_streams
from undying.config import SpecError, load_job_spec, recover_strategy_overrides
from undying.inject import InjectionSpecError, check_targets, encode, parse_injections
from undying.launch import cli_tls
from undying.launch.cli_common import OneLineParser, fail, read_token
from undying.launch.cli_job import add_job_arguments, command_status, command_stop
from undying.launch.torchrun_flags import FlagError, add_torchrun_arguments, controller_flags, nproc_per_node
from undying.slurm.env import SlurmStep
from undying.slurm.errors import SlurmError
from undying.tls import TlsFileError


def parse_nnodes(text: str) -> tuple[int | None, int]:
    """torchrun's ``--nnodes N`` or ``--nnodes MIN:MAX``."""
    low, sep, high = text.partition(":")
    try:
        if sep:
            return int(low), int(high)
        return None, int(text)
    except ValueError:
        fail(f"--nnodes: expected N or MIN:MAX with integers (got {text!r})")


def parse_set(items: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--set: expected KEY=VALUE (got {item!r})")
        import yaml

        overrides[key.replace("-", "_")] = yaml.safe_load(value)
    return overrides


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", default=None, help="nodes (N or MIN:MAX); default 1")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default=None,
                        help="workers per node: N, or auto, cpu, gpu (torchrun's meanings); default 1")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
                        help="this node's rank (multi-node); omit to simulate every node on this machine")
    parser.add_argument("--standby", type=int, default=0, metavar="K",
                        help="spare nodes that take a lost node's place at once: K simulated spare agents "
                             "here; with --node-rank R (R >= nnodes), this machine joins as a spare")
    parser.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=None,
                        help="job-level restarts before giving up (default 32767)")
    parser.add_argument("--monitor-interval", "--monitor_interval", dest="monitor_interval", type=float,
                        default=None, help="seconds between agent checks of its workers (default 5)")
    parser.add_argument("--config", help="job spec YAML")
    parser.add_argument("--run-dir", help="where events.jsonl, logs, checkpoints and result.json go")
    parser.add_argument("--controller", help="HOST:PORT of the controller (node 0 binds its port; others join)")
    parser.add_argument("--controller-bind", default=None,
                        help="address the controller and its store listen on (default loopback only; with "
                             "--master-addr on node 0 of a multi-node job, that address)")
    parser.add_argument("--token-file", help="file holding the job's secret token (multi-node)")
    parser.add_argument("--etcd", metavar="HOST:PORT[,...]",
                        help="controller failover: every node runs a controller candidate, the leader is "
                             "elected by an etcd lease and keeps the job's state there (needs --job-name, "
                             "--node-rank, --token-file)")
    parser.add_argument("--job-name", help="with --etcd: the job's name, its key prefix in etcd (one per job)")
    parser.add_argument("--lease-ttl", type=int, default=2,
                        help="with --etcd: seconds a dead leader's lease lasts before another takes over "
                             "(default 2, at least 2)")
    parser.add_argument("--recover-strategy", help="comma list: retry, recover-in-place, recover, "
                        "elastic-training, dump, exit (a list with any but exit sets process_recover: true)")
    parser.add_argument("--checkpoint-dir", help="checkpoint directory (default RUN_DIR/checkpoints)")
    parser.add_argument("--checkpoint-interval", type=int, help="steps between periodic checkpoints")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any job-spec field, e.g. --set heartbeat_timeout=3 (repeatable)")
    parser.add_argument("--inject", action="append", default=[], metavar="SPEC",
                        help="fault to inject: kill:rank=R:step=S, node:node=N:step=S, hang:rank=R:step=S, "
                             "raise:rank=R:step=S (repeatable)")
    parser.add_argument("-m", "--module", action="store_true", help="SCRIPT is a Python module (python -m)")
    parser.add_argument("--no-python", action="store_true", help="run SCRIPT as an executable, not via python")
    parser.add_argument("--quiet", action="store_true", help="do not print job events or the progress line")
    parser.add_argument("--sigterm", choices=["leave", "stop"], default=None,
                        help="SIGTERM/SIGINT to a node other than node 0: leave (the node leaves the job: a spare "
                             "takes its place or elastic training shrinks; the default) or stop (the whole job "
                             "stops once its newest step is persisted, exit 75; the default in a Slurm step, "
                             "whose time limit or preemption signals every node). Node 0 always stops the job")
    add_torchrun_arguments(parser)
    parser.add_argument("--pod-labels", metavar="FILE", help="Kubernetes: the pod's labels (a Downward API file); "
                        "the seeds' keys (process-recover-enable, ...) override the spec")
    parser.add_argument("--pod-annotations", metavar="FILE", help="Kubernetes: the pod's annotations (a Downward "
                        "API file); recover-strategy and wait-reschedule-timeout override the spec")
    cli_tls.add_run_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="undying", description="Fault-tolerant, resumable distributed training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"undying {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    run = commands.add_parser("run", help="launch a training script on every node, with recovery")
    add_run_arguments(run)
    run.add_argument("script", help="training script (or module with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    demo = commands.add_parser("demo", help="train a small GPT on 2 simulated nodes, kill a worker, show recovery")
    demo.add_argument("--run-dir", default=None)
    demo.add_argument("--steps", type=int, default=80)
    demo.add_argument("--inject", default="kill:rank=1:step=45")
    demo.add_argument("--no-compare", action="store_true", help="skip the fault-free reference run")
    report = commands.add_parser("report", help="summarize a run and draw it (timeline.svg, report.png)")
    report.add_argument("run_dir")
    report.add_argument("-o", "--output", help="SVG path (default RUN_DIR/timeline.svg)")
    report.add_argument("--png", help="PNG path (default RUN_DIR/report.png)")
    status = commands.add_parser("status", help="show a running job: a table of its nodes and ranks "
                                 "(--watch: redrawn in place), or its /status as JSON")
    add_job_arguments(status)
    status.add_argument("--watch", action="store_true", help="redraw the table in place until the job ends")
    status.add_argument("--interval", type=float, default=1.0, help="with --watch: seconds between redraws")
    status.add_argument("--json", action="store_true", help="print the controller's /status as JSON, once")
    cli_tls.add_client_arguments(status)
    stop = commands.add_parser("stop", help="stop a running job once every rank persisted its newest step "
                               "(exit 75: run it again to resume there), or at once with --now")
    add_job_arguments(stop)
    cli_tls.add_client_arguments(stop)
    stop.add_argument("--now", action="store_true", help="cancel at once (exit 130); the newest durable checkpoint "
                      "is then the last periodic one")
    stop.add_argument("--reason", default=None, help="why, for the job's log (default: who asked, from where)")
    k8s = commands.add_parser("k8s", help="Kubernetes: render a job's manifests")
    k8s_commands = k8s.add_subparsers(dest="k8s_command", required=True, parser_class=OneLineParser)
    from undying.k8s.command import add_render_arguments

    add_render_arguments(k8s_commands.add_parser("render", help="write the manifests of a job for a cluster engine"))
    slurm = commands.add_parser("slurm", help="Slurm: write or submit a job's batch script")
    slurm_commands = slurm.add_subparsers(dest="slurm_command", required=True, parser_class=OneLineParser)
    from undying.slurm.command import add_sbatch_arguments

    add_sbatch_arguments(slurm_commands.add_parser(
        "sbatch", help="write (or with --submit, submit) the batch script that runs the job on N nodes + K spares"))
    return parser


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")


def worker_command(args: argparse.Namespace) -> list[str]:
    if args.no_python:
        return [args.script, *args.script_args]
    if args.module:
        return [sys.executable, "-u", "-m", args.script, *args.script_args]
    if not Path(args.script).is_file():
        fail(f"script {args.script!r} not found")
    return [sys.executable, "-u", args.script, *args.script_args]


def command_run(args: argparse.Namespace) -> int:
    from undying.launch.launch_options import LaunchOptions, SigtermAction
    from undying.launch.launcher import launch

    if args.standby < 0:
        fail(f"--standby: allowed 0 or more spare nodes (got {args.standby})")
    step = None if args.standalone else _slurm_step()
    overrides: dict[str, Any] = parse_set(args.set)
    if args.nnodes is not None:
        overrides["min_nodes"], overrides["nnodes"] = parse_nnodes(args.nnodes)
    if args.nproc_per_node is not None:
        try:
            args.nproc_per_node = nproc_per_node(args.nproc_per_node)
        except FlagError as error:
            fail(str(error))
    for key in ("nproc_per_node", "max_restarts", "monitor_interval"):
        overrides[key] = getattr(args, key)
    overrides.update(recover_strategy_overrides(args.recover_strategy, overrides))  # implies process_recover
    overrides["checkpoint.dir"] = args.checkpoint_dir
    overrides["checkpoint.interval"] = args.checkpoint_interval
    try:
        spec = load_job_spec(args.config, overrides)
        if step is not None:
            from undying.slurm.launch import place_in_step

            spec = place_in_step(args, step, spec, lambda nnodes: load_job_spec(args.config, {**overrides,
                                                                                              "nnodes": nnodes}))
        if args.pod_labels or args.pod_annotations:
            from undying.k8s.labels import apply_pod_metadata_files

            spec = apply_pod_metadata_files(spec, args.pod_labels, args.pod_annotations)
        injections = parse_injections(args.inject)
        check_targets(injections, spec.world_size, spec.nnodes)
        streams = console_streams(spec.nproc_per_node, args.redirects, args.tee, args.local_ranks_filter)
        args.controller, args.controller_bind = controller_flags(args, spec.nnodes)
        hosts_controller = args.node_rank is None or args.node_rank == 0 or args.etcd is not None
        server_tls = cli_tls.server_tls(args, hosts_controller)
        tls_ca, etcd_tls = cli_tls.controller_ca(args), cli_tls.etcd_tls(args)
    except (SpecError, InjectionSpecError, StreamOptionError, FlagError, SlurmError, TlsFileError) as error:
        fail(str(error))
    if etcd_tls is not None and args.etcd is None:
        fail("--etcd-ca: only with --etcd (controller failover)")
    if args.log_dir is not None and Path(args.log_dir).exists() and not Path(args.log_dir).is_dir():
        fail(f"--log-dir: allowed a directory (got {args.log_dir!r}, a file)")
    if spec.compile_cache:
        try:
            Path(spec.compile_cache).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            fail(f"compile_cache: allowed a directory this node can create and write (got "
                 f"{spec.compile_cache!r}: {error.strerror})")
    spare_node = args.node_rank is not None and args.standby > 0
    if spare_node and args.node_rank < spec.nnodes:
        fail(f"--node-rank: a spare node (--standby) needs a node rank >= nnodes ({spec.nnodes}), "
             f"got {args.node_rank}")
    if args.node_rank is not None and not spare_node and not 0 <= args.node_rank < spec.nnodes:
        fail(f"--node-rank: allowed 0..{spec.nnodes - 1} (got {args.node_rank})")
    if args.node_rank is not None and spec.nnodes > 1 and not args.token_file:
        fail("--token-file is required for a multi-node job (every node must hold the same secret)")
    if args.etcd is not None:
        if args.node_rank is None or not args.job_name or not args.token_file:
            fail("--etcd: controller failover needs --node-rank, --job-name and --token-file on every node")
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", args.job_name):
            fail(f"--job-name: allowed 1-64 letters, digits, '.', '_' or '-' (got {args.job_name!r})")
        if args.lease_ttl < 2:
            fail(f"--lease-ttl: allowed 2 s or more (got {args.lease_ttl})")
        if not re.fullmatch(r"\[?[^\s/,]+\]?:\d{1,5}(,\[?[^\s/,]+\]?:\d{1,5})*", args.etcd):
            fail(f"--etcd: allowed HOST:PORT, or several comma-separated (an etcd cluster) (got {args.etcd!r})")
    elif args.node_rank is not None and args.node_rank > 0 and not args.controller:
        fail("--controller HOST:PORT (or --master-addr HOST) is required on nodes other than 0")
    options = LaunchOptions(
        spec=spec, command=worker_command(args), run_dir=Path(args.run_dir) if args.run_dir else default_run_dir(),
        node_rank=args.node_rank, controller_address=args.controller, controller_bind=args.controller_bind,
        token=read_token(args.token_file), injections_text=encode(injections), quiet=args.quiet,
        standby_agents=args.standby, etcd=args.etcd, job_name=args.job_name, lease_ttl=args.lease_ttl,
        log_dir=Path(args.log_dir) if args.log_dir else None, console_streams=streams,
        sigterm=SigtermAction(args.sigterm or ("stop" if step is not None else "leave")),
        tls=server_tls, tls_ca=tls_ca, etcd_tls=etcd_tls)
    code = launch(options)
    # The interpreter's shutdown would otherwise spend a final GC over torch's object graph (the
    # store imported it), at the end of every job; nothing left is garbage worth that.
    gc.freeze()
    return code


def _slurm_step() -> SlurmStep | None:
    """The Slurm step this ``undying run`` is a task of (``slurm/env.py``), or None outside one."""
    try:
        return SlurmStep.from_environ(os.environ)
    except SlurmError as error:
        fail(f"Slurm step: {error}")


def command_report(args: argparse.Namespace) -> int:
    from undying.events import read_events
    from undying.report import render_summary, summarize, write_report

    run_dir = Path(args.run_dir)
    if not (run_dir / "events.jsonl").is_file() and not run_dir.is_file():
        fail(f"{run_dir}: no events.jsonl here")
    events = read_events(run_dir)
    print(render_summary(summarize(events)))
    print(f"timeline: {write_report(run_dir, args.output)}")
    from undying.report.png import write_png

    print(f"report: {write_png(run_dir, events, args.png)}")
    return 0


def command_k8s_render(args: argparse.Namespace) -> int:
    from undying.k8s.command import run_render
    from undying.k8s.render import RenderError

    try:
        return run_render(args)
    except (SpecError, RenderError) as error:
        fail(str(error))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return command_run(args)
    if args.command == "demo":
        from undying.launch.demo import run_demo

        return run_demo(args)
    if args.command == "report":
        return command_report(args)
    if args.command == "status":
        return command_status(args)
    if args.command == "stop":
        return command_stop(args)
    if args.command == "k8s":
        return command_k8s_render(args)
    if args.command == "slurm":
        from undying.slurm.command import run_sbatch

        try:
            return run_sbatch(args)
        except (SpecError, SlurmError) as error:
            fail(str(error))
    fail(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
