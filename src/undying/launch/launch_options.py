"""What ``undying run`` was asked to do: the job spec, the worker command and this node's part.

Runs in the ``undying run`` process. Built by the CLI and read by the launcher
(``launcher.py``) and, for a failover job, by the node's candidate (``ha_node.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from undying.agent.console_streams import ConsoleStreams
from undying.config import JobSpec
from undying.tls import ClientTls, ServerTls


class SigtermAction(StrEnum):
    """What SIGTERM (or SIGINT) to the ``undying run`` of a node that does not host the controller does
    (``--sigterm``); node 0's always stops the job gracefully."""

    LEAVE = "leave"  # the node leaves the job: a spare takes its place, or elastic training shrinks
    # The whole job stops once every rank persisted its newest committed step (POST /v1/job/stop), and
    # the node's workers ignore the signal: a Slurm step's time limit or preemption signals every task
    # (and, under most process trackers, every process) of the step at once.
    STOP = "stop"


@dataclass
class LaunchOptions:
    """One ``undying run`` invocation, as the CLI parsed and checked it."""

    spec: JobSpec
    command: list[str]  # the worker command: python SCRIPT ARGS
    run_dir: Path
    node_rank: int | None = None  # None: simulate every node here
    controller_address: str | None = None  # host:port to join (node_rank > 0) or to bind (node 0)
    controller_bind: str = "127.0.0.1"
    token: str | None = None
    injections_text: str = ""
    respawn_lost_nodes: bool = True
    standby_agents: int = 0  # simulated spare nodes (local); remote: this agent is a spare
    quiet: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    etcd: str | None = None  # host:port: controller failover (every node a candidate; ha_node.py)
    job_name: str | None = None  # the job's key prefix in etcd
    lease_ttl: int = 2  # seconds a dead leader keeps its lease (how long a failover waits)
    log_dir: Path | None = None  # the workers' logs (--log-dir); None: RUN_DIR/logs
    # Which streams of each local rank the console shows (--redirects, --tee, --local-ranks-filter);
    # None: every stream of every rank.
    console_streams: ConsoleStreams | None = None
    sigterm: SigtermAction = SigtermAction.LEAVE  # --sigterm: the agent's answer to SIGTERM/SIGINT
    # TLS (tls.py): the controller's certificate and key where a controller runs here (node 0, or
    # every candidate of a failover job); the CA every client of this node verifies it with; etcd's.
    tls: ServerTls | None = None
    tls_ca: str | None = None
    etcd_tls: ClientTls | None = None

    @property
    def worker_log_dir(self) -> Path:
        return self.log_dir or self.run_dir / "logs"

    @property
    def controller_tls(self) -> ClientTls | None:
        """How this node's own clients verify the controller (None: plain HTTP)."""
        return ClientTls(self.tls_ca) if self.tls_ca else None

    def streams(self) -> ConsoleStreams:
        return self.console_streams or ConsoleStreams.everything(self.spec.nproc_per_node)
