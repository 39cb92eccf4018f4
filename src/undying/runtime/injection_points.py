"""Where this worker's injected faults fire: a training step (its start, or inside it: the gradient
all-reduce, between the commit vote and the update, the optimizer's update), a recovery phase, or
the persister.

Runs in the worker. Each injection fires at most once per job: before firing, the worker claims
it from the controller and logs it (an ``injection`` event), so the log shows the cause before the
fault. The runtime, the recovery client and the checkpoint engine each ask for their own point.
An injection with ``committed=C`` waits, once claimed, until the checkpoint of step C is committed.
A ``node`` fault at a step takes the whole node at that step's start: its local rank 0 fires it once
every local rank of the node has reached the step (each leaves a marker file under the run
directory), so none is killed halfway through finishing the step before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from undying import events as ev
from undying.inject import COMMIT_WAIT_S, NAN, SLOW, Injection, fire
from undying.runtime.event_sink import EventSink

STEP = "step"  # the start of a training step (or, for ``raise``, inside its body)
RECOVERY = "recovery"  # while regrouping after a fault
DUMP = "dump"  # while writing the dying checkpoint
PERSIST = "persist"  # in the background persister, mid-write
ALLREDUCE = "allreduce"  # mid gradient averaging: the step's first bucket (or reduce-scatter) started
AFTER_VOTE = "after_vote"  # every rank voted for the step; this rank has not applied it yet
OPTIMIZER = "optimizer"  # inside the optimizer's step(): updated, not yet recorded as committed
IN_STEP = (ALLREDUCE, AFTER_VOTE, OPTIMIZER)
RAISE = "raise"  # the injection kind raised inside the step body instead of at its start
STEP_LOOP_KINDS = (RAISE, SLOW, NAN)  # carried out by the step loop, not fired at a step's start
NODE = "node"
NODE_PEERS_WAIT_S = 10.0  # the longest a node fault waits for its node's other local ranks


class ClaimsAndEvents(EventSink, Protocol):
    """What the injections need of the reporter: the controller's word that an injection may fire
    (each fires once per job), and its event."""

    def claim_injection(self, index: int, step: int) -> bool: ...


class InjectionPoints:
    """The injections aimed at this worker (rank, node, local rank), fired at the points they name."""

    def __init__(self, injections: list[Injection], reporter: ClaimsAndEvents, rank: int, node: int,
                 local_rank: int, is_committed: Callable[[int], bool], markers: Path | None = None,
                 local_world_size: int = 1) -> None:
        """``is_committed(step)``: whether the job's checkpoint root holds that step committed;
        ``markers``: the directory where the node's local ranks mark reaching a node fault's step."""
        self.injections = injections
        self._markers = markers
        self._local_world_size = local_world_size
        self._is_committed = is_committed
        self._reporter = reporter
        self._rank = rank
        self._node = node
        self._local_rank = local_rank
        # In-step injections claimed at the start of their step, to fire at their point with no round
        # trip to the controller in between: the fault lands as close to the point as a real one would
        # (after the vote, a claim's milliseconds would let the rank's RNG mirror write finish first).
        self._armed: list[Injection] = []
        self._slow = 1.0  # a claimed ``slow``: every step of this process from then on takes this many times
        self._poisoning: set[int] = set()  # claimed persistent ``nan`` injections (their step stays NaN)

    def at_step_start(self, step: int) -> None:
        for injection in self.injections:
            if injection.at in IN_STEP and injection not in self._armed and self._claim(injection, step):
                self._armed.append(injection)
        for injection in self.injections:
            if injection.kind == NODE and injection.at == STEP:
                self._mark_reached(injection, step)
        for injection in self.injections:
            if injection.kind not in STEP_LOOP_KINDS and injection.at == STEP and self._claim(injection, step):
                if injection.kind == NODE:
                    self._wait_node_peers(injection, step)
                fire(injection)

    def slowdown(self, step: int) -> float:
        """How many times as long this process's steps take (``slow``, from its step on; 1.0: none)."""
        for injection in self.injections:
            if injection.kind == SLOW and injection.factor is not None and self._claim(injection, step):
                self._slow = injection.factor
        return self._slow

    def poisoned(self, step: int) -> bool:
        """Are the model's outputs in this attempt of ``step`` to be NaN (``nan``)? A transient one
        poisons the first attempt only; a persistent one every attempt of its step in this process."""
        poisoned = False
        for injection in self.injections:
            if injection.kind != NAN:
                continue
            if injection.index in self._poisoning and injection.step == step:
                poisoned = True
            elif self._claim(injection, step):
                poisoned = True
                if injection.persistent:
                    self._poisoning.add(injection.index)
        return poisoned

    def in_step_body(self, step: int) -> None:
        """Called by opt.step(): a ``raise`` injection fires inside the step body even unguarded."""
        for injection in self.injections:
            if injection.kind == RAISE and injection.at == STEP and self._claim(injection, step):
                fire(injection)

    def at_point(self, point: str, step: int) -> None:
        """Faults aimed at a point inside the training step (``IN_STEP``: armed at its start, also for
        a replay of it) or at a recovery phase (``RECOVERY``, ``DUMP``)."""
        if point in IN_STEP:
            for injection in list(self._armed):
                if injection.at == point and injection.step in (None, step):
                    self._armed.remove(injection)
                    fire(injection)
            return
        for injection in self.injections:
            if injection.at == point and self._claim(injection, step):
                fire(injection)

    def aims_at(self, point: str) -> bool:
        """Is an injection at ``point`` aimed at this worker (at any step)? A hook that fires it is
        then worth installing."""
        return any(injection.at == point and injection.targets(self._rank, self._node, self._local_rank,
                                                               injection.step or 0)
                   for injection in self.injections)

    def persist_fault(self, step: int) -> Callable[[], None] | None:
        """An ``at=persist`` injection aimed at ``step``, claimed now (the persister thread must not
        talk to the controller on the training thread's connection), to be fired mid-write."""
        for injection in self.injections:
            if injection.at == PERSIST and self._claim(injection, step):
                return lambda: fire(injection)
        return None

    def _marker(self, injection: Injection, step: int, local_rank: int) -> Path | None:
        if self._markers is None or injection.step is None or injection.node != self._node:
            return None
        return self._markers / f"inject{injection.index}-node{self._node}-step{step}-local{local_rank}"

    def _mark_reached(self, injection: Injection, step: int) -> None:
        """This local rank reached the step a node fault aimed at its node fires at."""
        marker = self._marker(injection, step, self._local_rank)
        if marker is not None and injection.step == step:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()

    def _wait_node_peers(self, injection: Injection, step: int) -> None:
        """Until every local rank of the node reached ``step`` (bounded: one that died or hangs
        elsewhere does not hold the fault back)."""
        deadline = time.monotonic() + NODE_PEERS_WAIT_S
        markers = [self._marker(injection, step, local) for local in range(self._local_world_size)]
        while time.monotonic() < deadline and not all(m is None or m.exists() for m in markers):
            time.sleep(0.005)

    def _claim(self, injection: Injection, step: int) -> bool:
        if not injection.targets(self._rank, self._node, self._local_rank, step):
            return False
        if not self._reporter.claim_injection(injection.index, step):
            return False
        details = {} if injection.committed is None else self._wait_committed(injection.committed)
        self._reporter.emit(ev.INJECTION, step=step, spec=injection.text(), **details)
        return True

    def _wait_committed(self, step: int) -> dict[str, object]:
        started = time.monotonic()
        found = self._is_committed(step)
        while not found and time.monotonic() - started < COMMIT_WAIT_S:
            time.sleep(0.02)
            found = self._is_committed(step)
        return {"committed_found": found, "committed_wait": round(time.monotonic() - started, 3)}
