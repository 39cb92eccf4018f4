"""Who is in the job: each node's agent, each rank's current process, and the generation's members.

Runs in the controller, inside the job machine (no threads, no clock: every time is given).
The layout is fixed by the spec: node ``n`` serves ranks ``n * nproc_per_node ...``; a spare
agent serves none until it adopts a lost node's place.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from undying.mesh_rows import incomplete_rows
from undying.protocol import Order, Phase, WorkerState, WorkerStatus


@dataclass
class NodeRecord:
    """What the controller knows of one node's agent."""

    node: int
    pid: int
    hostname: str
    last_seen: float
    alive: bool = True
    generation: int = 0
    workers: dict[int, WorkerStatus] = field(default_factory=dict)
    orders: collections.deque[Order] = field(default_factory=collections.deque)
    exit_delivered: bool = False
    standby: bool = False  # a spare: no ranks; takes over a lost node's place when ordered to
    confirmed: bool = True  # False: known only from a failed-over controller's saved state, not polled yet
    gone: bool = False  # unconfirmed, and its process held no etcd lease at the takeover (controller/ha.py)
    adopting: int | None = None  # the node whose place this spare was ordered to take
    disconnected_since: float | None = None  # its poll connection closed then, and it has not polled since
    last_heard: float | None = None  # its newest request of any kind (poll, report, beat) arrived then
    unfit: str = ""  # why this agent's node may not hold ranks (a failed health check, switched out)
    check_due: bool = False  # a job restart stopped its workers: its health check's new result is awaited

    def running_workers(self) -> list[WorkerStatus]:
        # A stopped (SIGSTOP) process is alive too: it holds its rank until its agent kills it.
        return [status for status in self.workers.values() if status.state != WorkerState.EXITED]

    def polled_by_owner(self, pid: int, hostname: str) -> bool:
        """The poll comes from the agent that holds the node's place (not one that was away while a
        spare adopted it): same pid on the same host. A record restored from an older saved state
        (without them) learns its agent's here."""
        if not self.confirmed and self.pid == 0:
            self.pid = pid
            self.hostname = hostname or self.hostname
        same_host = not hostname or not self.hostname or hostname == self.hostname
        return not pid or not self.pid or (pid == self.pid and same_host)


@dataclass
class RankRecord:
    """What the controller knows of one rank's current process."""

    rank: int
    node: int
    spawn_generation: int  # the generation its process was started in (matches agent reports)
    started_at: float
    last_heartbeat: float | None = None
    last_logged: float = 0.0
    logged_step: int | None = None
    step: int = 0
    phase: str = Phase.STARTING
    last_progress: float | None = None  # when ``step`` last changed (the step-progress watchdog)
    hang_reported_step: int | None = None  # watchdog off/detect-only: the step a hang was logged at
    pid: int | None = None
    done: bool = False
    done_at: float | None = None
    exitcode: int | None = None
    signal: str | None = None
    error: str = ""  # an exit's exception line, as its agent read it from the log
    log_tail: tuple[str, ...] = ()  # ... and the log's last lines
    step_known: bool = True  # False: restored by a failover and not heard from since
    committing: int = 0  # the step whose T2 checkpoint its persister commits, per its newest beat (0: none)


class Membership:
    """The nodes, the current generation's ranks and members, and which spare serves which node."""

    def __init__(self, nnodes: int, nproc_per_node: int) -> None:
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node
        self.nodes: dict[int, NodeRecord] = {}
        self.ranks: dict[int, RankRecord] = {}  # the current generation's members only
        self.members: list[int] = []  # ranks of the current generation, in process-group order
        self.adopted_by: dict[int, int] = {}  # node -> the spare agent id that took its place
        self.last_spare_id = -1
        # Agents (host, pid) switched out of the job (a straggler, a transient bad step): never given
        # ranks again, and why. And the node places whose agent failed its health check (a spare takes them).
        self.retired: dict[tuple[str, int], str] = {}
        self.unfit_places: set[int] = set()
        # A sharded job's ranks per replica (ft.device_mesh's shard, from the workers' heartbeats);
        # 0: data parallel, or not heard yet. Rank r sits in replica r // mesh_shard.
        self.mesh_shard = 0
        self.mesh_peer_copies = False  # a one-replica mesh's T1 is copied to the next node

    def incomplete_replicas(self, members: list[int] | set[int]) -> list[int]:
        """The replicas of a sharded job of which ``members`` hold some ranks but not all (none for a
        data-parallel job): a shard's rank has no stand-in within its replica, so a generation of a
        sharded job is made of whole replicas."""
        return incomplete_rows(members, self.mesh_shard) if self.mesh_shard else []

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.nproc_per_node, (node + 1) * self.nproc_per_node))

    def node_of(self, rank: int) -> int:
        return rank // self.nproc_per_node

    def node_alive(self, node: int) -> bool:
        record = self.nodes.get(node)
        return record is not None and record.alive

    def alive_nodes(self) -> set[int]:
        """Nodes whose agent is alive and serves ranks (spares excluded)."""
        return {n.node for n in self.nodes.values() if n.alive and not n.standby}

    def all_nodes_alive(self) -> bool:
        return self.alive_nodes() == set(range(self.nnodes))

    def missing_message(self, phase: str, node_return_timeout: float) -> str:
        return (f"node(s) {self.missing_nodes()} did not join within node_return_timeout "
                f"({node_return_timeout:g} s) at {phase}")

    def suspect_nodes(self) -> set[int]:
        """Live nodes whose agent's connection closed and who have not polled again yet."""
        return {n.node for n in self.nodes.values() if n.alive and not n.standby and n.disconnected_since is not None}

    def missing_nodes(self) -> list[int]:
        return sorted(set(range(self.nnodes)) - self.alive_nodes())

    def reserve_spare_id(self) -> int:
        """A node id no agent of this job has used: for a spare, or a node that returns as one."""
        used = [*self.nodes, *self.adopted_by.values(), self.nnodes - 1, self.last_spare_id]
        self.last_spare_id = max(used) + 1
        return self.last_spare_id

    def idle_spare(self) -> NodeRecord | None:
        return next((n for n in sorted(self.nodes.values(), key=lambda n: n.node)
                     if n.standby and n.alive and n.adopting is None and not n.unfit), None)

    def being_adopted(self, node: int) -> bool:
        return any(n.adopting == node and n.alive for n in self.nodes.values())

    def committed_step(self) -> int:
        # A rank restored by a failover knows no step until it beats here (one that died with the
        # old leader never does): the others tell where the job stands.
        return min(self.known_steps(), default=0)

    def known_steps(self) -> list[int]:
        """The committed step of every rank whose step is known."""
        return [record.step for record in self.ranks.values() if record.step_known]

    def lost_ranks(self, extra: set[int]) -> set[int]:
        """``extra`` plus every member whose process exited badly or whose node is gone."""
        lost = set(extra) | {record.rank for record in self.ranks.values() if record.exitcode not in (None, 0)}
        for node in self.nodes.values():
            if not node.alive:
                lost |= set(self.ranks_of(node.node))
        return lost & set(self.members)  # after an elastic shrink, a dropped node's ranks are not lost again
