"""Recover-in-place from node memory, with real processes: a SIGKILLed worker's replacement loads its
node's T1 snapshot of the step instead of receiving the state from a peer (data parallel), and a pure
FSDP job (1 x 4, no replica of any shard) recovers in place at all, from T1: at the plan's step when
the replacement's T1 holds it, else every rank goes back to the newest step all hold in T1. The
survivors keep their processes and the final parameters are bitwise those of the fault-free run."""

from __future__ import annotations

import pytest

from tests.conftest import STEPS, JobRun, assert_ends_bitwise, run_job
from undying import events as ev
from undying.protocol import WORKER_EXIT_REPAIR_REFUSED

pytestmark = pytest.mark.faults

IN_PLACE = ["--set", "process_recover=true", "--recover-strategy", "retry,recover-in-place"]
PURE_FSDP = ["--mesh", "1x4"]
HSDP = ["--mesh", "2x2"]


def assert_recovered_in_place(run: JobRun, reference: JobRun, replaced: int) -> None:
    """Bitwise the reference's parameters; no job restart; only ``replaced`` runs in a new process."""
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference)
    assert not run.kinds(ev.RESTART_BEGIN), "recover-in-place must not restart the job"
    assert len(run.kinds(ev.RECOVERY_PLAN)) == 1, "one recovery, the replacement's repair did not fail"
    assert run.kinds(ev.RECOVERY_PLAN)[-1].details["strategy"] == "recover-in-place"
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    recovered = {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED)}
    assert {rank for rank in range(4) if recovered[rank] != first[rank]} == {replaced}, (first, recovered)


def received(run: JobRun, kind: str) -> dict[int, str]:
    """Receiving rank -> where its state (or shard) came from."""
    return {e.rank: e.details["source"] for e in run.kinds(kind)}


def test_a_killed_workers_replacement_loads_its_state_from_its_nodes_t1(reference_run: JobRun, tmp_path) -> None:
    """Data parallel, a snapshot every step: the replacement of rank 1 reads its node's snapshot of the
    plan's step; the source replica sends nothing."""
    run = run_job(tmp_path, [*IN_PLACE, "--inject", "kill:rank=1:step=15"])
    assert_recovered_in_place(run, reference_run, replaced=1)
    assert received(run, ev.STATE_RECEIVED) == {1: "t1"}
    [state] = run.kinds(ev.STATE_RECEIVED)
    assert state.step == run.kinds(ev.RECOVERY_PLAN)[-1].step


def test_an_hsdp_replacement_loads_its_shard_from_t1_not_from_the_other_replica(hsdp_reference: JobRun,
                                                                                tmp_path) -> None:
    """2 x 2: rank 1 of replica 1 would hold rank 3's shard; the replacement reads its own T1 instead."""
    run = run_job(tmp_path, [*IN_PLACE, "--inject", "kill:rank=3:step=15"], script_args=HSDP)
    assert_recovered_in_place(run, hsdp_reference, replaced=3)
    assert received(run, ev.SHARD_RECEIVED) == {3: "t1"}
    assert received(run, ev.STATE_RECEIVED) == {3: "t1"}


def test_pure_fsdp_recovers_a_killed_worker_in_place_from_t1(fsdp_reference: JobRun, tmp_path) -> None:
    """1 x 4: no replica holds rank 2's shard, its node's T1 snapshot does."""
    run = run_job(tmp_path, [*IN_PLACE, "--inject", "kill:rank=2:step=15"], script_args=PURE_FSDP)
    assert_recovered_in_place(run, fsdp_reference, replaced=2)
    assert received(run, ev.SHARD_RECEIVED) == {2: "t1"}
    assert received(run, ev.STATE_RECEIVED) == {2: "t1"}
    assert not run.kinds(ev.T1_ROLLBACK)


