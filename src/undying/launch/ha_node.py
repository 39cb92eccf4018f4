"""One node of a job whose controller fails over (``undying run --etcd HOST:PORT --job-name NAME``).

Runs in the ``undying run`` process of every node: a controller candidate (a thread)
and the node's agent (the main thread). Candidates campaign for an etcd lease
(controller/ha.py); the winner starts a controller, its HTTP endpoint and a store,
publishes their addresses in etcd and saves the controller's state there at every
change. When the leader's node dies (or it loses etcd for a lease's length), its
lease expires, another node's candidate wins, loads the saved state and carries on:
a running generation keeps running, the dead node is lost like any other node and
recovered by the job's strategy chain. Agents and workers find the controller, and
the store of each new generation, through etcd, so rank 0 and the controller's node
are recoverable like any other. SIGTERM to one node's ``undying run`` is that node's planned
leave (``--sigterm leave``), or asks for the whole job's graceful stop (``--sigterm stop``, the
default in a Slurm step), as ``undying stop`` does; its exit code is the job's outcome as saved in etcd.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time

from undying import events as ev
from undying.agent.node_agent import Agent
from undying.agent.output_relay import OutputRelay
from undying.client import format_address
from undying.controller import Controller, ControllerServer, JobState, JobStore
from undying.controller.ha import Candidate, saved_state
from undying.etcd import EtcdUnavailable
from undying.events import EventLog
from undying.launch.console import emit_job_start, print_event
from undying.launch.controller_files import ControllerRecord, remove_controller_files, write_controller_files
from undying.launch.launch_options import LaunchOptions
from undying.launch.progress import Progress
from undying.launch.terminal import Terminal
from undying.locate import ENV_ETCD, ENV_HA_JOB, locate_controller
from undying.root_probe import t2_root, writes_t2
from undying.shm import remove_job_dir
from undying.tls import ENV_TLS_CA, ClientTls

BACKUP_REFRESH_S = 1.0
EXIT_BY_STATE = {JobState.SUCCEEDED.value: 0, JobState.FAILED.value: 1, JobState.CANCELLED.value: 130,
                 JobState.STOPPED.value: 75}


class ControllerCandidate(threading.Thread):
    """Campaigns for the job's leadership and, while leading, runs the controller."""

    def __init__(self, options: LaunchOptions, token: str, initial: dict | None, terminal: Terminal) -> None:
        super().__init__(name="controller-candidate", daemon=True)
        assert options.etcd and options.job_name
        self.options = options
        self.token = token
        self.terminal = terminal  # while this node leads, its console shows the job's progress line
        self.stop = threading.Event()
        self.exit_code: int | None = None  # set when this node's controller ended the job
        # The job this process was started for: a finished state of an earlier job with the same
        # name may be replaced; a finished state of any other job is ours having ended.
        self.initial_job = initial.get("job_id") if initial and JobState(initial["state"]).terminal else None
        bind = options.controller_bind
        self.advertise = socket.gethostname() if bind in ("0.0.0.0", "::") else bind
        self.store: JobStore | None = None
        self.server_tls = options.tls.context() if options.tls is not None else None

    def run(self) -> None:
        spec = self.options.spec
        # A warm candidate: torch.distributed imported and the store listening before it is needed.
        self.store = JobStore(self.options.controller_bind, self.token, timeout=spec.start_timeout,
                              tls=self.server_tls)
        while not self.stop.is_set():
            candidate = Candidate(self.options.etcd or "", self.options.job_name or "", self.options.lease_ttl,
                                  node=self.options.node_rank if self.options.node_rank is not None else -1,
                                  store=format_address(self.advertise, self.store.port), tls=self.options.etcd_tls)
            if not candidate.campaign(self.stop):
                return
            if self._lead(candidate):
                return

    def _lead(self, candidate: Candidate) -> bool:
        """Run the controller while we lead; True when the job ended here (or is over)."""
        assert self.store is not None
        options, spec = self.options, self.options.spec
        saved = candidate.load_state()
        if saved is not None and JobState(saved["state"]).terminal:
            if saved.get("job_id") != self.initial_job:
                candidate.resign()  # our job is over; whoever ended it already told the agents
                return True
            saved = None  # an earlier job that used the same name: start afresh
        events = EventLog(options.run_dir)
        if not options.quiet:
            events.add_listener(print_event)
            progress = Progress()
            events.add_listener(progress.on_event)
            self.terminal.progress = progress.line
        job_id = saved["job_id"] if saved else secrets.token_hex(6)
        controller = Controller(spec, events, job_id, self.store.port, options.injections_text,
                                store_host=self.advertise, save_state=candidate.save_state,
                                t2_root=t2_root(spec, options.run_dir) if writes_t2(spec) else None)
        server = ControllerServer(controller, self.token, options.controller_bind, 0, tls=self.server_tls)
        self.store.on_refused = lambda client, why: controller.emit(ev.AUTH_REFUSED, details={
            "service": "store", "client": client, "why": why})
        candidate.on_lost = controller.depose
        controller.in_charge = candidate.in_charge
        if saved is not None:
            controller.resume(saved, why="the previous leader's etcd lease expired", live=candidate.live_processes())
        server.start()
        address = format_address(self.advertise, server.port)
        candidate.publish(address, controller.store_address, epoch=int(time.time() * 1000))
        controller.emit(ev.CONTROLLER_LEADER, node=options.node_rank, details={
            "controller": address, "store": controller.store_address, "candidate": candidate.id,
            "pid": os.getpid(), "resumed": saved is not None})
        if saved is None:
            emit_job_start(controller, options, address, self.store.port, job_id)
        etcd_tls = options.etcd_tls
        write_controller_files(options.run_dir, ControllerRecord(
            address, job_id, os.getpid(), options.etcd, options.job_name, tls_ca=os.environ.get(ENV_TLS_CA),
            etcd_ca=etcd_tls.ca if etcd_tls else None, etcd_cert=etcd_tls.cert if etcd_tls else None,
            etcd_key=etcd_tls.key if etcd_tls else None), self.token)
        threading.Thread(target=self._name_backup_store, args=(candidate, controller), daemon=True,
                         name="backup-store").start()
        exit_code = controller.run()
        if exit_code is None:
            controller.emit(ev.CONTROLLER_DEPOSED, node=options.node_rank,
                            details={"why": candidate.lost_reason or "lost the etcd lease"})
            self.terminal.progress = None  # another node leads: its console has the job's progress
            server.stop()
            events.close()
            return False  # campaign again: we may lead later
        self.exit_code = exit_code
        self.store.close()
        remove_job_dir(job_id)
        remove_controller_files(options.run_dir)
        server.stop()
        candidate.resign()
        events.close()
        return True

    @staticmethod
    def _name_backup_store(candidate: Candidate, controller: Controller) -> None:
        """Keep naming a live candidate's store on another node as the workers' second RNG mirror."""
        while candidate.leading.is_set() and not controller.state.terminal:
            controller.backup_store = candidate.backup_store()
            time.sleep(BACKUP_REFRESH_S)


