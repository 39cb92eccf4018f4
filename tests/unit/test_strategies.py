"""The recovery chain: process-level strategies in MindCluster's order, each with its refusals,
then job-level restart until max_restarts, then exit."""

from __future__ import annotations

import pytest

from undying.config import JobSpec, SpecError, validate_job_spec
from undying.controller import strategies
from undying.controller.strategies import (
    BUILT,
    RecoveryContext,
    decide,
    describe_chain,
    effective_chain,
    unbuilt_strategies,
)
from undying.controller.strategies.dump import Dump
from undying.controller.strategies.elastic import Elastic
from undying.controller.strategies.process import Recover, RecoverInPlace, Retry
from undying.faults import Fault
from undying.strategy_names import StrategyName

RETRY, RECOVER_IN_PLACE, RECOVER = StrategyName.RETRY, StrategyName.RECOVER_IN_PLACE, StrategyName.RECOVER
ELASTIC, DUMP = StrategyName.ELASTIC, StrategyName.DUMP
JOB_RESTART, EXIT = StrategyName.JOB_RESTART, StrategyName.EXIT
MAX_RETRIES_PER_STEP = Retry.max_retries_per_step

KILLED = Fault("worker_exit", node=0, rank=1, step=25, exitcode=-9, signal="SIGKILL")
STEP_FAILED = Fault("step_failed", node=0, rank=1, step=25, detail="allreduce timed out")
NODE_LOST = Fault("agent_lost", node=1, step=25)

PROCESS_STRATEGIES = [RETRY, RECOVER_IN_PLACE, RECOVER, DUMP]
# 2 nodes x 2 ranks, every process-level strategy enabled.
FULL = JobSpec(process_recover=True, recover_strategy=[*PROCESS_STRATEGIES, "exit"], pod_rescheduling="on",
               nnodes=2, nproc_per_node=2, max_restarts=5)
BOTH_NODES = frozenset({0, 1})


def context(spec: JobSpec = FULL, restart_count: int = 0, alive_nodes: frozenset[int] = BOTH_NODES,
            lost_ranks: frozenset[int] = frozenset(), retries_at_step: int = 0,
            excluded: frozenset[str] = frozenset()) -> RecoveryContext:
    return RecoveryContext(spec, restart_count, alive_nodes, lost_ranks, retries_at_step, excluded)


def test_job_restart_until_max_restarts_then_exit():
    spec = JobSpec(max_restarts=3)
    for restart_count in range(3):
        decision = decide(KILLED, RecoveryContext(spec, restart_count))
        assert decision.strategy == JOB_RESTART
        assert decision.reason == KILLED.describe()
    for restart_count in (3, 4):
        decision = decide(KILLED, RecoveryContext(spec, restart_count))
        assert decision.strategy == EXIT
        assert decision.reason == "job-restart: max_restarts (3) exhausted"


def test_max_restarts_zero_exits_on_the_first_fault():
    decision = decide(Fault("agent_lost", node=1), RecoveryContext(JobSpec(max_restarts=0), 0))
    assert decision.strategy == EXIT
    assert "max_restarts (0)" in decision.reason


def test_the_default_chain_is_job_restart_then_exit():
    spec = JobSpec()
    assert [strategy.name for strategy in effective_chain(spec)] == [JOB_RESTART, EXIT]
    assert unbuilt_strategies(spec) == []
    assert describe_chain(spec) == "recovery: job-restart -> exit"


def test_the_banner_lists_only_strategies_that_can_start():
    """max_restarts 0 leaves exit alone (every other strategy spends a restart); fault_scheduling: off
    forbids the job restart (and recover, which the spec refuses)."""
    listed = JobSpec(process_recover=True, recover_strategy=["retry", "recover-in-place"])
    assert describe_chain(listed) == "recovery: retry -> recover-in-place -> job-restart -> exit"
    assert describe_chain(listed.model_copy(update={"max_restarts": 0})) == (
        "recovery: exit (retry, recover-in-place, job-restart: never started, max_restarts is 0)")
    assert describe_chain(listed.model_copy(update={"fault_scheduling": "off"})) == (
        "recovery: retry -> recover-in-place -> exit (job-restart: never started, fault_scheduling is off)")


