"""What each engine does about a pod that ended, decided from the rendered job object as the
engine's own code does (tests/k8s_engines.py), is what docs/kubernetes.md's exit-code table says:
a finished pod is done, a job that must not be retried fails, a stopped job restarts whole, a pod
that left or died is recreated (pod level) or restarts the job (job level). And the retry budgets
count what the docs say they count; the grace period and the not-ready toleration follow the spec."""

from __future__ import annotations

from typing import Any

import pytest

from tests.k8s_engines import Action, PodEnd, engine_for
from undying.agent.node_agent import EXIT_NODE_LEFT
from undying.config import validate_job_spec
from undying.k8s import Flavor, RenderOptions, render_job
from undying.k8s.exit_codes import PodExit, pod_exit
from undying.k8s.options import Retries
from undying.k8s.render import pod_templates

POD_LEVEL = {"process_recover": True, "recover_strategy": ["recover-in-place", "recover"],
             "pod_rescheduling": "on", "nnodes": 3, "nproc_per_node": 2, "checkpoint": {"dir": "s3://bucket/ckpt"}}
JOB_LEVEL = {"nnodes": 3, "nproc_per_node": 2, "checkpoint": {"dir": "s3://bucket/ckpt"}}
SIGKILLED = 128 + 9  # what the kubelet reports for a container killed by SIGKILL (and the OOM killer)

# docs/kubernetes.md's table: exit code -> (pod_rescheduling on, off).
TABLE = {
    0: (Action.DONE, Action.DONE),
    1: (Action.FAIL_JOB, Action.FAIL_JOB),
    2: (Action.FAIL_JOB, Action.FAIL_JOB),
    75: (Action.RESTART_JOB, Action.RESTART_JOB),
    130: (Action.RESTART_JOB, Action.RESTART_JOB),
    EXIT_NODE_LEFT: (Action.RECREATE_POD, Action.RESTART_JOB),
    SIGKILLED: (Action.RECREATE_POD, Action.RESTART_JOB),
    139: (Action.RECREATE_POD, Action.RESTART_JOB),
}
# Where PyTorchJob cannot follow it (docs/kubernetes.md says so): the training operator restarts no
# job, recreates a pod that exited with 128 or more (ExitCode) and fails the job below.
PYTORCHJOB = {**TABLE, 75: (Action.FAIL_JOB, Action.FAIL_JOB), 130: (Action.RECREATE_POD, Action.FAIL_JOB),
              EXIT_NODE_LEFT: (Action.RECREATE_POD, Action.FAIL_JOB), SIGKILLED: (Action.RECREATE_POD, Action.FAIL_JOB),
              139: (Action.RECREATE_POD, Action.FAIL_JOB)}


def engine_job(fields: dict, flavor: Flavor, standby: int = 0, **options: Any) -> dict[str, Any]:
    objects = render_job(validate_job_spec(fields), RenderOptions(name="llm", flavor=flavor, image="img",
                                                                 script=["t.py"], standby=standby, **options))
    [job] = [item for item in objects if item["apiVersion"] != "v1"]
    return job


def test_the_table_in_the_code_is_the_documented_one() -> None:
    for code, (pod_level, job_level) in TABLE.items():
        assert (pod_exit(code, True), pod_exit(code, False)) == (PodExit(pod_level), PodExit(job_level)), code


@pytest.mark.parametrize("flavor", list(Flavor))
@pytest.mark.parametrize("level", ["pod", "job"])
@pytest.mark.parametrize("disrupted", [False, True], ids=["failed", "drained"])
def test_each_engine_does_what_the_table_says_for_every_exit_code(flavor: Flavor, level: str, disrupted: bool) -> None:
    fields, standby = (POD_LEVEL, 1) if level == "pod" else (JOB_LEVEL, 0)
    table = PYTORCHJOB if flavor is Flavor.PYTORCHJOB else TABLE
    for code, expected in table.items():
        for index in (0, 1, standby and 3):
            engine = engine_for(engine_job(fields, flavor, standby))
            action = engine.pod_ended(PodEnd(index, code, disrupted=disrupted and code != 0))
            assert action == expected[0 if level == "pod" else 1], (code, index)


def test_a_node_that_left_with_exit_0_would_never_be_replaced() -> None:
    """Why a leaving node does not exit 0: every engine counts such a pod as done."""
    for flavor in Flavor:
        engine = engine_for(engine_job(POD_LEVEL, flavor, 1))
        assert engine.pod_ended(PodEnd(1, 0, disrupted=True)) == Action.DONE
        assert engine.pod_ended(PodEnd(1, EXIT_NODE_LEFT, disrupted=True)) == Action.RECREATE_POD


def failures_until_the_job_fails(engine: Any, end: PodEnd, most: int = 1000) -> list[Action]:
    actions = []
    while len(actions) < most:
        actions.append(engine.pod_ended(end))
        if actions[-1] == Action.FAIL_JOB:
            break
    return actions


