"""The job object of each cluster engine (JobSet, Kubeflow PyTorchJob, Volcano Job) around the
shared pod template: failure policies that follow the exit-code table (exit_codes.py), the
engine's retry budgets, the gang, the queue and the storage claims.

Runs in the ``undying k8s render`` process. With ``pod_rescheduling: on`` the engine recreates
only a pod that left or died (its agent rejoins as that node, or as a spare when one has taken its
place); otherwise such a pod restarts the whole job (job level). A stopped job (node 0's 75 or
130) is restarted whole, and a job that must not be retried (1, 2) fails, in both modes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from undying.config import JobSpec
from undying.k8s.exit_codes import NOT_RETRIED, STOPPED
from undying.k8s.labels import spec_annotations, spec_labels
from undying.k8s.options import Flavor, RenderOptions
from undying.k8s.placement import INSTANCE_LABEL
from undying.k8s.pod import CONTAINER_NAME, pod_template
from undying.k8s.storage import pod_count, volume_claim_policies
from undying.strategy_names import StrategyName

NODE_GROUP = "node"  # the JobSet replicated job holding every node and spare; Volcano's task of nodes 1 and up
HEAD_TASK = "head"  # Volcano's task of node 0 alone: its success completes the job
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
EXCLUSIVE_TOPOLOGY_ANNOTATION = "alpha.jobset.sigs.k8s.io/exclusive-topology"
# The pod condition Kubernetes sets on a pod it takes away: a drain (the Eviction API), a
# preemption, a taint's eviction, the kubelet under node pressure.
DISRUPTION_TARGET = "DisruptionTarget"


def pod_level(spec: JobSpec) -> bool:
    return spec.pod_rescheduling == "on"


def gang_size(spec: JobSpec) -> int:
    """Pods the scheduler places together: every node (the job starts once every node said
    hello); with elastic training and ``min_nodes``, ``min_nodes``, the fewest the job trains on,
    so that the scheduler may take the others away (preemption) as the job can shrink."""
    if StrategyName.ELASTIC in spec.recover_strategy and spec.min_nodes is not None:
        return spec.min_nodes
    return spec.nnodes


def engine_job(spec: JobSpec, options: RenderOptions) -> dict[str, Any]:
    """The engine's job object for ``spec`` (nnodes nodes and ``options.standby`` spares)."""
    build = {Flavor.JOBSET: _jobset, Flavor.PYTORCHJOB: _pytorchjob, Flavor.VOLCANO: _volcano}[options.flavor]
    return build(spec, options)


def node0_selector(options: RenderOptions) -> dict[str, str]:
    """Labels the engine puts on node 0's pod alone (for the controller's headless Service)."""
    if options.flavor is Flavor.JOBSET:
        return {"jobset.sigs.k8s.io/jobset-name": options.name,
                "jobset.sigs.k8s.io/replicatedjob-name": NODE_GROUP,
                "batch.kubernetes.io/job-completion-index": "0"}
    if options.flavor is Flavor.PYTORCHJOB:
        return {"training.kubeflow.org/job-name": options.name,
                "training.kubeflow.org/replica-type": "master",
                "training.kubeflow.org/replica-index": "0"}
    return {"volcano.sh/job-name": options.name, "volcano.sh/task-spec": HEAD_TASK,
            "volcano.sh/task-index": "0"}


def _metadata(spec: JobSpec, options: RenderOptions, kueue: bool) -> dict[str, Any]:
    labels = {**options.job_labels, **spec_labels(spec), INSTANCE_LABEL: options.name}
    if kueue and options.placement.queue:
        labels[KUEUE_QUEUE_LABEL] = options.placement.queue  # Kueue admits the whole job at once
    return {"name": options.name, "labels": labels,
            "annotations": {**options.job_annotations, **spec_annotations(spec)}}


# ---------------------------------------------------------------- JobSet

def _on_exit_codes(options: RenderOptions, codes: Iterable[int]) -> dict[str, Any]:
    return {"containerName": CONTAINER_NAME[options.flavor], "operator": "In", "values": sorted(codes)}