def test_every_process_level_strategy_is_built():
    assert sorted(BUILT) == sorted([*PROCESS_STRATEGIES, ELASTIC])
    assert {name: type(strategy) for name, strategy in BUILT.items()} == {
        RETRY: Retry, RECOVER_IN_PLACE: RecoverInPlace, RECOVER: Recover, ELASTIC: Elastic, DUMP: Dump}
    assert all(strategy.name == name for name, strategy in BUILT.items())
    spec = JobSpec(process_recover=True, recover_strategy=["retry", "elastic-training", "dump", "exit"])
    assert unbuilt_strategies(spec) == []
    assert describe_chain(spec) == "recovery: retry -> elastic-training -> dump -> job-restart -> exit"


ELASTIC_ONLY = JobSpec(process_recover=True, recover_strategy=["elastic-training"], nnodes=3, nproc_per_node=2)
THREE_NODES = frozenset({0, 1, 2})


def test_elastic_training_takes_a_lost_node_only():
    # A node whose agent is gone: train on without it.
    lost_node = context(ELASTIC_ONLY, alive_nodes=frozenset({0, 2}), lost_ranks=frozenset({2, 3}))
    lost_node = RecoveryContext(**{**lost_node.__dict__, "lost_nodes": frozenset({1})})
    assert decide(NODE_LOST, lost_node).strategy == ELASTIC
    # A process on a live node: its agent restarts it; elastic training does not shrink for that.
    on_live_node = context(ELASTIC_ONLY, alive_nodes=THREE_NODES, lost_ranks=frozenset({1}))
    decision = decide(KILLED, on_live_node)
    assert decision.strategy == JOB_RESTART
    assert decision.reason == "elastic-training: no node is lost (its agent can restart the process)"


def test_elastic_training_refuses_below_min_nodes():
    spec = ELASTIC_ONLY.model_copy(update={"min_nodes": 3})
    below = RecoveryContext(spec, 0, frozenset({0, 2}), frozenset({2, 3}), lost_nodes=frozenset({1}))
    decision = decide(NODE_LOST, below)
    assert decision.strategy == JOB_RESTART
    assert decision.reason == "elastic-training: 2 node(s) left, below min_nodes (3)"
    at_minimum = RecoveryContext(spec.model_copy(update={"min_nodes": 2}), 0, frozenset({0, 2}),
                                 frozenset({2, 3}), lost_nodes=frozenset({1}))
    assert decide(NODE_LOST, at_minimum).strategy == ELASTIC


def test_recover_comes_before_elastic_training_when_pods_are_rescheduled():
    spec = ELASTIC_ONLY.model_copy(update={"recover_strategy": ["recover", "elastic-training"],
                                           "pod_rescheduling": "on"})
    lost = RecoveryContext(spec, 0, frozenset({0, 2}), frozenset({2, 3}), lost_nodes=frozenset({1}))
    assert decide(NODE_LOST, lost).strategy == RECOVER
    # Once recover has failed (the node did not come back), elastic training takes over.
    excluded = RecoveryContext(**{**lost.__dict__, "excluded": frozenset({RECOVER})})
    assert decide(NODE_LOST, excluded).strategy == ELASTIC


class RefusingRetry(Retry):
    name = StrategyName.RETRY

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        return None if fault.reason == "heartbeat_missed" else "only for hangs"


def test_a_built_strategy_is_tried_first_and_its_refusal_is_the_reason(monkeypatch):
    monkeypatch.setitem(strategies.BUILT, "retry", RefusingRetry())
    spec = JobSpec(process_recover=True, recover_strategy=["retry"])
    assert [strategy.name for strategy in effective_chain(spec)] == ["retry", JOB_RESTART, EXIT]
    assert describe_chain(spec) == "recovery: retry -> job-restart -> exit"

    hang = Fault("heartbeat_missed", node=0, rank=0, step=3)
    assert decide(hang, RecoveryContext(spec, 0)).strategy == "retry"
    decision = decide(KILLED, RecoveryContext(spec, 0))
    assert (decision.strategy, decision.reason) == (JOB_RESTART, "retry: only for hangs")
    spec = spec.model_copy(update={"max_restarts": 0})
    decision = decide(KILLED, RecoveryContext(spec, 0))
    assert decision.strategy == EXIT
    assert decision.reason == "retry: only for hangs; job-restart: max_restarts (0) exhausted"


def test_a_built_strategy_the_spec_does_not_list_is_not_used(monkeypatch):
    monkeypatch.setitem(strategies.BUILT, "retry", RefusingRetry())
    assert [strategy.name for strategy in effective_chain(JobSpec())] == [JOB_RESTART, EXIT]


