"""How a rank waits for a gloo collective (runtime/pg.py ``_wait``): in the work's own ``wait``,
bounded to a poll period at a time. A peer that comes late, after many poll periods, still gives the
right sum; a peer whose group goes away mid-collective ends the wait with a ``CollectiveError``
at once, not at ``comm_timeout``; an abort from the controller ends it within a fraction of a second.

Two gloo ranks as threads of the test process (tests/unit/gloo_ranks.py).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.unit.gloo_ranks import run_ranks
from undying.runtime.pg import ABORT_POLL_S, CollectiveError, GenerationGroup

LATE_S = 10 * ABORT_POLL_S  # how late the peer joins: many bounded waits time out first


def test_a_peer_that_joins_late_gives_the_right_sum() -> None:
    def body(group: GenerationGroup) -> tuple[list[float], float]:
        if group.rank == 1:
            time.sleep(LATE_S)
        tensor = torch.tensor([1.0 + group.rank, 10.0], dtype=torch.float64)
        began = time.monotonic()
        group.allreduce_sum(tensor)
        return tensor.tolist(), time.monotonic() - began

    (sum0, waited0), (sum1, _) = run_ranks(2, body, prefix="late")
    assert sum0 == sum1 == [3.0, 20.0]
    assert waited0 >= LATE_S * 0.8  # rank 0 did wait through the bounded waits that timed out


def test_a_peer_gone_mid_collective_fails_the_wait_at_once() -> None:
    left = threading.Event()

    def body(group: GenerationGroup) -> float:
        if group.rank == 1:
            time.sleep(3 * ABORT_POLL_S)  # rank 0 is in its wait by now
            group.abandon()  # its sockets close, as when its process dies
            left.set()
            return 0.0
        began = time.monotonic()
        with pytest.raises(CollectiveError):
            group.allreduce_sum(torch.ones(4))
        return time.monotonic() - began

    waited, _ = run_ranks(2, body, prefix="gone")  # comm_timeout is 20 s there
    assert left.is_set()
    assert waited < 5.0


def test_an_abort_ends_the_wait_within_a_fraction_of_a_second() -> None:
    abort_at = [float("inf")]

    def options(rank: int) -> dict[str, object]:
        return {"should_abort": (lambda: time.monotonic() >= abort_at[0])} if rank == 0 else {}

    def body(group: GenerationGroup) -> float:
        if group.rank == 1:
            time.sleep(1.0)  # never joins rank 0's all-reduce before the abort
            return 0.0
        abort_at[0] = time.monotonic() + 4 * ABORT_POLL_S
        with pytest.raises(CollectiveError, match="aborted"):
            group.allreduce_sum(torch.ones(4))
        late = time.monotonic() - abort_at[0]
        group.abandon()
        return late

    late, _ = run_ranks(2, body, prefix="abort", options=options)
    assert late < 10 * ABORT_POLL_S  # a few poll periods, with room for a loaded machine
