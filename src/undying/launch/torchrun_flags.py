"""torchrun's launch flags in ``undying run``, with torchrun's meanings, in undying's terms.

Runs in the ``undying run`` process (the CLI), before anything starts:

- ``--standalone``: one node with its own controller on a free loopback port (torchrun: a local
  rendezvous on a free port); refused with the flags that name other nodes or a controller;
- ``--master-addr A`` / ``--master-port P``: the controller, ``--controller A:P`` (torchrun's
  defaults: 127.0.0.1, 29500); on node 0 of a multi-node job the controller then listens on A
  unless ``--controller-bind`` says where (torchrun's store listens where the other nodes reach A);
- ``--nproc-per-node auto|cpu|gpu|N``: torchrun's ``determine_local_world_size``: ``cpu`` the CPUs
  this process may run on, ``gpu`` the CUDA devices (an error without CUDA), ``auto`` the
  accelerator's devices if there is one, else the CPUs;
- ``--log-dir DIR``, ``--redirects``, ``--tee``, ``--local-ranks-filter``: where the workers' logs
  go and what the console shows of them (``agent/console_streams.py``).
"""

from __future__ import annotations

import argparse
import os

DEFAULT_MASTER_ADDR = "127.0.0.1"  # torchrun's
DEFAULT_MASTER_PORT = 29500  # torchrun's
DEFAULT_CONTROLLER_BIND = "127.0.0.1"
NPROC_ALLOWED = "auto, cpu, gpu or a positive integer"


class FlagError(ValueError):
    """A bad torchrun-style flag: one line naming it and what is allowed."""


def add_torchrun_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--standalone", action="store_true",
                        help="one node, with its own controller on a free loopback port (as torchrun's)")
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr", metavar="HOST",
                        help="torchrun's name for the controller's host: --controller HOST:PORT (default 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, metavar="PORT",
                        help="torchrun's name for the controller's port (default 29500 with --master-addr)")
    parser.add_argument("--log-dir", "--log_dir", dest="log_dir", metavar="DIR",
                        help="where the workers' logs go (default RUN_DIR/logs)")
    parser.add_argument("-r", "--redirects", metavar="V",
                        help="streams kept in the log files only, not shown: 0 none, 1 stdout, 2 stderr, "
                             "3 both, or per local rank, e.g. 0:1,1:2 (default 0)")
    parser.add_argument("-t", "--tee", metavar="V",
                        help="streams shown on the console even if redirected (values as --redirects)")
    parser.add_argument("--local-ranks-filter", "--local_ranks_filter", dest="local_ranks_filter", metavar="R,...",
                        help="only these local ranks' output is shown on the console, e.g. 0 (default: all)")


def nproc_per_node(text: str) -> int:
    """``--nproc-per-node``'s value as a number of workers, with torchrun's meanings of the words."""
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text == "cpu":
        return cpu_count()
    if text in ("gpu", "auto"):
        import torch

        if text == "gpu":
            if not torch.cuda.is_available():
                raise FlagError("--nproc-per-node gpu: CUDA is not available here; allowed " + NPROC_ALLOWED)
            return torch.cuda.device_count()
        if torch.accelerator.is_available():
            return torch.accelerator.device_count()
        return cpu_count()
    raise FlagError(f"--nproc-per-node: allowed {NPROC_ALLOWED} (got {text!r})")


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity, as torch's ``cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def controller_flags(args: argparse.Namespace, nnodes: int) -> tuple[str | None, str]:
    """(``--controller`` address, the address it listens on) from ``--standalone``, ``--master-addr``
    and ``--master-port``, or the controller flags themselves."""
    bind = args.controller_bind
    master = args.master_addr is not None or args.master_port is not None
    if args.standalone:
        clashing = [flag for flag, given in (("--node-rank", args.node_rank is not None),
                                             ("--controller", args.controller is not None),
                                             ("--master-addr", args.master_addr is not None),
                                             ("--master-port", args.master_port is not None),
                                             ("--etcd", args.etcd is not None)) if given]
        if clashing:
            raise FlagError(f"--standalone: one node with its own local controller; not with {', '.join(clashing)}")
        if nnodes != 1:
            raise FlagError(f"--standalone: one node; allowed --nnodes 1 (got {nnodes})")
        return None, bind or DEFAULT_CONTROLLER_BIND
    if not master:
        return args.controller, bind or DEFAULT_CONTROLLER_BIND
    if args.controller is not None:
        raise FlagError("--master-addr/--master-port: they name the controller; give them or --controller "
                        "HOST:PORT, not both")
    port = DEFAULT_MASTER_PORT if args.master_port is None else args.master_port
    if not 0 < port < 65536:
        raise FlagError(f"--master-port: allowed 1..65535 (got {port})")
    host = args.master_addr or DEFAULT_MASTER_ADDR
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    if bind is None:
        bind = host.strip("[]") if args.node_rank == 0 and nnodes > 1 else DEFAULT_CONTROLLER_BIND
    return address, bind