# ---------------------------------------------------------------- the chain's order


def test_the_chain_follows_mindclusters_order_whatever_order_the_spec_lists():
    spec = JobSpec(process_recover=True, recover_strategy=["exit", "dump", "recover", "recover-in-place", "retry"],
                   pod_rescheduling="on")
    assert [strategy.name for strategy in effective_chain(spec)] == [
        RETRY, RECOVER_IN_PLACE, RECOVER, DUMP, JOB_RESTART, EXIT]
    assert describe_chain(spec) == "recovery: retry -> recover-in-place -> recover -> dump -> job-restart -> exit"


@pytest.mark.parametrize("listed", [[RETRY], [RECOVER_IN_PLACE, DUMP], [RECOVER], [DUMP, RETRY]])
def test_the_chain_holds_only_the_strategies_the_spec_lists(listed):
    spec = JobSpec(process_recover=True, recover_strategy=listed, pod_rescheduling="on")
    expected = [name for name in PROCESS_STRATEGIES if name in listed]
    assert [strategy.name for strategy in effective_chain(spec)] == [*expected, JOB_RESTART, EXIT]


def test_without_process_recover_only_job_restart_and_exit_are_used():
    # The spec refuses the combination; a copy that skips validation still uses none of them.
    with pytest.raises(SpecError, match="needs process_recover: true"):
        validate_job_spec({"process_recover": False, "recover_strategy": ["retry", "dump"]})
    spec = FULL.model_copy(update={"process_recover": False})
    assert [strategy.name for strategy in effective_chain(spec)] == [JOB_RESTART, EXIT]
    for fault, lost in ((STEP_FAILED, frozenset()), (KILLED, frozenset({1})), (NODE_LOST, frozenset({2, 3}))):
        decision = decide(fault, context(spec, lost_ranks=lost))
        assert (decision.strategy, decision.reason) == (JOB_RESTART, fault.describe())


def test_each_kind_of_fault_lands_on_its_strategy_in_the_full_chain():
    # A failed step with every process alive: retry.
    decision = decide(STEP_FAILED, context())
    assert (decision.strategy, decision.reason) == (RETRY, STEP_FAILED.describe())
    # A dead process on a live node: retry refuses, recover-in-place takes it.
    decision = decide(KILLED, context(lost_ranks=frozenset({1})))
    assert (decision.strategy, decision.reason) == (RECOVER_IN_PLACE, "retry: a process is gone or hung")
    # A lost node: recover (pod rescheduling), after retry and recover-in-place refuse.
    decision = decide(NODE_LOST, context(alive_nodes=frozenset({0}), lost_ranks=frozenset({2, 3})))
    assert decision.strategy == RECOVER
    assert decision.reason == "retry: a process is gone or hung; recover-in-place: the node itself is lost"


def test_a_lost_node_without_pod_rescheduling_falls_to_dump_then_job_restart():
    spec = FULL.model_copy(update={"pod_rescheduling": "off", "nnodes": 3, "nproc_per_node": 1})
    alive = frozenset({0, 1})
    decision = decide(Fault("agent_lost", node=2), context(spec, alive_nodes=alive, lost_ranks=frozenset({2})))
    assert decision.strategy == DUMP
    assert decision.reason == ("retry: a process is gone or hung; recover-in-place: the node itself is lost; "
                               "recover: pod_rescheduling is off")
    # Two of three nodes gone: no majority left to write the dying checkpoint.
    decision = decide(Fault("agent_lost", node=2),
                      context(spec, alive_nodes=frozenset({0}), lost_ranks=frozenset({1, 2})))
    assert decision.strategy == JOB_RESTART
    assert decision.reason.endswith("dump: no more than half of the ranks are healthy")


def test_the_failed_steps_retry_budget_moves_the_chain_on():
    for retries in range(MAX_RETRIES_PER_STEP):
        assert decide(STEP_FAILED, context(retries_at_step=retries)).strategy == RETRY
    decision = decide(STEP_FAILED, context(retries_at_step=MAX_RETRIES_PER_STEP))
    assert decision.strategy != RETRY
    assert decision.reason.startswith(f"retry: step already retried {MAX_RETRIES_PER_STEP} times")


