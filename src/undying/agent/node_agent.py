"""The node agent: one per node, spawns that node's workers and carries out the controller's orders.

Runs in its own process (``python -m undying.agent.node_agent`` for a simulated node, or inside
``undying run --node-rank R`` on a real one). It polls its workers every
``monitor_interval`` seconds and reports their exits (code or signal) in each poll, reports
an exit or a stopped worker (SIGSTOP: a hang) the moment it sees it, and on orders starts
a generation's workers, stops them, or exits. Workers share the agent's process group and
die with it, as on a real node. A spare agent
(``--standby``) holds no ranks until the controller orders it to adopt a lost
node's place; it then says hello as that node and serves its ranks.
What it does with its worker processes (start, replace, watch, report, stop) is ``workers.py``.

SIGTERM or SIGINT (``--sigterm``): ``leave`` (outside Slurm) is a planned leave: the agent tells
the controller the node is leaving, then stops its workers and exits. ``stop`` (in a Slurm step,
where a time limit or a preemption signals every task at once) asks the controller for the
graceful stop of the whole job and keeps the workers, which ignore the signal, running until the
controller's exit order (at most ``stop_timeout`` and a margin); a second signal stops at once.
An agent exits with the job's outcome as the controller's exit order gives it (0 succeeded,
1 failed, 75 stopped, 130 cancelled), as node 0's ``undying run`` does.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from undying.agent.console_streams import ConsoleStreams
from undying.agent.node_check import NodeCheck, check_node
from undying.agent.node_standby import StandbyKeeper
from undying.agent.output_relay import OutputRelay, PipeSink
from undying.agent.procs import die_with_parent
from undying.agent.workers import ENV_DIE_WITH_PARENT, NodeWorkers
from undying.client import ControllerClient, ControllerUnreachable, Unauthorized, parse_address
from undying.config import JobSpec, spec_from_json, spec_to_dict
from undying.inject import decode as decode_injections
from undying.launch.launch_options import SigtermAction
from undying.locate import locator_from_env
from undying.protocol import (
    ROUTE_AGENT_HELLO,
    ROUTE_AGENT_LEAVE,
    ROUTE_AGENT_POLL,
    ROUTE_JOB_STOP,
    AgentHello,
    AgentLeave,
    AgentPoll,
    HelloReply,
    Order,
    OrderKind,
)
from undying.root_probe import remove_probe, t2_root, write_probe, writes_t2
from undying.shm import claim_node_dir, remove_node_dir, remove_stale
from undying.worker_env import ENV_INJECT, ENV_SPEC, ENV_TOKEN

# A long poll answers within monitor_interval; this much longer and the controller is taken for gone
# (a frozen controller accepts connections and never answers): in a failover job the agent then
# looks for the new leader, well before the new leader gives up on this node.
POLL_MARGIN = 2.0
# How long a leaving agent waits for the controller to take note before it stops its workers anyway.
LEAVE_TIMEOUT = 3.0
# `undying run`'s exit code on a node whose agent ended while the job goes on: a signal (a drained or
# preempted pod's SIGTERM: a planned leave), or a controller unreachable for node_return_timeout.
# Not the job's outcome, so not 0 (an engine would count the pod as done and never replace it):
# 128 + SIGTERM, what a pod killed by SIGTERM reports; the rendered Kubernetes policies recreate
# such a pod (docs/kubernetes.md's exit-code table).
EXIT_NODE_LEFT = 143
# With --sigterm stop: how much longer than stop_timeout the agent waits for the controller's exit
# order after it asked for the stop, before it stops its workers itself (the controller is gone).
STOP_MARGIN_S = 10.0
EXIT_CANCELLED = 130  # the job's exit code when it was cancelled (controller/state.py)


class AgentStopped(Exception):
    pass


class Agent(NodeWorkers):
    """Owns the workers of one node for the life of the job (their processes: ``workers.NodeWorkers``)."""

    def __init__(
        self,
        node: int,
        spec: JobSpec,
        controller_address: str,
        token: str,
        run_dir: Path,
        command: list[str],
        injections_text: str = "",
        spare: bool = False,
        log_dir: Path | None = None,
        relay: OutputRelay | None = None,
        sigterm: SigtermAction = SigtermAction.LEAVE,
    ) -> None:
        self.node = node
        self.launched_as = node  # the node id it was started with (a ``check:`` injection aims at it)
        self.spare = spare  # a standby node until it adopts a lost node's place
        self.spec = spec
        self.token = token
        self.run_dir = run_dir
        self.log_dir = log_dir or run_dir / "logs"  # the workers' and the standby's logs (--log-dir)
        self.relay = relay  # relays the workers' log lines to the console (output_relay.py); None: not shown
        self.command = command
        self.injections_text = injections_text
        # A failover job's agent follows the controller to wherever etcd says it now runs.
        self.locator = locator_from_env(os.environ)
        self.client = ControllerClient(controller_address, token, timeout=10.0, locator=self.locator)
        self.job_id = ""
        self.generation = 0
        super().__init__()  # the node's workers (none yet) and what is known of each
        # The interpreter every worker of this node is forked from (standby.py), from the agent's start.
        self.standby = StandbyKeeper(node, spec.warm_standby, self.command, self.log_dir,
                                     ignore_stop_signals=sigterm is SigtermAction.STOP)
        self._stopping = False
        self._leaving: str | bool = False  # the signal that stopped this agent before the job ended
        self.sigterm = sigterm  # what SIGTERM/SIGINT do: a planned leave, or the job's graceful stop
        self._stop_asked_at: float | None = None  # --sigterm stop: when the first signal asked for it
        self._last_signal = ""
        self.store: tuple[str, int] | None = None  # the job's store, once a hello reply said where
        self.store_of: str | None = None  # the controller whose reply said it (a failover moves the store)
        self.check_to_send: dict[str, object] = {}  # a health check run after a stop, for the next poll

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.standby.keep()  # its imports overlap the hello and the wait for the first order
            self._hello()
            self._claim_shared_memory()
            threading.Thread(target=self._watch_stopped, name="watch-stopped", daemon=True).start()
            return self._loop()
        except AgentStopped:
            if self._stop_asked_at is not None:
                self._ask_stop(f"{self._last_signal} again", at_once=True)
                return EXIT_CANCELLED
            self._announce_leave()
            return EXIT_NODE_LEFT if self._leaving else 0
        except ControllerUnreachable:
            print(f"undying agent {self.node}: no controller at {self.controller_address} within "
                  "node_return_timeout, stopping", file=sys.stderr)
            return EXIT_NODE_LEFT
        except Unauthorized as error:
            print(f"undying agent {self.node}: {error}", file=sys.stderr)
            return 2
        finally:
            self._stop_workers(grace=0.0)
            if self.relay is not None:
                self.relay.close()  # the workers' last lines, then no more
            self.standby.drop()
            if self.job_id:
                remove_node_dir(self.job_id, self.node)  # this node's T1 snapshots end with the job

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.sigterm is SigtermAction.STOP and self._stop_asked_at is None and not self._stopping:
            # Not here: the main thread may be inside a request; a thread asks on its own connection.
            self._stop_asked_at = time.monotonic()
            threading.Thread(target=self._ask_stop, args=(name,), name="ask-stop", daemon=True).start()
            return
        self._leaving = self._stop_asked_at is None and not self._stopping and name
        self._last_signal = name
        self._stopping = True
        raise AgentStopped()

    def _ask_stop(self, signal_name: str, at_once: bool = False) -> None:
        """--sigterm stop: ask the controller to stop the job, after persisting its newest step or
        (``at_once``) now. The workers keep running until its exit order."""
        what = "at once" if at_once else "once the newest step is persisted"
        print(f"undying agent {self.node}: {signal_name}: asking the controller to stop the job {what}"
              f"{'' if at_once else ' (the signal again: at once)'}", file=sys.stderr, flush=True)
        client = ControllerClient(self.controller_address, self.token, timeout=LEAVE_TIMEOUT, locator=self.locator)
        try:
            client.post(ROUTE_JOB_STOP, {"reason": f"{signal_name} to node {self.node}'s undying run",
                                         "now": at_once})
        except (ControllerUnreachable, Unauthorized) as error:
            print(f"undying agent {self.node}: could not ask for the stop: {error}", file=sys.stderr, flush=True)
        finally:
            client.close()

    def _announce_leave(self) -> None:
        """Stopped by a signal (a preempted or drained pod gets SIGTERM): tell the controller before the
        workers stop, so it handles a node that left (a spare, or a shrink without waiting for it),
        not a mystery. On a fresh connection: the signal may have cut a request on the main one."""
        if not self._leaving or not self.job_id or self.spare:
            return
        client = ControllerClient(self.controller_address, self.token, timeout=LEAVE_TIMEOUT, locator=self.locator)
        try:
            client.post(ROUTE_AGENT_LEAVE, AgentLeave(self.node, os.getpid(), socket.gethostname(),
                                                      f"{self._leaving} to its undying run").to_dict())
        except (ControllerUnreachable, Unauthorized):
            pass  # the controller finds the node gone when its connection closes
        finally:
            client.close()

    def _check(self, probe_root: bool) -> NodeCheck:
        """This node's health check (node_check.py); with ``node_check: false``, only the T2 root probe."""
        if not self.spec.node_check:
            check = NodeCheck()
            if probe_root and writes_t2(self.spec):
                check.root_probe, error = write_probe(t2_root(self.spec, self.run_dir))
                check.problems += [error] if error else []
            return check
        standby = self.standby.ready()
        store = self.store if self.store_of == self.controller_address else None  # not a failed-over leader's
        return check_node(self.spec, self.run_dir, self.log_dir / f"check{self.launched_as}.log",
                          decode_injections(self.injections_text), self.launched_as, store, standby, probe_root)

    def _hello(self) -> None:
        deadline = time.monotonic() + self.spec.node_return_timeout
        root = t2_root(self.spec, self.run_dir)
        check = self._check(probe_root=True)
        probe = check.root_probe
        if check.problems:
            print(f"undying agent {self.node}: health check failed: {'; '.join(check.problems)}",
                  file=sys.stderr, flush=True)
        hello = AgentHello(self.node, os.getpid(), socket.gethostname(), self.spec.nproc_per_node,
                           standby=self.spare, spec=spec_to_dict(self.spec), root_probe=probe,
                           check=check.to_dict())
        while True:
            try:
                reply = HelloReply.from_dict(self.client.post(ROUTE_AGENT_HELLO, hello.to_dict()))
            except ControllerUnreachable:
                if time.monotonic() > deadline:
                    raise
                self.client.wait_for_move(0.2)
                continue
            if not reply.accepted:
                if probe:
                    remove_probe(root, probe)  # the controller could not see it: only this node can
                raise SystemExit(f"undying agent {self.node}: controller refused: {reply.reason}")
            if reply.node >= 0 and reply.node != self.node:
                # Our node's place was taken by a spare while we were away, or this node may not hold
                # ranks (its health check failed, it was switched out): we are a spare now.
                why = reply.reason or f"node {self.node} is served by a spare now"
                print(f"undying agent {self.node}: {why}; joining as spare {reply.node}", file=sys.stderr, flush=True)
                self._stop_workers(grace=0.0)
                self.node, self.spare = reply.node, True
                self.workers, self.worker_generations, self.local_ranks = {}, {}, {}
            self.job_id = reply.job_id
            self.store = (parse_address(self.controller_address)[0], reply.store_port)
            self.store_of = self.controller_address
            return

    def _claim_shared_memory(self) -> None:
        """Own this node's T1 snapshot directory for the job, after clearing crashed jobs' leftovers."""
        try:
            remove_stale(keep_job=self.job_id)
            claim_node_dir(self.job_id, self.node)
        except OSError as error:
            # Workers then snapshot into private memory (event snapshot_unavailable): T1 is an optimization.
            print(f"undying agent {self.node}: no node shared memory for snapshots: {error}", file=sys.stderr)

    def _loop(self) -> int:
        unreachable_since: float | None = None
        while True:
            self.standby.keep()
            poll = AgentPoll(self.node, self.generation, [s.to_dict() for s in self._statuses()],
                             wait=self.spec.monitor_interval, pid=os.getpid(), hostname=socket.gethostname(),
                             check=self.check_to_send)
            try:
                order = Order.from_dict(self.client.post(ROUTE_AGENT_POLL, poll.to_dict(),
                                                         timeout=self.spec.monitor_interval + POLL_MARGIN,
                                                         held=self.spec.monitor_interval))
                unreachable_since = None
                self.check_to_send = {}  # delivered
            except ControllerUnreachable:
                # Without a controller nobody can make decisions: do not train on forever.
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > self.spec.node_return_timeout:
                    print(f"undying agent {self.node}: controller unreachable, stopping", file=sys.stderr)
                    return EXIT_NODE_LEFT
                self.client.wait_for_move(min(1.0, self.spec.monitor_interval))
                continue
            if self._stop_asked_at is not None and order.kind != OrderKind.EXIT \
                    and time.monotonic() - self._stop_asked_at > self.spec.stop_timeout + STOP_MARGIN_S:
                print(f"undying agent {self.node}: no exit order within stop_timeout "
                      f"({self.spec.stop_timeout:g} s) of the stop: stopping", file=sys.stderr, flush=True)
                return EXIT_CANCELLED
            if order.say_hello and order.kind != OrderKind.EXIT:
                self._stop_workers(grace=0.0)
                self._hello()
            elif order.kind == OrderKind.START:
                self._start_workers(order)
            elif order.kind == OrderKind.REPLACE:
                self._replace_workers(order)
            elif order.kind == OrderKind.ADOPT:
                self._adopt(order.node)
            elif order.kind == OrderKind.STOP:
                self._stop_workers(grace=self._grace())
                if self.spec.node_check:  # before the node is given ranks again (a job restart)
                    self.check_to_send = self._check(probe_root=False).to_dict()
            elif order.kind == OrderKind.EXIT:
                self._stopping = True
                self._stop_workers(grace=self._grace() if self._any_running() else 0.0)
                return max(order.exit_code, 0)  # the job's outcome (-1 from a controller that does not say)

    def _adopt(self, node: int) -> None:
        """Become ``node`` (a rescheduled pod landing on this spare): its ranks are started next."""
        print(f"undying agent {self.node}: standby agent takes the place of node {node}", file=sys.stderr,
              flush=True)
        if self.job_id:
            remove_node_dir(self.job_id, self.node)  # the spare id's (empty) T1 directory
        self.node = node
        self.standby.node = node
        self.spare = False
        self._hello()
        self._claim_shared_memory()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="undying-agent", description="undying node agent (started by undying run)")
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--controller", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--standby", action="store_true", help="a spare node: no ranks until it adopts one")
    parser.add_argument("--log-dir", help="where the workers' logs go (default RUN_DIR/logs)")
    parser.add_argument("--console-fd", type=int, help="a pipe to undying run: workers' lines for its console")
    parser.add_argument("--console-streams", default="",
                        help="the streams each local rank shows on the console (console_streams.py)")
    parser.add_argument("--sigterm", choices=[action.value for action in SigtermAction], default=SigtermAction.LEAVE,
                        help="SIGTERM/SIGINT: leave the job, or stop it after persisting its newest step")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if os.environ.get(ENV_DIE_WITH_PARENT) == "1":
        die_with_parent()
    spec = spec_from_json(os.environ[ENV_SPEC])
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    console = None if args.console_fd is None else PipeSink(args.console_fd)
    relay = None if console is None else OutputRelay(console, ConsoleStreams.from_text(args.console_streams))
    agent = Agent(args.node, spec, args.controller, os.environ[ENV_TOKEN], Path(args.run_dir), command,
                  os.environ.get(ENV_INJECT, ""), spare=args.standby,
                  log_dir=Path(args.log_dir) if args.log_dir else None, relay=relay,
                  sigterm=SigtermAction(args.sigterm))
    try:
        return agent.run()
    finally:
        if console is not None:
            console.close()  # the undying run process's reader ends with the pipe


if __name__ == "__main__":
    sys.exit(main())
