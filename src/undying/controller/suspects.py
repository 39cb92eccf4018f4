"""Nodes that slow or corrupt the job without failing: stragglers and transient bad steps.

Runs in the controller, inside the job machine. It reads the ranks' step times from their
heartbeats (``stragglers.StragglerWatch``) and the bad-step events of their commit votes
(runtime/bad_steps.py), logs what it finds (``straggler``; a ``bad_step`` is named with the ranks
whose own values were bad), says when a bad step that repeated stops the job (``bad_step_repeat:
stop``), and
keeps the nodes to switch to a spare (``straggler_strategy: switch``, ``bad_step_transient: switch``):
the job machine hands them to the switch (strategies/switch.py) while the job trains and a spare is idle.
"""

from __future__ import annotations

from collections.abc import Callable

from undying import events as ev
from undying.config import JobSpec
from undying.controller.membership import Membership
from undying.controller.stragglers import StragglerWatch
from undying.events import Event
from undying.protocol import Heartbeat

REPLAYED, STOP = "replayed", "stop"  # a bad step's actions the controller acts on (runtime/bad_steps.py)


class Suspects:
    """What the ranks' step times and bad steps say about their nodes."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.stragglers = StragglerWatch(spec.straggler_threshold, spec.straggler_window)
        self.bad_ranks: dict[int, set[int]] = {}  # step -> ranks whose own values were bad (vote or bad_value)
        self.to_switch: dict[int, str] = {}  # node -> why it is to move to a spare

    def new_generation(self) -> None:
        self.stragglers.new_generation()

    def heartbeat(self, beat: Heartbeat) -> None:
        if self.spec.straggler_strategy != "off":
            self.stragglers.observe(beat)

    def find_stragglers(self, membership: Membership, emit: Callable[..., None], generation: int,
                        now: float) -> None:
        """Log the stragglers found since the last call; under ``switch``, keep their nodes to switch."""
        if self.spec.straggler_strategy == "off":
            return
        for straggler in self.stragglers.find(now):
            record = membership.ranks.get(straggler.rank)
            step = record.step if record is not None else None
            switch = self.spec.straggler_strategy == "switch"
            if switch:
                self.to_switch.setdefault(straggler.node, f"rank {straggler.rank} is a straggler "
                                                          f"({straggler.ratio:.2f} x its peers' busy time per step)")
            emit(ev.STRAGGLER, node=straggler.node, rank=straggler.rank, step=step, generation=generation,
                     details={**straggler.details(), "threshold": self.spec.straggler_threshold,
                              "window": self.spec.straggler_window, "strategy": self.spec.straggler_strategy,
                              "spare_idle": membership.idle_spare() is not None})

    def worker_event(self, membership: Membership, event: Event, ended: bool) -> str:
        """A worker's bad-step events: a ``bad_step`` is given the ranks whose values were bad (before
        it is logged); a replay that was clean may switch their nodes out. Returns why the job stops
        (a bad step repeated under ``bad_step_repeat: stop``, unless it has ``ended``), or ""."""
        if event.step is None:
            return ""
        if event.kind == ev.BAD_VALUE and event.rank is not None:
            self.bad_ranks.setdefault(event.step, set()).add(event.rank)
        if event.kind != ev.BAD_STEP:
            return ""
        named = event.details.get("ranks")
        known = self.bad_ranks.setdefault(event.step, set())
        known.update(rank for rank in (named if isinstance(named, list) else []) if isinstance(rank, int))
        ranks = sorted(known)
        event.details["ranks"] = ranks
        action = event.details.get("action")
        if action == REPLAYED:
            self.bad_ranks.pop(event.step, None)
            if self.spec.bad_step_transient == "switch":
                for rank in ranks:
                    self.to_switch.setdefault(membership.node_of(rank),
                                              f"rank {rank} had a transient bad step at step {event.step}")
        elif action == STOP and not ended:
            who = f"; bad values on rank(s) {ranks}" if ranks else ""
            return (f"step {event.step} was bad again when replayed ({event.details.get('cause')}{who}); "
                    f"stopped by bad_step_repeat: stop")
        return ""

    def next_switch(self, membership: Membership) -> tuple[int, str] | None:
        """A node to switch now: it serves ranks of the generation and a spare is idle (else later)."""
        for node, why in list(self.to_switch.items()):
            if not membership.node_alive(node) or not set(membership.ranks_of(node)) & set(membership.members):
                del self.to_switch[node]  # gone or dropped meanwhile: nothing left to move
            elif membership.idle_spare() is not None:
                del self.to_switch[node]
                return node, why
        return None
