"""ActiveRecovery: who the plan waits for, when it is ready, and the plan it makes.

The plan resumes from the newest step a survivor holds, takes the lowest rank at that step
as the source, and sends the state to the newcomers and to every survivor behind it. On the
wire, its rank lists travel as runs: every survivor asks for the plan, and a 16k-rank member
list, rank by rank, made each reply ~100 KB.
"""

from __future__ import annotations

import json

import pytest

from undying.controller.recovery import ActiveRecovery
from undying.controller.server import PlanReplies
from undying.faults import Fault
from undying.protocol import Order, OrderKind, Plan, PlanAction
from undying.strategy_names import StrategyName

DUMP, RECOVER = StrategyName.DUMP, StrategyName.RECOVER
RECOVER_IN_PLACE, RETRY = StrategyName.RECOVER_IN_PLACE, StrategyName.RETRY

KILLED = Fault("worker_exit", node=1, rank=3, step=7, exitcode=-9, signal="SIGKILL")


def recovery(strategy: str = RECOVER_IN_PLACE, survivors: set[int] | None = None,
             newcomers: set[int] | None = None, fault: Fault = KILLED) -> ActiveRecovery:
    return ActiveRecovery(strategy, fault, old_generation=1, generation=2, members=[0, 1, 2, 3],
                          survivors={0, 1, 2} if survivors is None else survivors,
                          newcomers={3} if newcomers is None else newcomers)


def test_readiness_scans_the_ranks_only_once_the_counts_allow_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every check-in asks whether the recovery is ready: 16k ranks checking in one by one must not
    each scan every rank (the controller spent 20 s of CPU handing out one plan). Until as many
    survivors and newcomers are in as it waits for, the answer comes from the counts alone."""
    ranks = 1000
    active = recovery(survivors=set(range(ranks - 1)), newcomers={ranks - 1})
    active.members = list(range(ranks))
    scans = []
    missing = ActiveRecovery.missing
    monkeypatch.setattr(ActiveRecovery, "missing", lambda self: scans.append(1) or missing(self))
    answers = []
    for rank in range(ranks - 1):
        active.checked_in[rank] = 7
        answers.append(active.ready())
    active.newcomers_ready.add(ranks - 1)
    answers.append(active.ready())
    assert answers == [False] * (ranks - 1) + [True]
    assert len(scans) <= 2, len(scans)


def test_waits_for_every_survivor_and_every_newcomer():
    active = recovery()
    assert active.missing() == [0, 1, 2, 3]
    assert not active.ready()
    active.checked_in[1] = 7
    active.newcomers_ready.add(3)
    assert active.missing() == [0, 2]
    assert not active.ready()
    active.checked_in[0] = 7
    active.checked_in[2] = 7
    assert active.missing() == []
    assert active.ready()


def test_not_ready_while_a_lost_node_is_awaited():
    active = recovery(RECOVER, survivors={0, 1}, newcomers={2, 3}, fault=Fault("agent_lost", node=1, step=7))
    active.awaited_nodes = {1}
    active.checked_in.update({0: 7, 1: 7})
    assert active.missing() == [2, 3]
    active.newcomers_ready.update({2, 3})
    assert active.missing() == []
    assert not active.ready()
    active.awaited_nodes.clear()
    assert active.ready()


def test_not_ready_without_a_single_survivor_checked_in():
    # Newcomers alone hold no state: there is nothing to resume from.
    active = recovery(survivors=set(), newcomers={0, 1, 2, 3})
    active.newcomers_ready.update({0, 1, 2, 3})
    assert active.missing() == []
    assert not active.ready()


def test_the_plan_resumes_from_the_survivors_step_with_the_newcomer_as_receiver():
    active = recovery()
    active.checked_in.update({0: 7, 1: 7, 2: 7})
    active.newcomers_ready.add(3)
    plan = active.make_plan()
    assert plan == Plan(action=PlanAction.RESUME, strategy=RECOVER_IN_PLACE, generation=2, world_size=4, target_step=7,
                        source_rank=0, receivers=[3], reason="rank 3 exited (killed by SIGKILL)", members=[0, 1, 2, 3],
                        holders=[0, 1, 2])
    assert active.plan is plan


def test_the_target_is_the_newest_survivor_step_and_the_source_the_lowest_rank_holding_it():
    active = recovery()
    active.checked_in.update({0: 6, 1: 7, 2: 7})
    plan = active.make_plan()
    assert (plan.target_step, plan.source_rank) == (7, 1)
    # The survivor a step behind receives too, next to the newcomer.
    assert plan.receivers == [0, 3]


def test_every_survivor_behind_the_target_receives_sorted():
    active = recovery(survivors={0, 1, 2, 3, 4, 5}, newcomers={6})
    active.checked_in.update({5: 11, 0: 10, 3: 12, 1: 12, 4: 11, 2: 12})
    plan = active.make_plan()
    assert (plan.target_step, plan.source_rank) == (12, 1)
    assert plan.receivers == [0, 4, 5, 6]


def test_a_retry_with_every_survivor_at_the_same_step_has_no_receivers():
    failed = Fault("step_failed", node=0, rank=2, step=7, detail="allreduce timed out")
    active = recovery(RETRY, survivors={0, 1, 2, 3}, newcomers=set(), fault=failed)
    active.checked_in.update({0: 7, 1: 7, 2: 7, 3: 7})
    assert active.ready()
    plan = active.make_plan()
    assert (plan.action, plan.strategy, plan.target_step, plan.source_rank, plan.receivers) == (
        PlanAction.RESUME, RETRY, 7, 0, [])
    assert plan.reason == "rank 2 could not complete its step (allreduce timed out)"


def test_the_dump_strategy_plans_a_dump():
    active = recovery(DUMP, survivors={0, 1, 2}, newcomers=set())
    assert active.action == PlanAction.DUMP
    active.checked_in.update({0: 5, 1: 6, 2: 6})
    assert active.ready()
    plan = active.make_plan()
    assert (plan.action, plan.strategy, plan.generation) == (PlanAction.DUMP, DUMP, 2)
    # The source writes the newest committed state.
    assert (plan.target_step, plan.source_rank) == (6, 1)


def test_every_other_strategy_plans_a_resume():
    for strategy in (RETRY, RECOVER_IN_PLACE, RECOVER):
        assert recovery(strategy).action == PlanAction.RESUME


# A plan reply's bytes at 16k ranks once its rank lists travel as runs (rank by rank: ~104 KB).
SMALL_REPLY_BYTES = 1024


def wire(plan: Plan) -> Plan:
    """The plan as a worker reads it from the controller's reply."""
    return Plan.from_dict(json.loads(PlanReplies().encode(plan)))


