"""The worker's line to the controller: a heartbeat thread and synchronous event sends.

Runs in the worker. The heartbeat thread sends (step, phase) every ``heartbeat_interval``
(while a step is in flight, often enough that the commit fence's lease stays fresh) while
the training thread computes or waits in a collective (neither holds the GIL for
long); it stops when the process is stopped or dead, which is how the controller tells a
hang from slow progress (its agent reports a stopped process at once: agent/stopped_workers.py).
Events go out at once from the calling thread so that, e.g., an injection is logged
before the fault.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from undying.client import ControllerClient, ControllerUnreachable
from undying.events import Event
from undying.locate import locator_from_env
from undying.protocol import (
    ROUTE_EVENT,
    ROUTE_INJECT_CLAIM,
    ROUTE_WORKER_HEARTBEAT,
    ROUTE_WORKER_RECOVER,
    Granted,
    Heartbeat,
    HeartbeatReply,
    InjectionClaim,
    Phase,
    Plan,
    PlanAction,
    RecoverRequest,
)
from undying.runtime.generation import Generation
from undying.runtime.step_timing import StepTimes

# Seconds between two heartbeats sent for progress, however fast steps go: the controller's view of
# each rank's committed step (where a job ended, the step a fault hit in its records) is this fresh.
# Each beat costs the rank's heartbeat thread and the controller a request's framing, parsing and
# encoding (0.16 ms of CPU for both ends on a quiet core, bench/round_trip.py; several times that on
# cores the ranks keep busy), so with 50 ms steps closer progress beats would cost the job more CPU.
PROGRESS_MIN_SPACING = 0.25
# ... and between two beats asked for (``beat_now``: a collective waiting long asks for the
# controller's word, a T2 commit starts): an abort reaches a survivor whose collective waits long
# within about this; the end of a recovery is not measured by it (the worker's ``first_step`` event is).
ASK_MIN_SPACING = 0.1
EVENT_TIMEOUT_S = 5.0
# While a step is in flight, the heartbeat thread beats at least this share of the commit fence's lease
# after its last beat began, so that the fence finds an answered beat younger than the lease and does
# not ask the controller from the training thread; the rest of the lease is room for the reply and a
# late wake. A frozen process beats from neither thread, so the fence still sees its silence.
FENCE_FRESH_SHARE = 0.6
# Answered heartbeats whose spacing the commit fence reads (``confirm_generation``): more than a
# step's worth at the closest spacing the fence cares about.
ANSWERED_GAPS_KEPT = 16


class Reporter:
    """Heartbeats and events of one worker. With no controller (standalone runs) it only prints.

    It feeds ``generation`` (runtime/generation.py) with what each heartbeat reply says: the newest
    generation the controller aborted, and the newest it ends; its beats and events carry that
    object's current generation. Given a number, it keeps a ``Generation`` of its own."""

    def __init__(self, address: str | None, token: str, rank: int, node: int, generation: Generation | int,
                 interval: float, fence_lease: float | None = None) -> None:
        self.rank = rank
        self.node = node
        self._generation = Generation(generation) if isinstance(generation, int) else generation
        self._generation.asked_by(self.beat_now)
        self.interval = interval
        # The commit fence's lease (``confirm_generation``; None: no fence): the thread keeps it fresh.
        self.fence_lease = fence_lease
        self.step = 0
        self.phase = Phase.STARTING
        self.scalars: dict[str, float] = {}  # the newest value of each name the script logged (ft.log)
        self.mesh_shard = 0  # set by ft.device_mesh: the controller shrinks a sharded job by whole replicas
        self.mesh_peer_copies = False  # set by ft.device_mesh: a one-replica mesh's T1 copied to the next node
        self.max_steps = 0  # set by ft.steps(n): the console shows the step of n
        self.step_times = StepTimes()  # the newest committed steps' times (runtime/step_timing.py)
        # The step whose T2 checkpoint this rank commits, its persister busy with it (0: none).
        self.committing: Callable[[], int] = lambda: 0
        self.mirror_store = ""  # failover jobs: a second store for the RNG mirror (from heartbeat replies)
        # Monotonic time at which the newest heartbeat the controller answered was sent: the
        # controller cannot have declared this rank silent before that time + heartbeat_timeout.
        self._answered_sent_at: float | None = None
        # The newest answered beats, each as (sent at, seconds since the answered beat before it): a
        # fresh beat that ended a long silence (a frozen host, woken) does not make the lease fresh.
        self._answered_gaps: deque[tuple[float, float]] = deque(maxlen=ANSWERED_GAPS_KEPT)
        self._address = address
        self._token = token
        self._locator = locator_from_env(os.environ)  # failover jobs: follow the controller when it moves
        # Events are small: a controller that does not take one in EVENT_TIMEOUT_S is down or frozen.
        self._client = ControllerClient(address, token, timeout=EVENT_TIMEOUT_S,
                                        locator=self._locator) if address else None
        self._wake = threading.Event()  # a beat is wanted (progress, or asked for)
        self._asked = threading.Event()  # ... asked for: it goes ASK_MIN_SPACING after the last one
        self._closing = threading.Event()  # close(): the thread stops, a pause cut short
        self._thread = threading.Thread(target=self._beat_forever, name="undying-heartbeat", daemon=True)
        if address:
            self._thread.start()

    @property
    def generation(self) -> int:
        """The generation this worker is in (its ``Generation``'s)."""
        return self._generation.current

    @property
    def abort_generation(self) -> int:
        """The newest generation the controller told this worker to abandon."""
        return self._generation.abort_generation

    @property
    def connected(self) -> bool:
        """Is there a controller to report to (False in a standalone run)?"""
        return self._client is not None

    def update(self, step: int | None = None, phase: Phase | None = None,
               scalars: dict[str, float] | None = None) -> None:
        if step is not None and step != self.step:
            self.step = step
            # Progress goes out soon after it happens, so the controller's view of each rank's
            # committed step is fresh when a fault strikes; the thread spaces the sends.
            self._wake.set()
        if phase is not None:
            self.phase = phase
        if scalars:
            # A new dict, not an update in place: the heartbeat thread may be encoding the old one.
            self.scalars = {**self.scalars, **scalars}

    def beat_now(self) -> None:
        self._asked.set()
        self._wake.set()

    def report_now(self, step: int, phase: Phase) -> None:
        """Set ``step`` and ``phase`` and send them from the calling thread, answered before this
        returns. Used once a worker has restored its state: the controller then knows it before
        any step of the generation can commit (a commit needs every rank), where the heartbeat
        thread's next beat may come after a fault has already been judged. The thread is not woken
        for it (``update`` would): this beat carries the progress."""
        self.step, self.phase = step, phase
        if self._client is not None:
            self._beat(self._client)

    def _beat_forever(self) -> None:
        assert self._address is not None
        client = ControllerClient(self._address, self._token, timeout=max(2.0, self.interval * 3),
                                  locator=self._locator)
        while not self._closing.is_set():
            sent = time.monotonic()
            self._beat(client)
            # The next beat: ``_longest_gap()`` after this one began (what the controller's silence
            # timeouts and the commit fence count on), or sooner when the step moves or a beat is
            # asked for, but never within PROGRESS_MIN_SPACING of this one for progress,
            # ASK_MIN_SPACING when asked for (an ask made during a progress pause cuts it short).
            longest = self._longest_gap()
            self._wake.wait(max(0.0, sent + longest - time.monotonic()))
            while not self._closing.is_set():
                spacing = ASK_MIN_SPACING if self._asked.is_set() else PROGRESS_MIN_SPACING
                pause = sent + min(spacing, longest) - time.monotonic()
                if pause <= 0:
                    break
                (self._closing if self._asked.is_set() else self._asked).wait(pause)
            # After the pause: the beat about to go carries a step moved, or answers an ask made, meanwhile.
            self._wake.clear()
            self._asked.clear()
        client.close()

    def _longest_gap(self) -> float:
        """Seconds from one beat of the thread to the next at the most: ``interval``, or while a step
        is in flight (not recovering, not done) and there is a fence, FENCE_FRESH_SHARE of its lease
        where that is shorter."""
        if self.fence_lease is None or self.phase in (Phase.RECOVERING, Phase.DONE):
            return self.interval
        return min(self.interval, max(ASK_MIN_SPACING, FENCE_FRESH_SHARE * self.fence_lease))

    def _beat(self, client: ControllerClient) -> None:
        """One heartbeat; its reply says which generations the controller aborted or ends."""
        times = self.step_times
        beat = Heartbeat(self.rank, self.node, self.generation, self.step, self.phase, os.getpid(), self.scalars,
                         self.mesh_shard, self.max_steps, times.steps, round(times.compute, 6),
                         round(times.comm, 6), round(times.data, 6), self.committing(), self.mesh_peer_copies)
        sent_at = time.monotonic()
        try:
            reply = HeartbeatReply.from_dict(client.post(ROUTE_WORKER_HEARTBEAT, beat.to_dict()))
        except ControllerUnreachable:
            return
        self._generation.heard(reply.abort_generation, reply.end_generation)
        self.mirror_store = reply.mirror_store
        before = self._answered_sent_at
        self._answered_sent_at = max(before or sent_at, sent_at)
        if before is not None and sent_at > before:
            self._answered_gaps.append((sent_at, sent_at - before))

    def confirm_generation(self, lease: float, since: float | None = None) -> bool:
        """The fence before a step is applied: unless a heartbeat sent less than ``lease`` seconds ago
        was answered, and (given ``since``, monotonic) no two answered beats since then were ``lease``
        or more apart, ask the controller now (one heartbeat from the calling thread).

        A rank stopped (SIGSTOP, a frozen host) longer than its host's silence limit may have been
        given up; woken, its all-reduce can still complete from bytes its peers sent before they gave
        the step up, and without this it would apply a step the job never took. Its heartbeat thread
        may have been answered once already since it woke: the silence before that beat counts too.
        A controller that does not answer cannot be replacing anyone (failover): the step goes on.
        Returns whether it asked (the lease had run out or was broken)."""
        if self._client is None:
            return False
        answered = self._answered_sent_at
        if answered is not None and time.monotonic() - answered < lease and not self._silent_since(since, lease):
            return False
        self._beat(self._client)
        return True

    def _silent_since(self, since: float | None, lease: float) -> bool:
        """Were two answered beats sent after ``since`` (monotonic; None: never asked) ``lease`` or
        more apart?"""
        return since is not None and any(sent >= since and gap >= lease for sent, gap in list(self._answered_gaps))

    def emit(self, kind: str, step: int | None = None, **details: Any) -> None:
        event = Event(kind=kind, node=self.node, rank=self.rank, step=self.step if step is None else step,
                      generation=self.generation, details=details)
        if self._client is None:
            print(f"[undying rank {self.rank}] {kind} step={event.step} {details}", file=sys.stderr)
            return
        try:
            self._client.post(ROUTE_EVENT, event.__dict__)
        except ControllerUnreachable as error:
            print(f"[undying rank {self.rank}] could not send event {kind}: {error}", file=sys.stderr)

    def claim_injection(self, index: int, step: int) -> bool:
        if self._client is None:
            return True
        claim = InjectionClaim(index, self.rank, self.node, self.generation, step)
        return Granted.from_dict(self._client.post(ROUTE_INJECT_CLAIM, claim.to_dict())).granted

    def wait_for_plan(self, generation: int, committed_step: int, reason: str, newcomer: bool,
                      raised: tuple[list[str], str] | None = None) -> Plan:
        """Check in with the controller after a failed step (or on joining) and wait for its plan.
        ``raised``: this rank's own exception failed the step (its traceback tail and exception line);
        the controller is told what it was."""
        if self._client is None:
            raise RuntimeError(f"step failed with no controller to recover it: {reason}")
        tail, error = raised if raised is not None else ([], "")
        request = RecoverRequest(self.rank, self.node, generation, committed_step, os.getpid(), reason,
                                 newcomer, wait=5.0, error=error, error_tail=tail)
        while True:
            try:
                plan = Plan.from_dict(self._client.post(ROUTE_WORKER_RECOVER, request.to_dict(),
                                                        timeout=request.wait + 3.0, held=request.wait))
            except ControllerUnreachable:
                self._client.wait_for_move(0.2)  # or sooner: the heartbeat thread found the new leader
                continue
            if plan.action != PlanAction.WAIT:
                return plan

    def close(self) -> None:
        self._closing.set()
        self._asked.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        if self._client is not None:
            self._client.close()