def test_pure_fsdp_rolls_every_rank_back_to_the_newest_common_t1_step(fsdp_reference: JobRun, tmp_path) -> None:
    """Snapshots every 4 steps: the replacement's T1 lacks the plan's step, so every rank (the
    survivors in their own processes) goes back to the newest step all hold in T1 and trains on from
    there; the controller and the heartbeats follow that step, and the result is still bitwise."""
    run = run_job(tmp_path, [*IN_PLACE, "--set", "checkpoint.snapshot_interval=4",
                             "--inject", "kill:rank=2:step=15"], script_args=PURE_FSDP)
    assert_recovered_in_place(run, fsdp_reference, replaced=2)
    plan = run.kinds(ev.RECOVERY_PLAN)[-1]
    rollbacks = run.kinds(ev.T1_ROLLBACK)
    assert {e.rank for e in rollbacks} == {0, 1, 2, 3}
    [step] = {e.step for e in rollbacks}
    assert step % 4 == 0 and step < plan.step, (step, plan.step)
    assert {e.details["target"] for e in rollbacks} == {plan.step}
    assert {e.rank: e.step for e in run.kinds(ev.RECOVERED)} == dict.fromkeys(range(4), step)
    assert received(run, ev.SHARD_RECEIVED) == {2: "t1"}


def test_pure_fsdp_without_a_t1_snapshot_of_the_lost_shard_falls_back_to_a_job_restart(fsdp_reference: JobRun,
                                                                                       tmp_path) -> None:
    """No snapshot before step 50, no checkpoint before step 100: when rank 2 dies at step 15 nothing
    holds its shard. The repair is refused on every rank (shard lost): each exits with the refusal's
    exit status, which the controller reads as a refused repair (not the script failing); the chain
    goes on to a job restart, which finds nothing to restore and trains from step 0: the same
    parameters at the end."""
    run = run_job(tmp_path, [*IN_PLACE, "--checkpoint-interval", "100", "--set", "checkpoint.snapshot_interval=50",
                             "--inject", "kill:rank=2:step=15"], script_args=PURE_FSDP)
    assert run.returncode == 0, run.output + run.logs()
    assert_ends_bitwise(run, fsdp_reference)
    assert run.kinds(ev.RESTART_BEGIN)
    assert not run.kinds(ev.T1_ROLLBACK) and not run.kinds(ev.STATE_RECEIVED)
    logs = [log.read_text() for log in (run.run_dir / "logs").glob("rank*.log")]
    assert any("ShardLost" in log and "no step of T1 or of its peer copies" in log for log in logs), run.logs()
    refused = [e for e in run.kinds(ev.FAULT_DETECTED) if e.details["repair_refused"]]
    assert refused and {e.details["exitcode"] for e in refused} == {WORKER_EXIT_REPAIR_REFUSED}, \
        run.kinds(ev.FAULT_DETECTED)
    assert "(repair refused): undying.runtime.sharded.ShardLost" in refused[0].details["description"]


NODE_LOSSES = ["--set", "process_recover=true", "--set", "pod_rescheduling=on",
               "--recover-strategy", "retry,recover-in-place,recover", "--standby", "2"]