def test_excluded_strategies_are_skipped_as_already_failed():
    decision = decide(KILLED, context(lost_ranks=frozenset({1}), excluded=frozenset({RECOVER_IN_PLACE})))
    assert decision.strategy == DUMP
    assert decision.reason == ("retry: a process is gone or hung; recover-in-place: already failed; "
                               "recover: not a lost node")
    everything = frozenset(PROCESS_STRATEGIES)
    decision = decide(STEP_FAILED, context(excluded=everything))
    assert decision.strategy == JOB_RESTART
    assert decision.reason == "; ".join(f"{name}: already failed" for name in PROCESS_STRATEGIES)
    # Exclusion does not reach past the process-level strategies: exit still ends it.
    decision = decide(STEP_FAILED, context(restart_count=5, excluded=everything))
    assert decision.strategy == EXIT


def test_max_restarts_exhausted_refuses_every_strategy_then_exits():
    decision = decide(KILLED, context(restart_count=FULL.max_restarts, lost_ranks=frozenset({1})))
    assert decision.strategy == EXIT
    assert decision.reason == ("retry: a process is gone or hung; recover-in-place: max_restarts (5) exhausted; "
                               "recover: not a lost node; dump: max_restarts (5) exhausted; "
                               "job-restart: max_restarts (5) exhausted")


# ---------------------------------------------------------------- each strategy alone


def test_retry_applies_only_to_a_failed_step_with_every_process_alive():
    retry = Retry()
    assert retry.applies(STEP_FAILED, context()) is None
    assert retry.applies(STEP_FAILED, context(retries_at_step=MAX_RETRIES_PER_STEP - 1)) is None
    assert retry.applies(STEP_FAILED, context(lost_ranks=frozenset({3}))) == "a process is gone or hung"
    for other in (KILLED, NODE_LOST, Fault("heartbeat_missed", node=0, rank=1),
                  Fault("start_timeout", node=0, rank=1)):
        assert retry.applies(other, context()) == "a process is gone or hung"
    assert retry.applies(STEP_FAILED, context(retries_at_step=MAX_RETRIES_PER_STEP)) == \
        f"step already retried {MAX_RETRIES_PER_STEP} times"
    assert retry.applies(STEP_FAILED, context(retries_at_step=MAX_RETRIES_PER_STEP + 3)) == \
        f"step already retried {MAX_RETRIES_PER_STEP + 3} times"


def test_recover_in_place_needs_a_live_node_and_a_survivor():
    recover_in_place = RecoverInPlace()
    one_dead = frozenset({1})
    assert recover_in_place.applies(KILLED, context(lost_ranks=one_dead)) is None
    hang = Fault("heartbeat_missed", node=1, rank=2, step=25)
    assert recover_in_place.applies(hang, context(lost_ranks=frozenset({2}))) is None
    assert recover_in_place.applies(Fault("worker_exit", rank=1, exitcode=1), context(lost_ranks=one_dead)) is None

    assert recover_in_place.applies(NODE_LOST, context(lost_ranks=frozenset({2, 3}))) == "the node itself is lost"
    assert recover_in_place.applies(KILLED, context(alive_nodes=frozenset({1}), lost_ranks=one_dead)) == \
        "the failed rank's node is not alive"
    everyone = frozenset(range(FULL.world_size))
    assert recover_in_place.applies(KILLED, context(lost_ranks=everyone)) == "no healthy replica holds the state"


def test_recover_needs_a_lost_node_pod_rescheduling_and_a_survivor():
    recover = Recover()
    lost = frozenset({2, 3})
    assert recover.applies(NODE_LOST, context(alive_nodes=frozenset({0}), lost_ranks=lost)) is None
    assert recover.applies(KILLED, context(lost_ranks=frozenset({1}))) == "not a lost node"
    assert recover.applies(STEP_FAILED, context()) == "not a lost node"
    off = FULL.model_copy(update={"pod_rescheduling": "off"})
    assert recover.applies(NODE_LOST, context(off, lost_ranks=lost)) == "pod_rescheduling is off"
    everyone = frozenset(range(FULL.world_size))
    assert recover.applies(NODE_LOST, context(alive_nodes=frozenset(), lost_ranks=everyone)) == \
        "no healthy replica holds the state"


@pytest.mark.parametrize(
    ("world", "lost", "refusal"),
    [
        (4, 0, None),
        (4, 1, None),
        (4, 2, "no more than half of the ranks are healthy"),
        (4, 3, "no more than half of the ranks are healthy"),
        (3, 1, None),
        (3, 2, "no more than half of the ranks are healthy"),
        (1, 1, "no more than half of the ranks are healthy"),
    ],
)
def test_dump_needs_more_than_half_of_the_ranks_healthy(world, lost, refusal):
    spec = FULL.model_copy(update={"nnodes": world, "nproc_per_node": 1})
    assert Dump().applies(KILLED, context(spec, lost_ranks=frozenset(range(lost)))) == refusal


