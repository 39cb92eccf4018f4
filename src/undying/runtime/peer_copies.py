"""Whether and how a job keeps peer copies of T1 (``checkpoint.peer_copy``), as the worker's checkpoint
engine, step transaction and recovery see it.

Runs in the worker, on the training thread. ``PeerCopies`` decides once the script has built its
mesh whether the job copies (the same answer on every rank: it shapes the commit vote), starts this
rank's ``PeerCopy`` (runtime/peer_copy.py) on first use, carries the vote's report and result,
reports the copies as events, and is told of every recovery and restore.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from undying import events as ev
from undying.checkpoint.snapshot import RankSnapshots
from undying.config import JobSpec
from undying.runtime.event_sink import EventSink
from undying.runtime.membership import Membership
from undying.runtime.peer_copy import NO_COPY, CopyReport, PeerCopy, origin_of
from undying.runtime.state_transfer import recv_state, send_state
from undying.runtime.training_state import TrainingState
from undying.shm import node_dir

STORE_TIMEOUT_S = 10.0  # the sender's store calls (the holder's address)
MIN_SLOTS = 3  # the anchor, the snapshot being copied, and the newest


class PeerCopies:
    """The job's peer copies, for one rank: ``enabled`` or not, and this rank's ``PeerCopy`` once started."""

    def __init__(self, spec: JobSpec, membership: Membership, reporter: EventSink, job_id: str | None,
                 token: str, snapshots: Callable[[], RankSnapshots]) -> None:
        self._mode = spec.checkpoint.peer_copy
        self._ranks_per_node = spec.nproc_per_node
        self._timeout = spec.comm_timeout
        self._membership = membership
        self._reporter = reporter
        self._job_id = job_id
        self._token = token
        self._snapshots = snapshots
        self._copy: PeerCopy | None = None
        self._start_failed = False
        self._failing = False  # a failure was reported and no copy succeeded since
        self._reported: CopyReport = NO_COPY  # this rank's part of the vote in flight

    @property
    def enabled(self) -> bool:
        """``auto``: a job under agents on two or more nodes whose state has no replica (a pure-FSDP
        mesh, ``replicate=1``). The same on every rank once the script has built its mesh, and
        fixed from then on: the commit vote's shape depends on it."""
        mesh = self._membership.mesh
        return mesh is not None and self.copies_for(mesh.replicate)

    def copies_for(self, replicate: int) -> bool:
        """Would the job copy with a mesh of ``replicate`` replicas?"""
        membership = self._membership
        return (self._mode == "auto" and replicate == 1 and self._job_id is not None
                and membership.store_address is not None and membership.world_size > self._ranks_per_node
                and membership.world_size % self._ranks_per_node == 0)

    def slots(self, configured: int) -> int:
        """T1 slots per rank: at least MIN_SLOTS while copying (the anchor and the copy are pinned)."""
        return max(configured, MIN_SLOTS) if self.enabled else configured

    @property
    def copy(self) -> PeerCopy | None:
        """This rank's PeerCopy, started on first use (None when the job does not copy)."""
        if self._copy is None and self.enabled and not self._start_failed:
            membership = self._membership
            assert self._job_id is not None and membership.store_address is not None
            try:
                self._copy = PeerCopy(
                    rank=membership.rank, world_size=membership.world_size, ranks_per_node=self._ranks_per_node,
                    directory=node_dir(self._job_id, membership.node) / "peer", token=self._token,
                    snapshots=self._snapshots(), store=membership.bounded_store(STORE_TIMEOUT_S, "peer copy store"),
                    publish=membership.store.set, key_prefix=membership.store_prefix,
                    store_address=membership.store_address, timeout=self._timeout)
            except OSError as error:  # no address to listen on, node memory refused: the job trains on
                self._start_failed = True
                self._reporter.emit(ev.PEER_COPY_FAILED, reason=f"peer copies not started: {error}")
        return self._copy

    def after_snapshot(self, step: int) -> None:
        if self.copy is not None:
            self.copy.after_snapshot(step)

    def vote_report(self) -> tuple[float, float, float, float]:
        """This rank's part of the commit vote: (copying, confirmed, step, step squared)."""
        self._reported = self._copy.vote_report() if self._copy is not None else NO_COPY
        return self._reported.values()

    def vote_result(self, sums: list[float], world_size: int) -> None:
        if self._copy is not None:
            self._copy.on_vote(self._reported, sums, world_size)

    def report(self, step: int) -> None:
        """Emit what the threads did since the last call: copies that became the anchor, failures."""
        if self._copy is None:
            return
        for sent in self._copy.anchored:
            self._failing = False
            self._reporter.emit(ev.PEER_COPY, step=sent.step, holder=self._copy.holder, bytes=sent.nbytes,
                                seconds=round(sent.seconds, 4))
        self._copy.anchored.clear()
        failures = self._copy.failures()
        if failures and not self._failing:
            self._failing = True  # once until a copy succeeds again: a lost holder fails every copy
            self._reporter.emit(ev.PEER_COPY_FAILED, step=step, reason=failures[0], count=len(failures))

    def steps_held(self, replicas: int) -> list[int]:
        """The steps of this node's copies of this rank's origin (an offer of a repair)."""
        return self.copy.copy_steps(replicas) if self.copy is not None else []

    def holders(self) -> dict[int, int] | None:
        """Group index of each member -> its holder's group index (None when the job does not copy)."""
        if not self.enabled:
            return None
        members, size, per_node = self._membership.members, self._membership.world_size, self._ranks_per_node
        return {members.index(origin_of(rank, size, per_node)): members.index(rank)
                for rank in members if origin_of(rank, size, per_node) in members}

    def receive_copy(self, holder: int, state: TrainingState) -> None:
        """Load ``state`` (models, optimizers, shards, RNG, loaders, user state) from the copy of this rank's
        snapshot that group rank ``holder`` sends (``send_copy``), into the live tensors where they fit."""
        membership = self._membership
        live = {"replica": state.replica_state(), "rank": state.rank_state()}
        received = recv_state(membership.current_group(), holder, membership.device, live=live)
        state.load_replica_state(received["replica"])
        state.load_rank_state(received["rank"])

    def send_copies(self, step: int, from_copies: Mapping[int, int]) -> None:
        """Of ``from_copies`` (group index -> its holder's), send this rank's node's copy of ``step`` to
        each rank whose holder this rank is."""
        index = self._membership.members.index(self._membership.rank)
        for origin, holder in from_copies.items():
            if holder == index:
                self.send_copy(step, origin)

    def send_copy(self, step: int, destination: int) -> None:
        """Send this node's copy of the origin's snapshot of ``step`` to group rank ``destination``."""
        copy, membership = self.copy, self._membership
        assert copy is not None

        def send(state: Any) -> None:
            send_state(membership.current_group(), state, [destination], membership.device)

        copy.copies.read(copy.origin, step, send)

    def continued(self, step: int) -> None:
        """A recovery or restore made the job continue from ``step`` in the current generation."""
        if self.copy is not None:
            self.copy.reset(step, self._membership.generation)

    def store_moved(self) -> None:
        if self._copy is not None:
            self._copy.use_store(self._membership.bounded_store(STORE_TIMEOUT_S, "peer copy store"),
                                 self._membership.store.set)

    def close(self) -> None:
        if self._copy is not None:
            self._copy.close()
