"""The recovery chain: job-level restart until max_restarts, then exit; unbuilt strategies skipped."""

from __future__ import annotations

import pytest

from undying import strategies
from undying.config import JobSpec
from undying.strategies import (
    EXIT,
    JOB_RESTART,
    Fault,
    RecoveryContext,
    decide,
    describe_chain,
    effective_chain,
    unbuilt_strategies,
)

KILLED = Fault("worker_exit", node=0, rank=1, step=25, exitcode=-9, signal="SIGKILL")


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


def test_describe_chain_names_the_listed_strategies_not_built():
    spec = JobSpec(process_recover=True, recover_strategy=["retry", "recover", "dump", "exit"])
    assert unbuilt_strategies(spec) == ["retry", "recover", "dump"]
    assert [strategy.name for strategy in effective_chain(spec)] == [JOB_RESTART, EXIT]
    assert describe_chain(spec) == (
        "recovery: job-restart -> exit (retry, recover, dump: not built in this version, skipped)")
    # Unbuilt strategies never decide anything.
    assert decide(KILLED, RecoveryContext(spec, 0)).strategy == JOB_RESTART


class RefusingRetry:
    name = "retry"

    def applies(self, fault: Fault, context: RecoveryContext) -> str | None:
        return None if fault.reason == "heartbeat_missed" else "only for hangs"


def test_a_built_strategy_is_tried_first_and_its_refusal_is_the_reason(monkeypatch):
    monkeypatch.setitem(strategies.BUILT, "retry", RefusingRetry())
    spec = JobSpec(process_recover=True, recover_strategy=["retry", "recover"])
    assert [strategy.name for strategy in effective_chain(spec)] == ["retry", JOB_RESTART, EXIT]
    assert describe_chain(spec) == (
        "recovery: retry -> job-restart -> exit (recover: not built in this version, skipped)")

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
    ],
)
def test_fault_descriptions(fault, text):
    assert fault.describe() == text