def test_jobset_budgets_per_index_then_whole_restarts_and_drains_or_stops_cost_nothing() -> None:
    retries = Retries(pod=4, job=2)
    engine = engine_for(engine_job(POD_LEVEL, Flavor.JOBSET, 1, retries=retries))
    crash = PodEnd(1, SIGKILLED)
    # per index: 4 recreations, the 5th failure restarts the whole JobSet (counted), which resets the counts
    one_run = [Action.RECREATE_POD] * 4 + [Action.RESTART_JOB]
    assert failures_until_the_job_fails(engine, crash) == one_run * 2 + [Action.RECREATE_POD] * 4 + [Action.FAIL_JOB]
    engine = engine_for(engine_job(POD_LEVEL, Flavor.JOBSET, 1, retries=retries))
    for index in (1, 2, 3):  # each index has its own budget
        assert [engine.pod_ended(PodEnd(index, SIGKILLED)) for _ in range(4)] == [Action.RECREATE_POD] * 4
    engine = engine_for(engine_job(POD_LEVEL, Flavor.JOBSET, 1, retries=retries))
    assert {engine.pod_ended(PodEnd(1, EXIT_NODE_LEFT, disrupted=True)) for _ in range(100)} == {Action.RECREATE_POD}
    assert {engine.pod_ended(PodEnd(0, 75, disrupted=True)) for _ in range(100)} == {Action.RESTART_JOB}
    job_level = engine_for(engine_job(JOB_LEVEL, Flavor.JOBSET, retries=retries))
    assert {job_level.pod_ended(PodEnd(1, EXIT_NODE_LEFT, disrupted=True)) for _ in range(100)} == {Action.RESTART_JOB}
    assert failures_until_the_job_fails(job_level, crash) == [Action.RESTART_JOB] * 2 + [Action.FAIL_JOB]


def test_volcano_counts_every_restart_in_one_job_wide_budget() -> None:
    retries = Retries(pod=2, job=1)
    job = engine_job(POD_LEVEL, Flavor.VOLCANO, 1, retries=retries)
    assert job["spec"]["maxRetry"] == 2 * 4 + 1 + 1  # pod budget x (3 nodes + 1 spare) + job budget + 1
    engine = engine_for(job)
    actions = failures_until_the_job_fails(engine, PodEnd(1, SIGKILLED))
    assert actions == [Action.RECREATE_POD] * 9 + [Action.FAIL_JOB]
    job_level = engine_for(engine_job(JOB_LEVEL, Flavor.VOLCANO, retries=retries))
    assert failures_until_the_job_fails(job_level, PodEnd(1, EXIT_NODE_LEFT, True)) == [Action.RESTART_JOB,
                                                                                      Action.FAIL_JOB]


def test_pytorchjob_has_no_budget_the_operator_enforces_for_recreated_pods() -> None:
    job = engine_job(POD_LEVEL, Flavor.PYTORCHJOB, 1)
    assert "backoffLimit" not in job["spec"]["runPolicy"]  # it counts only in-place container restarts
    engine = engine_for(job)
    assert {engine.pod_ended(PodEnd(2, SIGKILLED)) for _ in range(100)} == {Action.RECREATE_POD}


@pytest.mark.parametrize(("fields", "seconds"), [
    ({}, 120 + 30),  # stop_timeout's default, and the margin for the agents' exits
    ({"stop_timeout": 300}, 300 + 30),
    ({"fault_scheduling": "grace", "grace_period": 600}, 120 + 600 + 30),
    ({"fault_scheduling": "grace", "grace_period": 360, "stop_timeout": 60.5}, 61 + 360 + 30),
])
def test_the_termination_grace_period_covers_the_stop_and_the_workers_grace(fields: dict, seconds: int) -> None:
    for flavor in Flavor:
        job = engine_job({**JOB_LEVEL, **fields}, flavor)
        assert {template["spec"]["terminationGracePeriodSeconds"] for template in pod_templates(job)} == {seconds}


@pytest.mark.parametrize("wait", [30, 90, 270])
def test_a_pod_on_a_silent_node_is_evicted_well_within_wait_reschedule_timeout(wait: int) -> None:
    for flavor in Flavor:
        template = pod_templates(engine_job({**POD_LEVEL, "wait_reschedule_timeout": wait}, flavor, 1))[0]
        evictions = {toleration["key"]: toleration["tolerationSeconds"] for toleration in template["spec"]["tolerations"]
                     if toleration.get("effect") == "NoExecute"}
        assert evictions == {"node.kubernetes.io/not-ready": wait // 2, "node.kubernetes.io/unreachable": wait // 2}


@pytest.mark.parametrize("flavor", list(Flavor))
def test_node_0s_exit_is_the_jobs_outcome_and_a_late_pod_changes_nothing(flavor: Flavor) -> None:
    """Every node exits 0 when the job ended, whatever its outcome; node 0's code is the outcome.
    Once node 0 succeeded the job is complete: a replacement pod still looking for the controller
    is stopped, and its end recreates nothing."""
    engine = engine_for(engine_job(POD_LEVEL, flavor, 1))
    assert engine.pod_ended(PodEnd(1, 0)) == Action.DONE and not engine.complete
    assert engine.pod_ended(PodEnd(0, 0)) == Action.DONE and engine.complete
    assert engine.pod_ended(PodEnd(2, EXIT_NODE_LEFT, disrupted=True)) == Action.DONE
    failed = engine_for(engine_job(POD_LEVEL, flavor, 1))
    assert [failed.pod_ended(PodEnd(node, 0)) for node in (1, 2, 3)] == [Action.DONE] * 3
    assert failed.pod_ended(PodEnd(0, 1)) == Action.FAIL_JOB and not failed.complete


def test_undyings_own_budgets_are_not_the_engines() -> None:
    """max_restarts and crash_loop_limit count undying's restarts inside live pods; the engines'
    budgets come from --pod-retries and --job-retries alone."""
    own = {"max_restarts": 7, "crash_loop_limit": 9}
    jobset = engine_job({**POD_LEVEL, **own}, Flavor.JOBSET, 1)
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 3
    assert jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimitPerIndex"] == 10
    assert engine_job({**JOB_LEVEL, **own}, Flavor.VOLCANO)["spec"]["maxRetry"] == 3 + 1
    assert engine_job({**POD_LEVEL, **own}, Flavor.VOLCANO, 1)["spec"]["maxRetry"] == 10 * 4 + 3 + 1
