"""``undying run``: starts the controller on node 0 and the node agents, and waits for the job.

Runs in the ``undying run`` process. With ``--nnodes N`` and no ``--node-rank`` it
simulates N nodes on this machine: one agent process per node, each leading its own
process group (killing that group is a node dying), respawned when it dies as a
rescheduled pod would be. ``--standby K`` adds K spare agents (node ids from N on)
that take a lost node's place at once; with spares, a dead node's agent comes back
as a new spare rather than as itself. With ``--node-rank R`` it is one node of a
real multi-node job: node 0 hosts the controller and its own agent, the others run
an agent that joins ``--controller HOST:PORT`` (``--standby`` there: a spare node).

The console (``terminal.py``) shows the job's events, a live progress line where the controller
runs (``progress.py``), and the output of this machine's workers: each agent relays its workers'
log lines (``agent/output_relay.py``), an agent process of its own through a pipe this process reads,
the agent of ``--node-rank R > 0`` (in this process) directly.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from undying import events as ev
from undying.agent.console_streams import STDERR, STDOUT
from undying.agent.output_relay import OutputRelay
from undying.agent.procs import die_with_parent, kill_group
from undying.client import format_address
from undying.controller import Controller, ControllerServer, JobState, JobStore
from undying.events import EventLog
from undying.launch.console import emit_job_start, print_event
from undying.launch.controller_files import ControllerRecord, remove_controller_files, write_controller_files
from undying.launch.launch_options import LaunchOptions
from undying.launch.progress import Progress
from undying.launch.terminal import Terminal, is_live_terminal
from undying.root_probe import t2_root, writes_t2
from undying.shm import remove_job_dir, remove_node_dir
from undying.tls import ENV_TLS_CA, tls_environ
from undying.worker_env import ENV_INJECT, ENV_SPEC, ENV_TOKEN

RESPAWN_DELAY = 0.2


class LocalAgents:
    """The agent processes this launcher started, and their respawning when one dies."""

    def __init__(self, options: LaunchOptions, controller_address: str, token: str, terminal: Terminal) -> None:
        self.options = options
        self.controller_address = controller_address
        self.token = token
        self.terminal = terminal
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.console_readers: list[threading.Thread] = []
        self.controller: Controller | None = None
        self.job_id = ""  # set by launch(): names the job's node shared-memory directories
        self._lock = threading.Lock()
        self._closing = False

    def start(self, node: int, spare: bool = False) -> None:
        """Start node's agent and a thread that respawns it whenever it dies (until the job ends).

        The same thread spawns every later incarnation: PR_SET_PDEATHSIG fires when the
        *thread* that forked a child exits, so a short-lived respawn thread would kill
        the agent it just started.
        """
        threading.Thread(target=self._keep_alive, args=(node, spare), name=f"agent{node}", daemon=True).start()

    def new_spare_id(self) -> int:
        assert self.controller is not None
        return self.controller.reserve_spare_id()  # one allocator: ids are never reused

    def _spawn(self, node: int, spare: bool = False) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env.update(self.options.extra_env)
        env[ENV_TOKEN] = self.token
        env[ENV_SPEC] = self.options.spec.model_dump_json()
        env[ENV_INJECT] = self.options.injections_text
        env["UNDYING_AGENT_DIE_WITH_PARENT"] = "1"
        console_read, console_write = os.pipe()  # the agent's workers' lines, for this console
        command = [sys.executable, "-m", "undying.agent.node_agent", "--node", str(node),
                   "--controller", self.controller_address, "--run-dir", str(self.options.run_dir),
                   "--log-dir", str(self.options.worker_log_dir), "--console-fd", str(console_write),
                   "--console-streams", self.options.streams().to_text(), "--sigterm", self.options.sigterm,
                   *(["--standby"] if spare else []), "--", *self.options.command]
        log = open(self.options.worker_log_dir / f"agent{node}.log", "ab")  # noqa: SIM115 - child's
        try:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       pass_fds=(console_write,), start_new_session=True,
                                       preexec_fn=die_with_parent)
        except BaseException:
            os.close(console_read)
            raise
        finally:
            log.close()
            os.close(console_write)
        reader = threading.Thread(target=show_agent_lines, args=(console_read, self.terminal),
                                  name=f"console{node}", daemon=True)
        reader.start()
        with self._lock:
            self.processes[node] = process
            self.console_readers.append(reader)
        return process

    def _keep_alive(self, node: int, spare: bool) -> None:
        process = self._spawn(node, spare)
        while True:
            returncode = process.wait()
            # The workers die with their agent (same process group and PDEATHSIG); make sure of it.
            kill_group(process.pid)
            if self.job_id:
                # A lost node loses its memory: its T1 snapshots go with it, as on a real node.
                remove_node_dir(self.job_id, node)
            controller = self.controller
            if self._closing or controller is None:
                return
            controller.report_agent_exit(node, returncode)
            if not self.options.respawn_lost_nodes or controller.state.terminal:
                return
            time.sleep(RESPAWN_DELAY)
            # An injected `node:...:down=D` keeps the simulated node away that long (elastic tests).
            while controller.node_down_remaining(node) > 0 and not self._closing and not controller.state.terminal:
                time.sleep(0.2)
            if self._closing or controller.state.terminal:
                return
            if self.options.standby_agents > 0:
                # The machine comes back as spare capacity: a spare may already serve this node.
                node, spare = self.new_spare_id(), True
            controller.emit(ev.AGENT_RESPAWNED, node=node, details={"previous_returncode": returncode,
                                                                   "standby": spare})
            process = self._spawn(node, spare)

    def kill_node(self, node: int) -> None:
        """Called when the controller declares a node lost: make sure it is really gone."""
        agent_id = self.controller.agent_id_of(node) if self.controller is not None else node
        with self._lock:
            process = self.processes.get(agent_id)
        if process is not None and process.poll() is None:
            kill_group(process.pid)

    def close(self, grace: float) -> None:
        self._closing = True
        deadline = time.monotonic() + grace
        with self._lock:
            processes = list(self.processes.values())
        for process in processes:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                pass
            kill_group(process.pid)
            process.wait()
        with self._lock:
            readers = list(self.console_readers)
        for reader in readers:  # the agents' last lines: each pipe ends when its agent has exited
            reader.join(timeout=max(0.0, deadline + 2.0 - time.monotonic()))


def show_agent_lines(pipe_fd: int, terminal: Terminal) -> None:
    """Put the lines an agent relays (``STREAM TEXT``, output_relay.PipeSink) on the console, until
    the agent closes its end."""
    with open(pipe_fd, "rb") as pipe:
        for raw in pipe:
            stream = STDERR if raw.startswith(b"2") else STDOUT
            terminal.lines([(stream, raw[2:].rstrip(b"\n").decode("utf-8", errors="replace"))])


def console_for(options: LaunchOptions) -> Terminal:
    """This process's console for the job: live (a progress line) on a terminal, unless --quiet."""
    return Terminal(live=not options.quiet and is_live_terminal(sys.stderr))