def _failure_message_pattern(codes: Iterable[int]) -> str:
    """Matches the Job controller's message for a pod that matched a FailJob exit-code rule
    ("Container C for pod NS/P failed with exit code N matching FailJob rule at index I")."""
    return f"failed with exit code ({'|'.join(str(code) for code in sorted(codes))}) matching FailJob rule"


# The Job controller's message for a pod that matched a FailJob pod-condition rule
# ("Pod NS/P has condition DisruptionTarget matching FailJob rule at index I").
DISRUPTED_MESSAGE_PATTERN = f"has condition {DISRUPTION_TARGET} matching FailJob rule"


def jobset_pod_failure_policy(spec: JobSpec, options: RenderOptions) -> dict[str, Any]:
    """The Job's rules, in order: fail it for a code not to retry, and for a stop (JobSet's rules
    then fail or restart the set); a pod the cluster took away is recreated without counting
    (pod level) or fails the Job (job level: the set restarts without counting). Any other failure
    counts against the Job's budget."""
    disrupted = {"action": "Ignore" if pod_level(spec) else "FailJob",
                 "onPodConditions": [{"type": DISRUPTION_TARGET, "status": "True"}]}
    return {"rules": [{"action": "FailJob", "onExitCodes": _on_exit_codes(options, NOT_RETRIED)},
                      {"action": "FailJob", "onExitCodes": _on_exit_codes(options, STOPPED)},
                      disrupted]}


def jobset_failure_policy(options: RenderOptions) -> dict[str, Any]:
    """What the JobSet does about its failed Job, by the Job's failure reason and message."""
    return {"maxRestarts": options.retries.job, "rules": [
        {"name": "NotRetried", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": [_failure_message_pattern(NOT_RETRIED)]},
        {"name": "StoppedOrDisrupted", "action": "RestartJobSetAndIgnoreMaxRestarts",
         "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": [_failure_message_pattern(STOPPED), DISRUPTED_MESSAGE_PATTERN]},
        # a pod's budget used up (MaxFailedIndexesExceeded), or any failure at job level
        {"name": "Failed", "action": "RestartJobSet"},
    ]}


def _jobset(spec: JobSpec, options: RenderOptions) -> dict[str, Any]:
    pods = pod_count(spec, options)
    job_spec: dict[str, Any] = {"completionMode": "Indexed", "completions": pods, "parallelism": pods,
                                # a replacement starts only once the failed pod is gone: never two
                                # agents claiming one node (and the only policy podFailurePolicy allows)
                                "podReplacementPolicy": "Failed",
                                "podFailurePolicy": jobset_pod_failure_policy(spec, options),
                                # Node 0's `undying run` exits 0 only when the job succeeded (the
                                # others exit 0 whenever it ended): its success completes the Job,
                                # and a replacement pod still looking for the controller is stopped.
                                "successPolicy": {"rules": [{"succeededIndexes": "0"}]},
                                "template": pod_template(spec, options, restart_policy="Never")}
    if pod_level(spec):
        job_spec["backoffLimitPerIndex"] = options.retries.pod  # only the failed index is recreated ...
        job_spec["maxFailedIndexes"] = 0  # ... and one that used its budget fails the Job at once
    else:
        job_spec["backoffLimit"] = 0  # one failed pod fails the Job: the JobSet recreates every pod
    replicated: dict[str, Any] = {"spec": job_spec}
    if options.placement.exclusive_topology:
        replicated["metadata"] = {"annotations": {EXCLUSIVE_TOPOLOGY_ANNOTATION: options.placement.exclusive_topology}}
    jobset_spec: dict[str, Any] = {"failurePolicy": jobset_failure_policy(options),
                                   "replicatedJobs": [{"name": NODE_GROUP, "replicas": 1, "template": replicated}]}
    claims = volume_claim_policies(options)
    if claims:
        jobset_spec["volumeClaimPolicies"] = claims
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": _metadata(spec, options, kueue=True), "spec": jobset_spec}


# ---------------------------------------------------------------- PyTorchJob

PYTORCHJOB_PORT_NAME = "pytorchjob-port"  # training-operator v1's name for the torchrun master port
PYTORCHJOB_DEFAULT_PORT = 23456  # the operator's default for it (unused by undying's own agents)


def _pytorchjob(spec: JobSpec, options: RenderOptions) -> dict[str, Any]:
    # ExitCode: the operator recreates a pod that exited with 128 or more (a leave, a kill) and
    # fails the job on 1..127 (1, 2, and a stop's 75: it cannot restart every pod). Job level:
    # any failed pod fails the job.
    restart_policy = "ExitCode" if pod_level(spec) else "Never"
    template = pod_template(spec, options, restart_policy="Never")
    # The operator takes MASTER_PORT from a container port of this name, which only its defaulting
    # adds when absent: rendered here, the job does not depend on that defaulting.
    template["spec"]["containers"][0]["ports"].append(
        {"name": PYTORCHJOB_PORT_NAME, "containerPort": PYTORCHJOB_DEFAULT_PORT, "protocol": "TCP"})
    replicas: dict[str, Any] = {"Master": {"replicas": 1, "restartPolicy": restart_policy, "template": template}}
    workers = pod_count(spec, options) - 1
    if workers:
        replicas["Worker"] = {"replicas": workers, "restartPolicy": restart_policy, "template": template}
    scheduling: dict[str, Any] = {"minAvailable": gang_size(spec)}
    if options.placement.priority_class:
        scheduling["priorityClass"] = options.placement.priority_class
    # No backoffLimit: the operator counts only in-place container restarts, which ExitCode and
    # Never pods never have. The job ends with the Master (node 0); cleanPodPolicy Running then
    # stops a replacement pod still looking for the controller and keeps finished pods' logs.
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(spec, options, kueue=True),
            "spec": {"runPolicy": {"cleanPodPolicy": "Running", "schedulingPolicy": scheduling},
                     "pytorchReplicaSpecs": replicas}}


