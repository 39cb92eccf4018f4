"""``undying status`` and ``undying stop``: the commands that talk to a running job's controller.

Runs in the user's shell process. The job is found the same way for both (``job_controller``): its
run directory (the controller record and token kept there, and the job's TLS files), or
``--controller`` with a token, or ``--etcd`` with ``--job-name`` for a failover job's leader.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from undying.launch import cli_tls
from undying.launch.cli_common import fail, read_token
from undying.tls import TlsFileError


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """How ``status`` and ``stop`` find a running job (``_job_controller``)."""
    parser.add_argument("run_dir", nargs="?", help="the run directory of a job started here (its controller "
                        "and token are found in it)")
    parser.add_argument("--controller", help="HOST:PORT of the controller")
    parser.add_argument("--etcd", metavar="HOST:PORT[,...]", help="a failover job: find its leader in etcd")
    parser.add_argument("--job-name", help="with --etcd: the job's name")
    parser.add_argument("--token-file", help="the job's token (default with RUN_DIR: the one kept there)")


def command_status(args: argparse.Namespace) -> int:
    from undying.client import ControllerClient, ControllerUnreachable, Unauthorized

    if args.json and args.watch:
        fail("--json prints the status once; --watch redraws a table: choose one")
    if not args.interval > 0:
        fail(f"--interval: allowed seconds > 0 (got {args.interval})")
    address, token, locator = job_controller(args, "status")
    client = ControllerClient(address, token, locator=locator)
    try:
        if args.json:
            print(json.dumps(client.get("/status"), indent=2))
            return 0
        from undying.launch.status_view import render_status, watch

        if args.watch:
            watch(lambda: client.get("/status"), args.interval)
        else:
            from rich.console import Console

            Console().print(render_status(client.get("/status")))
        return 0
    except (ControllerUnreachable, Unauthorized, ValueError) as error:
        ended = job_end(Path(args.run_dir)) if args.run_dir is not None else None
        if ended is not None:  # the controller went away because the job ended: say how
            print(f"undying: the job ended: {ended.details.get('outcome')}: {ended.details.get('message')}")
            return 0
        print(f"undying: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def command_stop(args: argparse.Namespace) -> int:
    """Ask a running job's controller to stop it (POST /v1/job/stop)."""
    import socket

    from undying.client import ControllerClient, ControllerUnreachable, Unauthorized
    from undying.protocol import ROUTE_JOB_STOP

    address, token, locator = job_controller(args, "stop")
    reason = args.reason or f"undying stop{' --now' if args.now else ''} by {os.environ.get('USER', 'a user')} " \
                            f"on {socket.gethostname()}"
    client = ControllerClient(address, token, locator=locator)
    try:
        client.post(ROUTE_JOB_STOP, {"reason": reason, "now": args.now})
    except (ControllerUnreachable, Unauthorized) as error:
        ended = job_end(Path(args.run_dir)) if args.run_dir is not None else None
        if ended is not None:
            print(f"undying: the job ended: {ended.details.get('outcome')}: {ended.details.get('message')}")
            return 0
        print(f"undying: error: {error}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"undying: the job at {client.address} stops " + ("now (cancelled, exit 130)" if args.now else
          "once every rank persisted its newest step (exit 75: run it again to resume there)"))
    return 0


def job_controller(args: argparse.Namespace, command: str) -> tuple[str, str, Any]:
    """The controller address, token and (a failover job) leader locator that ``status`` or ``stop``
    was pointed at: a run directory, --controller, or --etcd with --job-name."""
    from undying.locate import locate_controller

    try:
        cli_tls.use_for_clients(args)
    except TlsFileError as error:
        fail(str(error))
    if args.run_dir is not None:
        return run_dir_controller(Path(args.run_dir), args.token_file)
    if args.controller is not None:
        if args.token_file is None and not os.environ.get("UNDYING_TOKEN"):
            fail("--token-file: required with --controller (or give the job's RUN_DIR instead)")
        token = read_token(args.token_file)
        assert token is not None
        return args.controller, token, None
    if args.etcd and args.job_name:
        if args.token_file is None and not os.environ.get("UNDYING_TOKEN"):
            fail("--token-file: required with --etcd")
        etcd, job_name = args.etcd, args.job_name
        token = read_token(args.token_file)
        assert token is not None
        located = locate_controller(etcd, job_name)
        if located is None:
            print(f"undying: error: no leader of job {job_name} in etcd {etcd}", file=sys.stderr)
            raise SystemExit(1)
        return located, token, lambda: locate_controller(etcd, job_name)
    fail(f"{command}: give the job's RUN_DIR, or --controller HOST:PORT, or --etcd HOST:PORT with --job-name")


def job_end(run_dir: Path) -> Any:
    """The run's ``job_end`` event, if its log has one."""
    from undying.events import JOB_END, read_events

    try:
        return next((event for event in reversed(read_events(run_dir)) if event.kind == JOB_END), None)
    except OSError:
        return None


def run_dir_controller(run_dir: Path, token_file: str | None) -> tuple[str, str, Any]:
    """A job's controller address, token and (a failover job) leader locator, from its run directory."""
    from undying.launch.controller_files import TOKEN_FILE, read_controller_record
    from undying.locate import locate_controller
    from undying.tls import ENV_ETCD_CA, ENV_ETCD_CERT, ENV_ETCD_KEY, ENV_TLS_CA

    try:
        record = read_controller_record(run_dir)
    except FileNotFoundError:
        print(f"undying: error: {run_dir}: no job running from here (no controller.json: it ended, "
              "or it runs from another directory)", file=sys.stderr)
        raise SystemExit(1) from None
    except (OSError, ValueError) as error:
        fail(f"{run_dir}: cannot read its controller record: {error}")
    token = read_token(token_file or str(run_dir / TOKEN_FILE))
    assert token is not None
    # The job's own TLS files, unless the command named others.
    recorded = {ENV_TLS_CA: record.tls_ca, ENV_ETCD_CA: record.etcd_ca, ENV_ETCD_CERT: record.etcd_cert,
                ENV_ETCD_KEY: record.etcd_key}
    os.environ.update({name: path for name, path in recorded.items() if path and not os.environ.get(name)})
    if record.etcd and record.job_name:
        etcd, job_name = record.etcd, record.job_name
        return locate_controller(etcd, job_name) or record.address, token, lambda: locate_controller(etcd, job_name)
    return record.address, token, None