def launch(options: LaunchOptions) -> int:
    """Run a whole job (or this node's part of it); returns the exit code for the CLI."""
    options.run_dir.mkdir(parents=True, exist_ok=True)
    options.worker_log_dir.mkdir(parents=True, exist_ok=True)
    # This process's clients, its agents and their workers verify the controller and etcd with these
    # (as they learn the etcd endpoint: from the environment they inherit).
    os.environ.update(tls_environ(options.tls_ca, options.etcd_tls))
    with console_for(options) as terminal:
        if options.etcd:
            from undying.launch.ha_node import run_ha_node

            return run_ha_node(options, terminal)
        if options.node_rank is not None and options.node_rank > 0:
            return _run_remote_agent(options, terminal)
        return _run_controller_node(options, terminal)


def _run_controller_node(options: LaunchOptions, terminal: Terminal) -> int:
    """The controller here, with every simulated node's agent, or node 0's of a real job."""
    token = options.token or secrets.token_hex(16)
    job_id = secrets.token_hex(6)
    spec = options.spec
    events = EventLog(options.run_dir)
    if not options.quiet:
        events.add_listener(print_event)
        progress = Progress()
        events.add_listener(progress.on_event)
        terminal.progress = progress.line
    bind_port = 0
    advertised_host = None  # the name other nodes reach this one by (--controller HOST:PORT)
    if options.controller_address:
        from undying.client import parse_address
        advertised_host, bind_port = parse_address(options.controller_address)
    wildcard = options.controller_bind in ("0.0.0.0", "::")
    connect_host = "127.0.0.1" if wildcard else options.controller_bind
    # Recovery plans name the store to every worker, on every node: an address of this machine
    # that the others can reach, not loopback (unless every node is simulated here).
    store_host = advertised_host if wildcard and advertised_host and options.node_rank is not None else connect_host
    server_tls = options.tls.context() if options.tls is not None else None
    store = JobStore(options.controller_bind, token, timeout=spec.start_timeout, tls=server_tls)
    agents_holder: list[LocalAgents] = []
    controller = Controller(spec, events, job_id, store.port, options.injections_text,
                            on_node_lost=lambda node: agents_holder[0].kill_node(node) if agents_holder else None,
                            store_host=store_host,
                            t2_root=t2_root(spec, options.run_dir) if writes_t2(spec) else None)
    store.on_refused = lambda client, why: controller.emit(ev.AUTH_REFUSED, details={
        "service": "store", "client": client, "why": why})
    server = ControllerServer(controller, token, options.controller_bind, bind_port, tls=server_tls)
    server.start()
    agents = LocalAgents(options, format_address(connect_host, server.port), token, terminal)
    agents.controller = controller
    agents.job_id = job_id
    agents_holder.append(agents)
    emit_job_start(controller, options, server.address, store.port, job_id)
    # `undying status RUN_DIR` finds the controller and its token here while the job runs.
    write_controller_files(options.run_dir, ControllerRecord(agents.controller_address, job_id, os.getpid(),
                                                             tls_ca=os.environ.get(ENV_TLS_CA)), token)

    signals_received: list[str] = []

    def on_signal(signum: int, frame: object) -> None:
        # The first signal stops the job after its newest committed step is persisted; another, at once.
        # Another to this process: in a Slurm step every node gets the signal, and another node's
        # request for the same stop may reach the controller before this one.
        name = signal.Signals(signum).name
        at_once = bool(signals_received)
        signals_received.append(name)
        if not options.quiet and not at_once and controller.state is JobState.RUNNING:
            print(f"[undying] {name}: stopping once the newest step is persisted ({name} again: at once)",
                  file=sys.stderr, flush=True)
        controller.request_stop(f"{'received ' + name if not at_once else name + ' again'}", at_once=at_once)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    local_nodes = range(spec.nnodes) if options.node_rank is None else [0]
    try:
        for node in local_nodes:
            agents.start(node)
        if options.node_rank is None:
            for _ in range(options.standby_agents):
                agents.start(agents.new_spare_id(), spare=True)
        exit_code = controller.run()
    finally:
        agents.close(grace=5.0)
        remove_job_dir(job_id)  # T1 snapshots of nodes whose agent could not remove them itself
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop()
        store.close()
        remove_controller_files(options.run_dir)
        events.close()
    assert exit_code is not None  # only a failover job's controller (ha_node.py) is ever deposed
    if exit_code != 0:
        print(f"undying: job {controller.state.value}: {controller.message}", file=sys.stderr)
    return exit_code


def _run_remote_agent(options: LaunchOptions, terminal: Terminal) -> int:
    from undying.agent.node_agent import Agent

    if not options.controller_address or not options.token:
        print("undying: error: --node-rank > 0 needs --controller HOST:PORT and --token-file", file=sys.stderr)
        return 2
    assert options.node_rank is not None
    agent = Agent(options.node_rank, options.spec, options.controller_address, options.token,
                  options.run_dir, options.command, options.injections_text, spare=options.standby_agents > 0,
                  log_dir=options.worker_log_dir, relay=OutputRelay(terminal, options.streams()),
                  sigterm=options.sigterm)
    return agent.run()
