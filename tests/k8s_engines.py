"""The cluster engines' part, for tests: what an engine does about a pod of a rendered job that
ended (count it done, recreate it, restart the whole job, fail the job), decided from the job
object alone, as each engine's code does at the versions the CRD schemas come from:

- JobSet v0.12.0 over Kubernetes' Job controller: the Job's ``podFailurePolicy`` (rules in order;
  ``pkg/controller/job/pod_failure_policy.go``, whose FailJob messages are reproduced here),
  ``backoffLimitPerIndex``/``maxFailedIndexes`` or ``backoffLimit``; then the JobSet's
  ``failurePolicy`` rules by the Job's failure reason and message (``pkg/controllers/failure_policy.go``:
  first matching rule, ``RestartJobSet`` when none matches, ``maxRestarts`` counting restarts
  that are not ``...AndIgnoreMaxRestarts``); the Job's ``successPolicy`` (or every index done)
  completes it;
- training-operator v1.9.0's PyTorchJob: per replica type, ``ExitCode`` recreates a pod that exited
  with 128 or more and fails the job below (``pkg/util/train/train_util.go``), ``Never`` fails it,
  ``OnFailure``/``Always`` restart the container; the Master's success completes the job;
- Volcano v1.15.1: task then job ``policies``, the first whose event or exit code matches
  (``applyPolicies``), ``RestartPod``/``RestartJob`` counted in ``retryCount``, which fails the job
  when it reaches ``maxRetry`` (default 3); a task whose every pod succeeded raises the event
  TaskCompleted (``CompleteJob`` completes the job), as does every pod done.

``complete``: the job has ended well; the engine then stops the pods still running, whose ends
change nothing.

Nothing of ``undying.k8s`` is imported: a rendered policy that does something else than
docs/kubernetes.md's table says fails the tests that compare the two.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Protocol


class Action(enum.StrEnum):
    """The engine's response to a pod that ended (the same words as docs/kubernetes.md's table)."""

    DONE = "done"
    FAIL_JOB = "fail the job"
    RESTART_JOB = "restart the job"
    RECREATE_POD = "recreate the pod"


@dataclass(frozen=True)
class PodEnd:
    """A pod that ended: its index (the node rank it was started as), its container's exit code (128 + N
    for a signal N, as the kubelet reports it) and whether Kubernetes took it away (a drain, a
    preemption: the pod's DisruptionTarget condition)."""

    index: int
    exit_code: int
    disrupted: bool = False


class Engine(Protocol):
    complete: bool

    def pod_ended(self, end: PodEnd) -> Action: ...


def engine_for(job: dict[str, Any]) -> Engine:
    return {"JobSet": JobSetEngine, "PyTorchJob": PyTorchJobEngine, "Job": VolcanoEngine}[job["kind"]](job)


NAMESPACE = "default"
DISRUPTION_TARGET = "DisruptionTarget"


class JobSetEngine:
    """One replicated job of one Indexed Job (what undying renders), its pods named by index."""

    def __init__(self, jobset: dict[str, Any]) -> None:
        self.jobset = jobset
        [self.replicated] = jobset["spec"]["replicatedJobs"]
        self.job = self.replicated["template"]["spec"]
        assert self.job["completionMode"] == "Indexed"
        pod_spec = self.job["template"]["spec"]
        assert pod_spec["restartPolicy"] == "Never" or "podFailurePolicy" not in self.job
        [container] = pod_spec["containers"]
        self.container = container["name"]
        self.restarts_counted = 0
        self.complete = False
        self._new_run()

    def _new_run(self) -> None:
        """A restart recreates the Job: its failure counts start again."""
        self.index_failures: dict[int, int] = {}
        self.failures = 0
        self.failed_indexes = 0
        self.succeeded: set[int] = set()

    def pod_ended(self, end: PodEnd) -> Action:
        if self.complete:
            return Action.DONE
        if end.exit_code == 0:
            self.succeeded.add(end.index)
            self.complete = self.succeeded >= set(range(self.job["completions"])) or any(
                set(_indexes(rule["succeededIndexes"])) <= self.succeeded
                for rule in self.job.get("successPolicy", {}).get("rules", []))
            return Action.DONE
        action, message = self._pod_failure_policy(end)
        if action == "Ignore":
            return Action.RECREATE_POD
        if action == "FailJob":
            return self._job_failed("PodFailurePolicy", message)
        assert action in ("Count", None), f"{action} is not modelled"
        limit_per_index = self.job.get("backoffLimitPerIndex")
        if limit_per_index is not None:
            self.index_failures[end.index] = self.index_failures.get(end.index, 0) + 1
            if self.index_failures[end.index] <= limit_per_index:
                return Action.RECREATE_POD
            self.failed_indexes += 1
            most = self.job.get("maxFailedIndexes")
            if most is not None and self.failed_indexes > most:
                return self._job_failed("MaxFailedIndexesExceeded",
                                        "Job has exceeded the specified maximal number of failed indexes")
            raise AssertionError("an index failed for good while the Job runs on: not modelled")
        self.failures += 1
        if self.failures <= self.job.get("backoffLimit", 6):
            return Action.RECREATE_POD
        return self._job_failed("BackoffLimitExceeded", "Job has reached the specified backoff limit")

    def _pod_failure_policy(self, end: PodEnd) -> tuple[str | None, str]:
        pod = f"{NAMESPACE}/{self.jobset['metadata']['name']}-{self.replicated['name']}-0-{end.index}-x"
        for index, rule in enumerate(self.job.get("podFailurePolicy", {}).get("rules", [])):
            if "onExitCodes" in rule:
                requirement = rule["onExitCodes"]
                named = requirement.get("containerName") in (None, self.container)
                inside = end.exit_code in requirement["values"]
                if named and inside == (requirement["operator"] == "In"):
                    return rule["action"], (f"Container {self.container} for pod {pod} failed with exit code "
                                            f"{end.exit_code} matching {rule['action']} rule at index {index}")
            elif "onPodConditions" in rule:
                wanted = {(pattern["type"], pattern.get("status", "True")) for pattern in rule["onPodConditions"]}
                if end.disrupted and (DISRUPTION_TARGET, "True") in wanted:
                    return rule["action"], (f"Pod {pod} has condition {DISRUPTION_TARGET} matching "
                                            f"{rule['action']} rule at index {index}")
        return None, ""

    def _job_failed(self, reason: str, message: str) -> Action:
        policy = self.jobset["spec"].get("failurePolicy")
        if policy is None:
            return Action.FAIL_JOB
        action = "RestartJobSet"
        for rule in policy.get("rules", []):
            reasons, patterns = rule.get("onJobFailureReasons", []), rule.get("onJobFailureMessagePatterns", [])
            targets = rule.get("targetReplicatedJobs", [])
            if ((not reasons or reason in reasons) and (not patterns or any(re.search(p, message) for p in patterns))
                    and (not targets or self.replicated["name"] in targets)):
                action = rule["action"]
                break
        if action == "FailJobSet":
            return Action.FAIL_JOB
        if action == "RestartJobSet":
            if self.restarts_counted >= policy.get("maxRestarts", 0):
                return Action.FAIL_JOB
            self.restarts_counted += 1
        else:
            assert action == "RestartJobSetAndIgnoreMaxRestarts", f"{action} is not modelled"
        self._new_run()
        return Action.RESTART_JOB


def _indexes(text: str) -> list[int]:
    """A Job's index list ("0", "1,3-5")."""
    indexes: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        indexes += range(int(first), int(last or first) + 1)
    return indexes


class PyTorchJobEngine:
    """Master is pod 0, Worker i pod i + 1."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.replicas = job["spec"]["pytorchReplicaSpecs"]
        assert self.replicas["Master"]["replicas"] == 1
        self.complete = False

    def pod_ended(self, end: PodEnd) -> Action:
        if self.complete:
            return Action.DONE
        if end.exit_code == 0:
            self.complete = end.index == 0
            return Action.DONE
        policy = self.replicas["Master" if end.index == 0 else "Worker"].get("restartPolicy", "Never")
        if policy == "ExitCode":
            return Action.RECREATE_POD if end.exit_code >= 128 else Action.FAIL_JOB
        if policy in ("OnFailure", "Always"):
            return Action.RECREATE_POD  # the kubelet restarts the container in the same pod
        return Action.FAIL_JOB


class VolcanoEngine:
    """The tasks' pods in order (pod i is the task's index i less the pods of the tasks before it);
    a failed pod is the event PodFailed with its container's exit code, a succeeded one completes its
    task once every pod of the task succeeded (TaskCompleted)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.spec = job["spec"]
        self.task_of_pod = [task for task in self.spec["tasks"] for _ in range(task["replicas"])]
        self.retry_count = 0
        self.complete = False
        self.succeeded: set[int] = set()

    def pod_ended(self, end: PodEnd) -> Action:
        if self.complete:
            return Action.DONE
        task = self.task_of_pod[end.index]
        if end.exit_code == 0:
            self.succeeded.add(end.index)
            task_pods = {pod for pod, its in enumerate(self.task_of_pod) if its is task}
            completed = task_pods <= self.succeeded and self._policy_action(task, "TaskCompleted", None)
            self.complete = completed == "CompleteJob" or len(self.succeeded) == len(self.task_of_pod)
            return Action.DONE
        action = self._policy_action(task, "PodFailed", end.exit_code)
        if action in ("RestartPod", "RestartJob", "RestartTask"):
            self.retry_count += 1
            if self.retry_count >= self.spec.get("maxRetry", 3):
                return Action.FAIL_JOB
            if action == "RestartPod":
                return Action.RECREATE_POD
            self.succeeded.clear()
            return Action.RESTART_JOB if action == "RestartJob" or len(self.spec["tasks"]) == 1 else Action.FAIL_JOB
        if action in ("TerminateJob", "AbortJob"):
            return Action.FAIL_JOB
        raise AssertionError(f"{action} is not modelled (None: the pod stays failed)")

    def _policy_action(self, task: dict[str, Any], event: str, exit_code: int | None) -> str | None:
        for policy in [*task.get("policies", []), *self.spec.get("policies", [])]:
            events = [*policy.get("events", []), *([policy["event"]] if "event" in policy else [])]
            if event in events or "*" in events:
                return str(policy["action"])
            if exit_code is not None and policy.get("exitCode") == exit_code:
                return str(policy["action"])
        return None