def test_a_16k_rank_plan_reply_is_small_and_the_worker_reads_the_same_plan():
    members = list(range(16384))
    plan = Plan(action=PlanAction.RESUME, strategy=RECOVER, generation=3, world_size=len(members), target_step=41,
                source_rank=0, receivers=[8, 9, 10, 11, 12, 13, 14, 15], reason="node 1 lost", members=members,
                store="10.0.0.1:29500", rng_stores=["10.0.0.2:29500"])
    assert len(PlanReplies().encode(plan)) < SMALL_REPLY_BYTES
    assert wire(plan) == plan


@pytest.mark.parametrize("members", [
    [],  # every rank of world_size
    [0, 1, 2, 3, 8, 9, 10, 11],  # a shrunk job: node 1's ranks dropped
    [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7],  # process-group order is kept, not sorted
    [7, 3, 3, 0, 1, -1],
])
def test_rank_lists_round_trip_exactly(members: list[int]):
    plan = Plan(action=PlanAction.RESUME, members=members, receivers=sorted(set(members))[::2])
    assert wire(plan) == plan
    order = Order(kind=OrderKind.START, generation=2, ranks=[4, 5], members=members)
    assert Order.from_dict(json.loads(json.dumps(order.to_dict()))) == order


def test_a_plan_written_rank_by_rank_is_still_read():
    # A saved controller state from before the runs (a failover resumes from it).
    assert Plan.from_dict({"action": "resume", "members": [0, 2], "receivers": [2]}) == Plan(
        action=PlanAction.RESUME, members=[0, 2], receivers=[2])


def test_a_malformed_run_names_the_field():
    with pytest.raises(ValueError, match="Plan.members_runs"):
        Plan.from_dict({"action": "resume", "members_runs": [[4, 2]]})