def test_pure_fsdp_survives_two_node_losses_onto_two_spares_from_the_peer_copies(fsdp_reference: JobRun,
                                                                                tmp_path) -> None:
    """1 x 4 on 2 nodes, two spares: node 1 (ranks 2 and 3) is lost at step 9, node 0 (ranks 0 and 1)
    at step 21, each with its memory, T1 and all. Each time a spare takes the lost node's place, its
    ranks receive their shards from the copies the other node keeps of their snapshots
    (checkpoint.peer_copy), every rank goes back to the newest step that it holds or has a complete
    copy of (never before the job's anchor: the newest step every rank's copy was confirmed of in a
    vote), and nothing is read from T2. The second loss needs the copies re-established after the
    first: ranks 0 and 1 copy to the spare's new processes. Snapshots every 2 steps: at an odd step no
    copy is under way when the node dies, so the survivors' senders still hold the dead holders'
    addresses, as when a node dies between two copies. The survivors keep their processes and the
    final parameters are bitwise the fault-free run's."""
    run = run_job(tmp_path, [*NODE_LOSSES, "--set", "checkpoint.snapshot_interval=2",
                             "--inject", "node:node=1:step=9", "--inject", "node:node=0:step=21"],
                  script_args=PURE_FSDP)
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, fsdp_reference)
    assert not run.kinds(ev.RESTART_BEGIN), "a job restart would read T2"
    assert not run.kinds(ev.CHECKPOINT_LOAD), "nothing is loaded from T2 (or T1 at a restart)"
    assert [e.details["strategy"] for e in run.kinds(ev.DECISION)] == ["recover", "recover"]
    plans = run.kinds(ev.RECOVERY_PLAN)
    assert [plan.generation for plan in plans] == [2, 3], [plan.details for plan in plans]
    pids = {(e.generation, e.rank): e.details["pid"] for e in [*run.kinds(ev.WORKER_READY), *run.kinds(ev.RECOVERED)]}
    # The survivors of each loss kept their processes; the spares' ranks are new ones.
    assert [pids[2, rank] == pids[1, rank] for rank in range(4)] == [True, True, False, False]
    assert [pids[3, rank] == pids[2, rank] for rank in range(4)] == [False, False, True, True]
    # Anchors: each step every rank's copy was confirmed at (reported at the rank's next commit).
    anchored: dict[int, set[int]] = {}
    for event in run.kinds(ev.PEER_COPY):
        anchored.setdefault(event.step, set()).add(event.rank)
    previous = 0
    for plan, lost, holders in zip(plans, ([2, 3], [0, 1]), ({2: 0, 3: 1}, {0: 2, 1: 3}), strict=True):
        copies = {e.rank: (e.details["source"], e.details["donor"]) for e in run.kinds(ev.SHARD_RECEIVED)
                  if e.generation == plan.generation}
        assert copies == {rank: ("peer_copy", holders[rank]) for rank in lost}, copies
        rollbacks = [e for e in run.kinds(ev.T1_ROLLBACK) if e.generation == plan.generation]
        assert {e.rank for e in rollbacks} == {0, 1, 2, 3}
        [step] = {e.step for e in rollbacks}
        # Copies confirmed by every rank since the previous recovery: the peer copies were made again.
        anchor = max(anchor for anchor, ranks in anchored.items() if ranks == {0, 1, 2, 3} and previous < anchor
                     and anchor <= plan.step)
        assert anchor <= step <= plan.step, (anchor, step, plan.step)
        previous = step


def test_a_job_restart_after_a_lost_node_restores_its_ranks_from_the_peer_copies(fsdp_reference: JobRun,
                                                                                 tmp_path) -> None:
    """1 x 4 on 2 nodes, no process-level strategy: node 1 is lost at step 15 and the job restarts. Its
    ranks' T1 died with it, but node 0 keeps copies of their snapshots: the restart restores from
    memory (ranks 0 and 1 from their T1, ranks 2 and 3 from the copies their holders send), not from
    the step-10 checkpoint in storage, and ends bitwise equal to the fault-free run."""
    run = run_job(tmp_path, ["--inject", "node:node=1:step=15"], script_args=PURE_FSDP)
    assert run.returncode == 0, run.output + run.logs()
    assert_ends_bitwise(run, fsdp_reference)
    assert run.kinds(ev.RESTART_BEGIN)
    loads = [e for e in run.kinds(ev.CHECKPOINT_LOAD) if e.generation > 1]
    assert {e.details["source"] for e in loads} == {"memory"}, [e.details for e in loads]
    [step] = {e.step for e in loads}
    assert step <= 15
    assert {e.rank: e.details.get("peer_copy") for e in loads} == {0: None, 1: None, 2: 0, 3: 1}
