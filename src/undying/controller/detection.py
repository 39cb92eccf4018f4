"""Fault detection: turns what agents and workers reported (or failed to report) into faults.

Runs in the controller, inside the job machine. Sources: a worker's exit (agent poll or its
immediate report), a lost agent (no poll, or the launcher saw its process end), a worker its
agent sees stopped (SIGSTOP: a hang, acted on at once), a host whose agent and ranks all went
silent while other nodes were heard (frozen or cut off, a heartbeat interval and a slack after its
last beat), missed heartbeats (any other hang), a rank whose heartbeats go on but whose step does
not move (``step_timeout``), no first heartbeat within ``start_timeout``, a rank that said it
finished but does not exit, and a worker's own report that its step failed, held briefly so the
decision is made on the real cause.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from undying import events as ev
from undying.controller.deadlines import Deadlines
from undying.controller.membership import Membership, NodeRecord, RankRecord
from undying.faults import Fault, FaultReason
from undying.protocol import WORKER_EXIT_REPAIR_REFUSED, Heartbeat, Phase, WorkerState, WorkerStatus

Emit = Callable[..., None]
# A gap this long between two scans means the controller itself did not run: silences are counted
# again from its return.
CONTROLLER_PAUSE = 0.5


class FaultDetector:
    """Holds the faults seen and not yet acted on; ``find`` hands out the next one."""

    def __init__(self, membership: Membership, deadlines: Deadlines, watchdog: str, emit: Emit) -> None:
        self.membership = membership
        self.deadlines = deadlines
        self.watchdog = watchdog
        self.emit = emit
        self.pending: list[Fault] = []  # faults seen outside the per-rank scan (a lost node)
        self.step_failures: list[tuple[float, Fault]] = []
        self.reported_failures: set[tuple[int, int]] = set()  # (rank, generation) step failures seen
        self.stopped: dict[int, int] = {}  # rank -> spawn generation of its process its agent sees stopped
        # The controller's own scans: a host's silence counts only from when this process last ran
        # without a pause (a controller descheduled for a second has not heard anyone meanwhile).
        self._last_scan: float | None = None
        self._listening_since = 0.0

    def clear(self) -> None:
        self.pending.clear()
        self.step_failures.clear()

    def record_worker(self, node: NodeRecord, status: WorkerStatus, generation: int) -> None:
        """An agent's report of one worker: an exit becomes the rank's exit code."""
        record = self.membership.ranks.get(status.rank)
        if record is None or status.generation != record.spawn_generation or record.exitcode is not None:
            return
        if status.state == WorkerState.STOPPED:
            self.stopped[status.rank] = status.generation
            return
        self.stopped.pop(status.rank, None)  # continued (SIGCONT), or exited
        if status.state != WorkerState.EXITED:
            return
        record.exitcode = status.exitcode if status.exitcode is not None else -1
        record.signal = status.signal
        record.error, record.log_tail = status.error, tuple(status.log_tail)
        if record.exitcode != 0 and record.done:
            # Training had finished and its result was written; only the teardown failed.
            self.emit(ev.WORKER_EXIT, node=node.node, rank=status.rank, step=record.step, generation=generation,
                      details={"exitcode": status.exitcode, "signal": status.signal, "after_done": True})
            record.exitcode = 0
            return
        if record.exitcode == 0:
            record.done = True
        details: dict[str, Any] = {"exitcode": status.exitcode, "signal": status.signal}
        if status.error:
            details["error"] = status.error
        self.emit(ev.WORKER_EXIT, node=node.node, rank=status.rank, step=record.step, generation=generation,
                  details=details)

    def silent_agents(self, now: float) -> list[tuple[NodeRecord, str]]:
        """Live agents not heard from for too long, with why."""
        if self._last_scan is None or now - self._last_scan > CONTROLLER_PAUSE:
            self._listening_since = now
        self._last_scan = now
        silent = []
        frozen = self._silent_hosts(now)
        for node in self.membership.nodes.values():
            if not node.alive or node.exit_delivered:
                continue
            if node.disconnected_since is not None \
                    and now - node.disconnected_since > self.deadlines.disconnected_agent_lost_after:
                silent.append((node, f"its connection closed {now - node.disconnected_since:.1f} s ago and it "
                                     "did not poll again"))
                continue
            if node.node in frozen:
                silent.append((node, frozen[node.node]))
                continue
            if node.gone and not node.confirmed:
                silent.append((node, "its process held no etcd lease when the controller failed over: it went "
                                     "with the previous leader"))
                continue
            limit = self.deadlines.agent_lost_after if node.confirmed else self.deadlines.unconfirmed_agent_lost_after
            quiet_ranks = self._ranks_silent_with_their_agent(node, now)
            if now - node.last_seen > limit:
                what = "no poll" if node.confirmed else "no poll since the controller failed over"
                silent.append((node, f"{what} for {now - node.last_seen:.1f} s"))
            elif quiet_ranks:
                silent.append((node, f"no poll for {now - node.last_seen:.1f} s and rank(s) {quiet_ranks} "
                                     f"without heartbeats: the host is frozen or cut off"))
        return silent

    def _silent_hosts(self, now: float) -> dict[int, str]:
        """Nodes whose agent and every rank with heartbeats went silent together for
        ``deadlines.host_silent`` (an agent beat interval plus a slack) while some other node was
        heard from: the host is frozen or cut off, node -> why. A live agent beats every
        ``spec.agent_beat_interval()`` on a connection of its own, whatever its poll and its orders
        are doing, and a stopped worker on a live host is its agent's to report; so one silence of
        all of them at once is the host's. Empty unless the watchdog acts on hangs. A node without a
        rank that beats from a step yet is left to the longer limits below: a spare, or a node whose
        ranks are all still starting (imports, process group, restore: its busiest CPU, when its agent
        may wait a second for a core)."""
        if self.watchdog != "on":
            return {}
        limit = self.deadlines.host_silent
        # node -> the newest request of its agent, or of any of its ranks where the agent is silent
        newest = {node.node: max(node.last_heard, self._listening_since) for node in self.membership.nodes.values()
                  if node.alive and node.confirmed and not node.exit_delivered and node.last_heard is not None}
        judged = []  # nodes whose agent is silent and that have a rank beating from a step: only they are judged
        for node, heard in newest.items():
            if now - heard > limit:  # a live agent beats well within it: steady state never gets here
                beating = self._beating_ranks(node)
                if any(record.phase != Phase.STARTING for record, _ in beating):
                    judged.append(node)
                    newest[node] = max(heard, *(beat for _, beat in beating))
        frozen = {node: now - newest[node] for node in judged if now - newest[node] > limit}
        if not frozen or all(now - heard > limit for node, heard in newest.items() if node not in frozen):
            return {}  # nobody else heard either: the controller's own network, not one host
        return {node: f"neither its agent nor its ranks were heard from for {seconds:.2f} s while other "
                      f"nodes were (limit {limit:.2f} s): the host is frozen or cut off"
                for node, seconds in sorted(frozen.items())}

    def _ranks_silent_with_their_agent(self, node: NodeRecord, now: float) -> list[int]:
        """The node's ranks that missed their heartbeats while its agent, too, is late to poll: a hung
        rank would be restarted in place by its agent, but a silent agent will not do it (a frozen
        host). Empty unless the watchdog acts on hangs."""
        if self.watchdog != "on" or not node.confirmed or now - node.last_seen <= self.deadlines.agent_quiet_after:
            return []
        return sorted(record.rank for record, beat in self._beating_ranks(node.node)
                      if now - beat > self.deadlines.heartbeat)

    def _beating_ranks(self, node: int) -> list[tuple[RankRecord, float]]:
        """The node's ranks whose process lives, has not finished and has sent a heartbeat (the ones
        whose silence means something), each with its last heartbeat's time. Looked up by the node's
        own ranks (the layout is fixed), not by a scan of every rank of the job for each late node."""
        ranks = self.membership.ranks
        records = [ranks[rank] for rank in self.membership.ranks_of(node) if rank in ranks]
        return [(record, record.last_heartbeat) for record in records if record.node == node
                and record.exitcode is None and not record.done and record.last_heartbeat is not None]

    def record_heartbeat(self, record: RankRecord, beat: Heartbeat, now: float) -> None:
        """A heartbeat of the rank's current process: its step, phase and liveness."""
        record.last_heartbeat = now
        # A process starting or in a recovery may not hold its step yet (a newcomer beats step 0 until
        # it is repaired): such a beat never takes the rank's committed step back.
        if beat.phase not in (Phase.STARTING, Phase.RECOVERING) or beat.step > record.step:
            if beat.step != record.step:
                record.last_progress = now  # armed from a rank's first committed step on
            record.step = beat.step
            record.step_known = True
        if not (beat.phase == Phase.STARTING and record.phase != Phase.STARTING and beat.pid == record.pid):
            # A process never returns to starting: such a beat was sent before the one that said it had
            # restored (the heartbeat thread's, overtaken by the worker's own report).
            record.phase = beat.phase
        record.pid = beat.pid
        if beat.phase == Phase.DONE and not record.done:
            record.done = True
            record.done_at = now

    def step_failed(self, now: float, fault: Fault, generation: int) -> bool:
        """A worker's own report that it could not complete its step (once per rank and generation);
        True if it is the first of this rank and generation."""
        assert fault.rank is not None
        if (fault.rank, generation) in self.reported_failures:
            return False
        self.reported_failures.add((fault.rank, generation))
        self.step_failures.append((now, fault))
        return True

    def find(self, now: float, generation: int) -> Fault | None:
        """The next fault to act on, if any."""
        membership = self.membership
        if any(n.alive and not n.confirmed and not n.standby for n in membership.nodes.values()):
            # Just failed over: every fault now (a failed step, a silent rank) may be the old leader's
            # node dying. Decide once each node has either polled here or been declared lost.
            return None
        if self.pending:
            return self.pending.pop(0)
        # A node whose agent's connection just closed may be gone: its ranks' silence and the
        # survivors' failed steps are symptoms of it until it polls again or is declared lost.
        suspect = membership.suspect_nodes()
        # Once per call, not per rank: this scan runs every tick over every rank of the job.
        watched = {node_id for node_id, node in membership.nodes.items() if node.alive} - suspect
        for record in membership.ranks.values():
            if record.node not in watched:
                continue  # the node's agent_lost fault covers its ranks
            fault = self._rank_fault(record, now, generation)
            if fault is not None:
                return fault
        everyone_reported = len({fault.rank for _, fault in self.step_failures}) == len(membership.ranks)
        if self.step_failures and not suspect and (everyone_reported
                                   or now - self.step_failures[0][0] >= self.deadlines.step_failed_grace):
            # The rank whose own exception failed the step is the cause; the others only saw its no.
            failures = [fault for _, fault in self.step_failures]
            self.step_failures.clear()
            return next((fault for fault in failures if fault.error), failures[0])
        return None

    def _rank_fault(self, record: RankRecord, now: float, generation: int) -> Fault | None:
        if record.exitcode not in (None, 0):
            return Fault(FaultReason.WORKER_EXIT, exitcode=record.exitcode, signal=record.signal, error=record.error,
                         log_tail=record.log_tail, repair_refused=record.exitcode == WORKER_EXIT_REPAIR_REFUSED,
                         **_where(record))
        if record.exitcode == 0:
            return None
        if record.done:
            # Said it finished but its process has not ended: stuck in teardown.
            if record.done_at is not None and now - record.done_at > self.deadlines.stop:
                return Fault(FaultReason.EXIT_TIMEOUT, **_where(record))
            return None
        hang = None
        if self.stopped.get(record.rank) == record.spawn_generation:
            # Its agent sees the process stopped: it will not beat again, so waiting out the
            # heartbeat timeout would only delay the same decision.
            hang = Fault(FaultReason.HEARTBEAT_MISSED, detail="its process is stopped (SIGSTOP)", **_where(record))
        elif record.last_heartbeat is None:
            if now - record.started_at > self.deadlines.start:
                return Fault(FaultReason.START_TIMEOUT, **_where(record))
            return None
        elif now - record.last_heartbeat > self.deadlines.heartbeat:
            hang = Fault(FaultReason.HEARTBEAT_MISSED, **_where(record))
        elif self._stalled(record, now):
            # Alive (its heartbeat thread beats) but its training thread commits no step.
            hang = Fault(FaultReason.STEP_STALLED, **_where(record))
        if hang is None or self.watchdog == "on":
            return hang
        self._note_unacted_hang(record, hang, generation)
        return None

    def _stalled(self, record: RankRecord, now: float) -> bool:
        timeout = self.deadlines.step
        # Only a rank still computing is stuck itself: its peers wait in the all-reduce ("syncing").
        return (timeout is not None and record.last_progress is not None
                and record.phase == Phase.COMPUTING and now - record.last_progress > timeout)

    def _note_unacted_hang(self, record: RankRecord, fault: Fault, generation: int) -> None:
        """watchdog off / detect-only: a hang is reported (once per stuck step), never acted on."""
        if record.hang_reported_step != record.step:
            record.hang_reported_step = record.step
            self.emit(ev.HANG_SUSPECTED, node=record.node, rank=record.rank, step=record.step,
                      generation=generation, details={"watchdog": self.watchdog, "description": fault.describe()})


def _where(record: RankRecord) -> dict[str, Any]:
    # Built only for a fault found, not for every rank the per-tick scan finds healthy.
    return {"node": record.node, "rank": record.rank, "step": record.step}