# ---------------------------------------------------------------- Volcano

def volcano_policies(spec: JobSpec) -> list[dict[str, Any]]:
    """Volcano applies the first policy whose exit code or event matches: the codes come first."""
    left_or_died = "RestartPod" if pod_level(spec) else "RestartJob"
    return [*({"exitCode": code, "action": "TerminateJob"} for code in NOT_RETRIED),
            *({"exitCode": code, "action": "RestartJob"} for code in STOPPED),
            {"events": ["PodFailed", "PodEvicted"], "action": left_or_died}]


def volcano_max_retry(spec: JobSpec, options: RenderOptions) -> int:
    """Volcano counts every RestartPod and RestartJob, stops and evictions included, in one count and
    fails the job when it reaches maxRetry: the pod budget times the pods, plus the job budget, plus one."""
    pods = options.retries.pod * pod_count(spec, options) if pod_level(spec) else 0
    return pods + options.retries.job + 1


def _volcano(spec: JobSpec, options: RenderOptions) -> dict[str, Any]:
    # Node 0 in a task of its own: its `undying run` exits 0 only when the job succeeded (the others
    # exit 0 whenever it ended), so its task's completion completes the job, which stops a
    # replacement pod still looking for the controller. The other task's indices start at node 1.
    tasks = [{"name": HEAD_TASK, "replicas": 1, "template": pod_template(spec, options, restart_policy="Never"),
              "policies": [{"event": "TaskCompleted", "action": "CompleteJob"}]}]
    if pod_count(spec, options) > 1:
        tasks.append({"name": NODE_GROUP, "replicas": pod_count(spec, options) - 1,
                      "template": pod_template(spec, options, restart_policy="Never", first_node=1)})
    volcano_spec: dict[str, Any] = {
        "schedulerName": "volcano",
        "minAvailable": gang_size(spec),  # gang-schedule the nodes; spares come when they fit
        "maxRetry": volcano_max_retry(spec, options),
        "plugins": {"env": []},  # sets VC_TASK_INDEX
        "policies": volcano_policies(spec),
        "tasks": tasks,
    }
    if options.placement.queue:
        volcano_spec["queue"] = options.placement.queue
    if options.placement.priority_class:
        volcano_spec["priorityClassName"] = options.placement.priority_class
    return {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "metadata": _metadata(spec, options, kueue=False),
            "spec": volcano_spec}
