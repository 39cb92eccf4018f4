"""Fault injection with real faults, for tests, demos and benchmarks.

Syntax (``--inject``, may be repeated): ``KIND:key=value:key=value``

- ``kill:rank=R:step=S``   SIGKILL worker R as it reaches step S
- ``node:node=N:step=S``   SIGKILL node N's agent and all its workers at step S; with
  ``:down=D`` the simulated node stays down D seconds before it is rescheduled (elastic tests)
- ``hang:rank=R:step=S``   SIGSTOP worker R at step S (a hang, not a death)
- ``raise:rank=R:step=S``  raise an exception inside step S on worker R
- ``stall:rank=R:step=S``  worker R's training thread blocks forever at step S while the
  process (and its heartbeat thread) stays alive: a hang only ``step_timeout`` catches;
  with ``:seconds=D`` it blocks D seconds, then goes on (with ``at=persist``: a slow write)
- ``slow:rank=R:step=S:factor=F``  from step S on, each step of worker R takes F times as long
  (it sleeps ``F - 1`` times its own compute, outside the collectives): a straggler, for as long
  as the process lives (a replacement, on another node, runs at full speed)
- ``nan:rank=R:step=S``  worker R's model outputs are NaN in step S (a corrupted activation: its
  loss and, through backward, every rank's averaged gradients are NaN); ``:persistent`` makes
  every attempt of step S in that process NaN (a bad batch or a broken device), not only the first
- ``check:node=N``  every health check of the agent started as node N fails (agent/node_check.py): a
  node that must not be given ranks; a spare that adopts node N's place is not affected

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

KINDS = {"kill": "rank", "node": "node", "hang": "rank", "raise": "rank", "stall": "rank", "slow": "rank",
         "nan": "rank", "check": "node"}
SYNTAX = ("KIND:rank=R:step=S (KIND: kill, hang, raise, stall[:seconds=D], slow:...:factor=F, nan[:persistent]) "
          "or node:node=N:step=S[:down=SECONDS] or check:node=N, optionally "
          ":at=recovery|dump|persist|allreduce|after_vote|optimizer and :committed=STEP")
# Kinds carried out by the worker's step loop rather than ``fire`` (the process goes on).
SLOW, NAN, CHECK = "slow", "nan", "check"
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
    seconds: float | None = None  # stall: how long it blocks (None: forever)
    factor: float | None = None  # slow: how many times as long each step takes
    persistent: bool = False  # nan: every attempt of the step, not only the first

    def text(self) -> str:
        target = f"node={self.node}" if KINDS[self.kind] == "node" else f"rank={self.rank}"
        step = "" if self.step is None else f":step={self.step}"
        point = "" if self.at == "step" else f":at={self.at}"
        down = "" if self.down is None else f":down={self.down}"
        committed = "" if self.committed is None else f":committed={self.committed}"
        seconds = "" if self.seconds is None else f":seconds={self.seconds:g}"
        factor = "" if self.factor is None else f":factor={self.factor:g}"
        persistent = ":persistent" if self.persistent else ""
        return f"{self.kind}:{target}{step}{point}{down}{committed}{seconds}{factor}{persistent}"

    def targets(self, rank: int, node: int, local_rank: int, step: int) -> bool:
        """Does this injection fire in this worker at this step? (A node fault fires on local rank 0.)"""
        if self.kind == CHECK:
            return False  # fired by the agent's health check, never by a worker
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
    extras: dict[str, float] = {}
    persistent = False
    point = "step"
    allowed = {"node": ("rank", "node", "step", "committed", "down"), "check": ("node",)}.get(
        kind, ("rank", "node", "step", "committed"))
    numbers = {"stall": "seconds", "slow": "factor"}.get(kind)  # a kind's own number (a float)
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if key == "at" and sep and value in POINTS and "at" not in values and kind != CHECK:
            point = value
            values["at"] = 0
            continue
        if kind == NAN and part == "persistent" and not persistent:
            persistent = True
            continue
        if key == numbers and sep and key not in extras:
            try:
                extras[key] = float(value)
            except ValueError:
                raise InjectionSpecError(f"--inject {text!r}: {key} must be a number; syntax: {SYNTAX}") from None
            continue
        if (not sep or key not in allowed or key in values
                or not value.removeprefix("-").isdecimal()):
            raise InjectionSpecError(f"--inject {text!r}: bad field {part!r}; syntax: {SYNTAX}")
        values[key] = int(value)
    values.pop("at", None)
    down = values.pop("down", None)
    committed = values.pop("committed", None)
    target_key = KINDS[kind]
    required = {target_key} if point != "step" or kind == CHECK else {"step", target_key}
    if not required <= set(values) or not set(values) <= {"step", target_key}:
        needs = f"{target_key}= and step=" if len(required) == 2 else f"{target_key}="
        raise InjectionSpecError(f"--inject {text!r}: needs exactly {needs}; syntax: {SYNTAX}")
    if any(value < 0 for value in values.values()):
        raise InjectionSpecError(f"--inject {text!r}: {target_key} and step must be >= 0; syntax: {SYNTAX}")
    for name, optional in (("down", down), ("committed", committed)):
        if optional is not None and optional < 0:
            raise InjectionSpecError(f"--inject {text!r}: {name} must be >= 0; syntax: {SYNTAX}")
    if kind == "slow" and not extras.get("factor", 0) > 1:
        raise InjectionSpecError(f"--inject {text!r}: slow needs factor=F with F > 1; syntax: {SYNTAX}")
    if kind == "stall" and "seconds" in extras and not extras["seconds"] > 0:
        raise InjectionSpecError(f"--inject {text!r}: seconds must be > 0; syntax: {SYNTAX}")
    return Injection(index=index, kind=kind, step=values.get("step"), at=point, down=down, committed=committed,
                     seconds=extras.get("seconds"), factor=extras.get("factor"), persistent=persistent,
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
        # A check may aim at a spare too: spare ids start at nnodes.
        if injection.kind == "node" and injection.node is not None and injection.node >= nnodes:
            raise InjectionSpecError(f"--inject {injection.text()!r}: node must be < nnodes ({nnodes})")
        if injection.rank is not None and injection.rank >= world_size:
            raise InjectionSpecError(f"--inject {injection.text()!r}: rank must be < world size ({world_size})")


def fire(injection: Injection) -> None:
    """Carry out the fault in the calling worker. Does not return for kill, node, hang and a stall
    without seconds. (``slow`` and ``nan`` are carried out by the step loop, ``check`` by the agent.)"""
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
        if injection.seconds is not None:
            time.sleep(injection.seconds)
            return
        while True:
            time.sleep(3600)