@pytest.mark.parametrize(
    ("strategy", "fault", "lost"),
    [(Retry(), STEP_FAILED, frozenset()), (RecoverInPlace(), KILLED, frozenset({1})),
     (Recover(), NODE_LOST, frozenset({2, 3})), (Dump(), KILLED, frozenset({1}))],
    ids=lambda value: getattr(value, "name", ""),
)
def test_every_strategy_is_bounded_by_max_restarts(strategy, fault, lost):
    alive = frozenset({0}) if fault is NODE_LOST else BOTH_NODES
    assert strategy.applies(fault, context(restart_count=FULL.max_restarts - 1, alive_nodes=alive,
                                           lost_ranks=lost)) is None
    for used in (FULL.max_restarts, FULL.max_restarts + 1):
        assert strategy.applies(fault, context(restart_count=used, alive_nodes=alive, lost_ranks=lost)) == \
            "max_restarts (5) exhausted"
    no_restarts = FULL.model_copy(update={"max_restarts": 0})
    assert strategy.applies(fault, context(no_restarts, alive_nodes=alive, lost_ranks=lost)) == \
        "max_restarts (0) exhausted"


def test_survivors_counts_the_ranks_not_lost():
    assert context().survivors() == 4
    assert context(lost_ranks=frozenset({0, 3})).survivors() == 2


@pytest.mark.parametrize(
    ("fault", "text"),
    [
        (Fault("worker_exit", node=0, rank=1, exitcode=3), "rank 1 exited (exit code 3)"),
        (KILLED, "rank 1 exited (killed by SIGKILL)"),
        (Fault("worker_exit", node=1, exitcode=1), "node 1 exited (exit code 1)"),
        (Fault("agent_lost", node=2), "node 2 lost (agent gone)"),
        (Fault("heartbeat_missed", node=0, rank=4, step=9), "rank 4 missed its heartbeats (hang?)"),
        (Fault("start_timeout", node=0, rank=2), "rank 2: start_timeout"),
        (Fault("start_timeout", node=3), "node 3: start_timeout"),
        (STEP_FAILED, "rank 1 could not complete its step (allreduce timed out)"),
        (Fault("step_failed", node=0, rank=2), "rank 2 could not complete its step"),
    ],
)
def test_fault_descriptions(fault, text):
    assert fault.describe() == text


def test_a_fault_while_survivors_still_restore_at_start_restarts_the_job():
    """Survivors that have not finished loading the job's state hold no step to repair from."""
    restoring = RecoveryContext(FULL, 0, BOTH_NODES, frozenset({1}), survivors_restoring=frozenset({0, 2, 3}))
    decision = decide(KILLED, restoring)
    assert decision.strategy == JOB_RESTART
    assert decision.reason.startswith("retry: survivors [0, 2, 3] still restoring; recover-in-place: survivors")


def test_fault_scheduling_off_reschedules_nothing():
    """fault_scheduling: off: no node is replaced and the job is not restarted; what recovers in
    the running processes still does (retry, recover-in-place, the dying checkpoint)."""
    spec = FULL.model_copy(update={"fault_scheduling": "off", "recover_strategy": [RECOVER_IN_PLACE, RECOVER, "exit"]})
    one_lost = frozenset({2, 3})
    decision = decide(NODE_LOST, context(spec, alive_nodes=frozenset({0}), lost_ranks=one_lost))
    assert decision.strategy == EXIT
    assert decision.reason == ("recover-in-place: the node itself is lost; recover: fault_scheduling is off "
                               "(nothing is rescheduled); job-restart: fault_scheduling is off (nothing is "
                               "rescheduled)")
    assert decide(KILLED, context(spec, lost_ranks=frozenset({1}))).strategy == RECOVER_IN_PLACE
    assert decide(NODE_LOST, context(JobSpec(fault_scheduling="off"), 0)).strategy == EXIT
    for scheduling in ("force", "grace"):
        on = spec.model_copy(update={"fault_scheduling": scheduling})
        assert decide(NODE_LOST, context(on, alive_nodes=frozenset({0}), lost_ranks=one_lost)).strategy == RECOVER
