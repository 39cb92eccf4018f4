"""Fault injection with real faults, for tests, demos and benchmarks.

Syntax (``--inject``, may be repeated): ``KIND:key=value:key=value``

- ``kill:rank=R:step=S``   SIGKILL worker R as it reaches step S
- ``node:node=N:step=S``   SIGKILL node N's agent and all its workers at step S; with
  ``:down=D`` the simulated node stays down D seconds before it is rescheduled (elastic tests)
- ``hang:rank=R:step=S``   SIGSTOP worker R at step S (a hang, not a death)
- ``raise:rank=R:step=S``  raise an exception inside step S on worker R
- ``stall:rank=R:step=S``  worker R's training thread blocks forever at step S while the
  process (and its heartbeat thread) stays alive: a hang only ``step_timeout`` catches

``:at=recovery`` or ``:at=dump`` moves the fault from the start of a training step to the
moment the worker starts its part of a recovery or of a dying checkpoint (then ``step=``
is optional and, if given, is the step being recovered to): a second fault during the
handling of the first. ``:at=persist`` fires it in the worker's background persister,
after the shared shard's files are written and before the checkpoint is committed
(``step=``, if given, is the step being persisted).

Three points lie inside a training step, where the step-commit guarantee is decided:
``:at=allreduce`` fires in the middle of the gradient averaging (once the step's first gradient
bucket's all-reduce, or a sharded model's first gradient reduce-scatter, has started and before
the rest are), ``:at=after_vote`` once every rank has voted for the step and before this rank
applies it (its peers apply it), and ``:at=optimizer`` inside the wrapped optimizer's ``step()``,
once it has updated this rank's parameters and optimizer state and before the step is recorded as
committed (``step=``, if given, is the step in flight). These are claimed when their step starts,
so that the fault lands at its point with no round trip to the controller in between.

``:committed=C`` makes the fault wait, at its point, until the checkpoint of step C is committed
in the job's checkpoint root (at most ``COMMIT_WAIT_S``): a test whose premise is "the fault
finds step C in storage" then holds however slowly the background persister runs. Its
``injection`` event records the wait and whether the checkpoint was there.

Each injection fires at most once per job: the worker asks the controller to
claim it first, so a replayed step after a restart does not fault again. Parsing
runs in the CLI; firing runs in the worker.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

KINDS = {"kill": "rank", "node": "node", "hang": "rank", "raise": "rank", "stall": "rank"}
SYNTAX = ("KIND:rank=R:step=S (KIND: kill, hang, raise, stall) or node:node=N:step=S[:down=SECONDS], "
          "optionally :at=recovery|dump|persist|allreduce|after_vote|optimizer and :committed=STEP")
POINTS = ("step", "recovery", "dump", "persist", "allreduce", "after_vote", "optimizer")
COMMIT_WAIT_S = 60.0  # the longest a ``committed=`` injection waits for its checkpoint


class InjectionSpecError(ValueError):
    """An --inject value that does not parse; the message is one line."""


class InjectedFault(RuntimeError):
    """The exception an ``raise`` injection throws inside the training step."""


@dataclass(frozen=True)
class Injection:
    index: int
    kind: str
    step: int | None
    rank: int | None = None
    node: int | None = None
    at: str = "step"
    down: int | None = None  # node faults: seconds before the simulated node is rescheduled
    committed: int | None = None  # fire only once the checkpoint of this step is committed

    def text(self) -> str:
        target = f"node={self.node}" if self.kind == "node" else f"rank={self.rank}"
        step = "" if self.step is None else f":step={self.step}"
        point = "" if self.at == "step" else f":at={self.at}"
        down = "" if self.down is None else f":down={self.down}"
        committed = "" if self.committed is None else f":committed={self.committed}"
        return f"{self.kind}:{target}{step}{point}{down}{committed}"

    def targets(self, rank: int, node: int, local_rank: int, step: int) -> bool:
        """Does this injection fire in this worker at this step? (A node fault fires on local rank 0.)"""
        if self.step is not None and step != self.step:
            return False
        if self.kind == "node":
            return node == self.node and local_rank == 0
        return rank == self.rank


def parse_injection(text: str, index: int = 0) -> Injection:
    parts = text.strip().split(":")
    kind = parts[0]
    if kind not in KINDS:
        raise InjectionSpecError(
            f"--inject {text!r}: unknown kind {kind!r}; allowed: {', '.join(KINDS)} (syntax: {SYNTAX})"
        )
    values: dict[str, int] = {}
    point = "step"
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if key == "at" and sep and value in POINTS and "at" not in values:
            point = value
            values["at"] = 0
            continue
        allowed = ("rank", "node", "step", "committed", "down") if kind == "node" else ("rank", "node", "step", "committed")
        if (not sep or key not in allowed or key in values
                or not value.removeprefix("-").isdecimal()):
            raise InjectionSpecError(f"--inject {text!r}: bad field {part!r}; syntax: {SYNTAX}")
        values[key] = int(value)
    values.pop("at", None)
    down = values.pop("down", None)
    committed = values.pop("committed", None)
    target_key = KINDS[kind]
    required = {target_key} if point != "step" else {"step", target_key}
    if not required <= set(values) or not set(values) <= {"step", target_key}:
        needs = f"{target_key}= and step=" if point == "step" else f"{target_key}="
        raise InjectionSpecError(f"--inject {text!r}: needs exactly {needs}; syntax: {SYNTAX}")
    if any(value < 0 for value in values.values()):
        raise InjectionSpecError(f"--inject {text!r}: {target_key} and step must be >= 0; syntax: {SYNTAX}")
    for name, optional in (("down", down), ("committed", committed)):
        if optional is not None and optional < 0:
            raise InjectionSpecError(f"--inject {text!r}: {name} must be >= 0; syntax: {SYNTAX}")
    return Injection(index=index, kind=kind, step=values.get("step"), at=point, down=down, committed=committed,
                     **{target_key: values[target_key]})


def parse_injections(texts: list[str]) -> list[Injection]:
    return [parse_injection(text, index) for index, text in enumerate(texts)]


def encode(injections: list[Injection]) -> str:
    return ";".join(injection.text() for injection in injections)


def decode(text: str | None) -> list[Injection]:
    if not text:
        return []
    return parse_injections([part for part in text.split(";") if part])


def check_targets(injections: list[Injection], world_size: int, nnodes: int) -> None:
    """Reject injections aimed at ranks or nodes the job does not have."""
    for injection in injections:
        if injection.kind == "node" and injection.node is not None and injection.node >= nnodes:
            raise InjectionSpecError(f"--inject {injection.text()!r}: node must be < nnodes ({nnodes})")
        if injection.rank is not None and injection.rank >= world_size:
            raise InjectionSpecError(f"--inject {injection.text()!r}: rank must be < world size ({world_size})")


def fire(injection: Injection) -> None:
    """Carry out the fault in the calling worker. Does not return for kill, node and hang."""
    if injection.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif injection.kind == "node":
        # The agent leads the process group its workers share: this is the node dying at once.
        os.killpg(os.getpgrp(), signal.SIGKILL)
    elif injection.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif injection.kind == "raise":
        raise InjectedFault(f"injected fault {injection.text()}")
    elif injection.kind == "stall":
        while True:
            time.sleep(3600)