def wait_for_leader(endpoint: str, job: str, timeout: float, tls: ClientTls | None) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        address = locate_controller(endpoint, job, tls=tls)
        if address:
            return address
        time.sleep(0.1)
    return None


def run_ha_node(options: LaunchOptions, terminal: Terminal) -> int:
    """This node's part of a failover job; returns the job's exit code as saved in etcd."""
    if not options.token or options.node_rank is None or not options.etcd or not options.job_name:
        print("undying: error: --etcd needs --job-name, --node-rank and --token-file", file=sys.stderr)
        return 2
    os.environ[ENV_ETCD] = options.etcd  # the agent's workers inherit it: they follow the controller too
    os.environ[ENV_HA_JOB] = options.job_name
    try:
        initial = saved_state(options.etcd, options.job_name, options.etcd_tls)
    except EtcdUnavailable as error:
        print(f"undying: error: {error}", file=sys.stderr)
        return 2
    candidate = ControllerCandidate(options, options.token, initial, terminal)
    candidate.start()
    address = wait_for_leader(options.etcd, options.job_name, options.spec.node_return_timeout, options.etcd_tls)
    if address is None:
        candidate.stop.set()
        print(f"undying: error: no controller of job {options.job_name} appeared in etcd "
              f"{options.etcd} within node_return_timeout", file=sys.stderr)
        return 1
    agent = Agent(options.node_rank, options.spec, address, options.token, options.run_dir, options.command,
                  options.injections_text, spare=options.standby_agents > 0, log_dir=options.worker_log_dir,
                  relay=OutputRelay(terminal, options.streams()), sigterm=options.sigterm)
    agent_code = agent.run()
    candidate.stop.set()
    candidate.join()
    if candidate.exit_code is not None:
        return candidate.exit_code
    try:
        final = saved_state(options.etcd, options.job_name, options.etcd_tls)
    except EtcdUnavailable:
        return agent_code
    return EXIT_BY_STATE.get(final["state"], agent_code) if final else agent_code
