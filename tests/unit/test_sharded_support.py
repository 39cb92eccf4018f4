"""What a sharded job's mesh lets each recovery strategy do (sharded_support.py): the one table the
worker checks at ``ft.device_mesh`` and the controller's strategies check in their ``applies()``."""

from __future__ import annotations

import pytest

from undying import events as ev
from undying.protocol import Heartbeat, Phase, WorkerState
from undying.sharded_support import mesh_refusal, usable_strategies
from undying.strategy_names import StrategyName as S


@pytest.mark.parametrize(("strategy", "replicate", "t1", "peer", "refused"), [
    (S.RECOVER_IN_PLACE, 2, False, False, None),
    (S.DUMP, 2, False, False, None),
    (S.RETRY, 1, False, False, None),
    (S.RECOVER_IN_PLACE, 1, False, False, "needs T1 snapshots"),
    (S.RECOVER_IN_PLACE, 1, True, False, None),
    (S.RECOVER, 1, True, False, "needs peer copies of T1"),
    (S.RECOVER, 1, True, True, None),
    (S.RECOVER, 1, False, False, "no other replica"),
    (S.DUMP, 1, True, True, "no other replica"),
    (S.ELASTIC, 1, True, True, "no other replica"),
])
def test_the_table(strategy, replicate, t1, peer, refused):
    why = mesh_refusal(strategy, replicate, t1, peer)
    assert (why is None) == (refused is None) and (refused is None or refused in why), why
    assert (strategy in usable_strategies(replicate, t1, peer)) == (why is None)


def test_the_controller_refuses_what_the_mesh_left_cannot_serve(make_job):
    """A 1 x 4 mesh (pure FSDP) without T1 snapshots, as an HSDP job is after an elastic shrink to
    one replica: a killed rank's shard is held by no one, so recover-in-place does not apply and
    the chain goes on to a job restart at once (the repair is not tried to fail)."""
    job = make_job(nnodes=2, nproc_per_node=2, process_recover=True,
                   recover_strategy=["recover-in-place"], checkpoint={"snapshot_interval": 0})
    decision = decide_on_a_killed_rank(job, mesh_shard=4)
    assert decision.details["strategy"] == "job-restart", decision.details
    assert "needs T1 snapshots" in str(decision.details), decision.details

    data_parallel = make_job(nnodes=2, nproc_per_node=2, process_recover=True,
                             recover_strategy=["recover-in-place"], checkpoint={"snapshot_interval": 0})
    assert decide_on_a_killed_rank(data_parallel, mesh_shard=0).details["strategy"] == "recover-in-place"


def decide_on_a_killed_rank(job, mesh_shard: int):
    """Every rank beats at step 7 with its mesh; rank 3's process exits 1: the chain's decision."""
    job.start_running()
    for rank in range(4):
        job.controller.heartbeat(Heartbeat(rank, rank // 2, 1, 7, Phase.COMPUTING, 2000 + rank, mesh_shard=mesh_shard))
    workers = job.statuses(1, 1)
    workers[1] = {**workers[1], "state": WorkerState.EXITED, "exitcode": 1}
    job.poll(1, 1, workers)
    assert job.wait_for(lambda: bool(job.events(ev.DECISION)))
    return job.events(ev.DECISION)[0]
