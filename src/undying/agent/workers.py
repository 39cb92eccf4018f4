"""The node's worker processes as its agent runs them: started, replaced, watched, reported, stopped.

Runs in the node agent: ``node_agent.Agent`` is a ``NodeWorkers``, which holds the node's worker
processes and what the agent does with them on the controller's orders (start a generation, replace
some ranks, stop them all), and tells the controller of each change the moment it sees it: a worker
that exited (with its log's last lines and its exception), or one stopped (SIGSTOP: a hang) or
continued, between such reports beating every ``agent_beat_interval`` (0.25 s by default). Each
worker is forked from the node's warm standby when it has one (``warm_standby.py``), else started
as a plain process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from undying.agent.node_standby import StandbyKeeper
from undying.agent.output_relay import OutputRelay
from undying.agent.procs import WorkerProcess, child_setup, signal_name, stop_processes
from undying.agent.stopped_workers import STOPPED_CHECK_EVERY, StoppedWorkers
from undying.agent.worker_logs import WorkerLogs
from undying.client import ControllerClient, ControllerUnreachable, Unauthorized, parse_address
from undying.config import JobSpec
from undying.launch.launch_options import SigtermAction
from undying.log_tail import read_tail
from undying.protocol import ROUTE_AGENT_REPORT, AgentPoll, Order, WorkerState, WorkerStatus
from undying.worker_env import WorkerEnv

ENV_DIE_WITH_PARENT = "UNDYING_AGENT_DIE_WITH_PARENT"
ENV_WARM = "UNDYING_WARM_STANDBY"  # "1" in a worker forked from the node's warm standby


class NodeWorkers:
    """The worker processes of one node, as its agent starts, watches, reports and stops them.

    The node's identity, the job and the link to the controller are the agent's (``Agent.__init__``
    sets them); this part owns the processes and what is known of each."""

    node: int
    spec: JobSpec
    token: str
    run_dir: Path
    log_dir: Path
    relay: OutputRelay | None
    command: list[str]
    injections_text: str
    locator: Callable[[], str | None] | None  # a failover job's: where the controller is now
    client: ControllerClient
    job_id: str
    generation: int
    standby: StandbyKeeper
    sigterm: SigtermAction
    _stopping: bool

    def __init__(self) -> None:
        self.workers: dict[int, WorkerProcess] = {}
        self.worker_generations: dict[int, int] = {}  # rank -> generation its process was started in
        self.local_ranks: dict[int, int] = {}
        self.log_paths: dict[int, Path] = {}  # rank -> the log its current process writes
        # rank -> (its process that ended badly, the log's last lines, the exception line): read once
        self.exit_notes: dict[int, tuple[WorkerProcess, list[str], str]] = {}
        self.stopped_workers = StoppedWorkers()

    @property
    def controller_address(self) -> str:
        return self.client.address

    def _grace(self) -> float:
        return self.spec.grace_period if self.spec.fault_scheduling == "grace" else 0.0

    def _any_running(self) -> bool:
        return any(process.poll() is None for process in self.workers.values())

    def _statuses(self) -> list[WorkerStatus]:
        statuses = []
        for rank, process in list(self.workers.items()):
            code = process.poll()
            if code is not None:
                state = WorkerState.EXITED
            elif self.stopped_workers.is_stopped(process.pid):
                state = WorkerState.STOPPED
            else:
                state = WorkerState.RUNNING
            tail, error = self._exit_note(rank, process) if code else ([], "")
            statuses.append(WorkerStatus(
                rank=rank, local_rank=self.local_ranks[rank], pid=process.pid,
                generation=self.worker_generations[rank], state=state, exitcode=code, signal=signal_name(code),
                error=error, log_tail=tail))
        return statuses

    def _exit_note(self, rank: int, process: WorkerProcess) -> tuple[list[str], str]:
        """A worker that ended badly: its log's last lines and its exception, read once per process."""
        note = self.exit_notes.get(rank)
        if note is None or note[0] is not process:
            tail, error = read_tail(self.log_paths[rank]) if rank in self.log_paths else ([], "")
            note = self.exit_notes[rank] = (process, tail, error)
        return note[1], note[2]

    def _start_workers(self, order: Order) -> None:
        """A new generation of the whole job: every worker of this node starts afresh."""
        self._stop_workers(grace=0.0)
        self.workers = {}
        self.worker_generations = {}
        self.generation = order.generation
        self.local_ranks = {rank: local for local, rank in enumerate(order.ranks)}
        for rank in order.ranks:
            self._spawn(rank, order, joining=False)

    def _replace_workers(self, order: Order) -> None:
        """Process-level recovery: restart only these ranks; the node's other workers keep running."""
        self.generation = max(self.generation, order.generation)
        stop_processes([self.workers[rank] for rank in order.ranks if rank in self.workers], grace=0.0)
        for rank in order.ranks:
            if rank not in self.local_ranks:
                self.local_ranks[rank] = rank % self.spec.nproc_per_node
            self._spawn(rank, order, joining=True)

    def _spawn(self, rank: int, order: Order, joining: bool) -> None:
        master_addr, _ = parse_address(self.controller_address)
        worker_env = WorkerEnv(
            rank=rank, local_rank=self.local_ranks[rank], world_size=order.world_size,
            local_world_size=self.spec.nproc_per_node, node=self.node, generation=order.generation,
            restart_count=order.restart_count, joining=joining, controller=self.controller_address,
            token=self.token, job_id=self.job_id, run_dir=self.run_dir, spec=self.spec,
            injections_text=self.injections_text, store_prefix=f"undying/{self.job_id}",
            master_addr=master_addr, master_port=order.store_port, members=tuple(order.members))
        env = {**os.environ, **worker_env.to_environ()}
        env.pop(ENV_DIE_WITH_PARENT, None)
        logs = WorkerLogs(self.log_dir, rank, self.local_ranks[rank], self.relay)
        # Its traceback is in the stderr log where the streams are split (output_relay.worker_log_paths).
        self.log_paths[rank] = logs.stderr_path or logs.stdout_path
        standby = self.standby.ready()
        labels = ["replacement"] * joining + ["warm standby"] * (standby is not None)
        kind = f" ({', '.join(labels)})" if labels else ""
        logs.note(f"generation {order.generation}{kind}")
        process: WorkerProcess | None = None
        if standby is not None:
            process = standby.fork({**env, ENV_WARM: "1"}, self.command, logs.stdout_path, logs.stderr_path)
            if process is None:
                logs.note("the warm standby is gone: started as a plain python process")
        if process is None:
            process = subprocess.Popen(self.command, env=env, stdout=logs.stdout, stderr=logs.stderr or subprocess.STDOUT,
                                       preexec_fn=child_setup(self.sigterm is SigtermAction.STOP))
        logs.started()
        # Its generation first: the reporting threads read both for every rank in ``workers``.
        self.worker_generations[rank] = order.generation
        self.workers[rank] = process
        threading.Thread(target=self._report_exit, args=(rank, process), name=f"wait-rank{rank}",
                         daemon=True).start()

    def _report_exit(self, rank: int, process: WorkerProcess) -> None:
        """Tell the controller the moment a worker ends, instead of at the next monitor tick."""
        process.wait()
        if self._stopping or self.workers.get(rank) is not process:
            return
        self._report([rank])

    def _watch_stopped(self) -> None:
        """Tell the controller the moment a worker is stopped (or continued), instead of it waiting
        out heartbeat_timeout: the agent's own poll may be held for monitor_interval. Between such
        reports, beat every ``spec.agent_beat_interval()``, on a fixed cadence: the controller tells
        a frozen host (agent and ranks silent together) from a hung rank (its agent still beats) by
        it, and one beat late under load must not make a live host look frozen."""
        every = self.spec.agent_beat_interval()
        next_beat = time.monotonic()
        client = ControllerClient(self.controller_address, self.token,
                                  timeout=max(2.0, 3 * self.spec.heartbeat_interval), locator=self.locator)
        while not self._stopping:
            running = {rank: process.pid for rank, process in list(self.workers.items()) if process.poll() is None}
            now = time.monotonic()
            changed = self.stopped_workers.observe(running, now)
            if (changed or now >= next_beat) and not self._stopping:
                self._report(changed, client)
            if now >= next_beat:
                next_beat += every  # on the cadence: a late beat does not push the next ones back
                if next_beat <= now:
                    next_beat = now + every
            time.sleep(max(0.0, min(STOPPED_CHECK_EVERY, next_beat - time.monotonic())))
        client.close()

    def _report(self, ranks: list[int], client: ControllerClient | None = None) -> None:
        """The statuses of ``ranks`` (none: a beat) on a connection other than the poll's: the
        watching thread's own ``client``, or one opened for this report."""
        status = [s.to_dict() for s in self._statuses() if s.rank in ranks]
        own = client or ControllerClient(self.controller_address, self.token, timeout=5.0, locator=self.locator)
        try:
            own.post(ROUTE_AGENT_REPORT, AgentPoll(self.node, self.generation, status, wait=0.0, pid=os.getpid(),
                                                   hostname=socket.gethostname()).to_dict())
        except (ControllerUnreachable, Unauthorized):
            pass  # the next poll carries the same status
        finally:
            if client is None:
                own.close()

    def _stop_workers(self, grace: float) -> None:
        stop_processes(list(self.workers.values()), grace)
