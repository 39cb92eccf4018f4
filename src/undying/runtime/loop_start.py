"""Where ``ft.steps()`` starts when undying holds no state of the job: the step a script's own
checkpoint names (``ft.steps(max_steps, start=iter_num)``), the same state on every rank; and the
line a rank's log gets when steps it printed before are run again.

Runs in the worker, called by the step loop (runtime/step_loop.py) before the first step.
"""

from __future__ import annotations

import sys

import torch

from undying.runtime.pg import GenerationGroup
from undying.runtime.state_transfer import broadcast_state
from undying.runtime.training_state import TrainingState


def agree_on_start(group: GenerationGroup, start: int | None, device: torch.device) -> int | None:
    """The ``start`` every rank passed (None: none did), checked in one small all-reduce; raises
    ValueError, on every rank alike, if the ranks passed different ones."""
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
        raise ValueError(f"ft.steps: start must be an integer >= 0 (the step the script's own checkpoint "
                         f"resumes at), got {start!r}")
    value = float(start or 0)
    # Sums of 1, x and x*x: every rank passed the same x iff n * sum(x*x) == sum(x) ** 2 (exact in
    # float64 for any step count a job reaches).
    sums = torch.tensor([0.0 if start is None else 1.0, value, value * value], dtype=torch.float64, device=device)
    group.allreduce_sum(sums)
    passed, total, squares = sums.tolist()
    ranks = group.world_size
    if passed == 0:
        return None
    if passed != ranks or ranks * squares != total * total:
        raise ValueError(f"ft.steps: start differs between ranks ({int(passed)} of {ranks} passed one; "
                         f"{'their mean is ' + format(total / passed, 'g') if passed else ''}): every rank "
                         f"must pass the step its checkpoint names")
    return start


def start_from_script_checkpoint(state: TrainingState, group: GenerationGroup, device: torch.device,
                                 start: int) -> None:
    """Begin at committed step ``start`` with the first member's state on every rank: its models'
    weights and optimizer state (data parallel; each rank of a sharded job keeps the shard it loaded),
    the loaders' positions and the registered objects, as the script loaded them. A rank that read
    another file, or none, ends up with the same state as the others, so the steps that follow, and
    any recovery from them, are those of one job."""
    state.committed_step = start
    state.mark_commit_boundary()  # what replica_state hands out: the state as loaded, at step `start`
    source = state.replica_state() if group.rank == 0 else None
    received = broadcast_state(group, source, 0, device, live=state.replica_state())
    if group.rank != 0:
        state.load_replica_state(received)


def print_rerun_line(rank: int, step: int, generation: int, cause: str) -> None:
    """A line in this rank's output (its log under ``undying run``) before the first step after a
    recovery or a restore: what was printed before it for ``step`` and later belongs to an attempt
    given up at a fault, and those steps print again now."""
    print(f"--- undying: rank {rank} continues at step {step} (generation {generation}, after {cause}); "
          f"lines printed above for step {step} and later belong to an attempt given up at a fault ---",
          file=sys.stdout, flush=True)
