"""The job object of each cluster engine (JobSet, Kubeflow PyTorchJob, Volcano Job) around the
shared pod template, with restart and backoff policies that match the spec's strategies.

Runs in the ``undying k8s render`` process. With ``pod_rescheduling: on`` the engine recreates
only the failed pod (its agent rejoins as that node, or a spare has already taken its place);
otherwise a failed pod fails the job and the engine restarts every pod (job level).
"""

from __future__ import annotations

from typing import Any

from undying.config import JobSpec
from undying.k8s.labels import spec_annotations, spec_labels
from undying.k8s.pod import Flavor, RenderOptions, pod_template

NODE_GROUP = "node"  # the JobSet replicated job / Volcano task holding every node and spare


def pod_level(spec: JobSpec) -> bool:
    return spec.pod_rescheduling == "on"


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
    return {"volcano.sh/job-name": options.name, "volcano.sh/task-spec": NODE_GROUP,
            "volcano.sh/task-index": "0"}


def _metadata(spec: JobSpec, options: RenderOptions) -> dict[str, Any]:
    return {"name": options.name,
            "labels": {**spec_labels(spec), "app.kubernetes.io/instance": options.name},
            "annotations": spec_annotations(spec)}


def _jobset(spec: JobSpec, options: RenderOptions) -> dict[str, Any]:
    pods = spec.nnodes + options.standby
    job_spec: dict[str, Any] = {"completionMode": "Indexed", "completions": pods, "parallelism": pods,
                                # a replacement starts only once the failed pod is gone: never two
                                # agents claiming one node
                                "podReplacementPolicy": "Failed",
                                "template": pod_template(spec, options, restart_policy="Never")}
    if pod_level(spec):
        job_spec["backoffLimitPerIndex"] = spec.max_restarts  # only the failed index is recreated
        restarts = 0
    else:
        job_spec["backoffLimit"] = 0  # one failed pod fails the Job ...
        restarts = spec.max_restarts  # ... and the JobSet recreates every pod
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _metadata(spec, options),
        "spec": {"failurePolicy": {"maxRestarts": restarts},
                 "replicatedJobs": [{"name": NODE_GROUP, "replicas": 1, "template": {"spec": job_spec}}]},
    }


PYTORCHJOB_PORT_NAME = "pytorchjob-port"  # training-operator v1's name for the torchrun master port
PYTORCHJOB_DEFAULT_PORT = 23456  # the operator's default for it (unused by undying's own agents)


def _pytorchjob(spec: JobSpec, options: RenderOptions) -> dict[str, Any]:
    # PyTorchJob has no job-level restart of every pod: with pod_rescheduling off a failed pod fails
    # the job (undying's own job restarts still cover faults inside live pods).
    restart_policy = "OnFailure" if pod_level(spec) else "Never"
    backoff = spec.max_restarts if pod_level(spec) else 0
    template = pod_template(spec, options, restart_policy=restart_policy)
    # The operator takes MASTER_PORT from a container port of this name, which only its defaulting
    # adds when absent: rendered here, the job does not depend on that defaulting.
    template["spec"]["containers"][0]["ports"].append(
        {"name": PYTORCHJOB_PORT_NAME, "containerPort": PYTORCHJOB_DEFAULT_PORT, "protocol": "TCP"})
    replicas: dict[str, Any] = {"Master": {"replicas": 1, "restartPolicy": restart_policy, "template": template}}
    workers = spec.nnodes - 1 + options.standby
    if workers:
        replicas["Worker"] = {"replicas": workers, "restartPolicy": restart_policy, "template": template}
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(spec, options),
        "spec": {"runPolicy": {"backoffLimit": backoff, "cleanPodPolicy": "All"},
                 "pytorchReplicaSpecs": replicas},
    }


def _volcano(spec: JobSpec, options: RenderOptions) -> dict[str, Any]:
    action = "RestartPod" if pod_level(spec) else "RestartJob"
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "metadata": _metadata(spec, options),
        "spec": {
            "schedulerName": "volcano",
            "minAvailable": spec.nnodes,  # gang-schedule the nodes; spares come when they fit
            "maxRetry": spec.max_restarts,
            "plugins": {"env": []},  # sets VC_TASK_INDEX
            "policies": [{"event": "PodFailed", "action": action}, {"event": "PodEvicted", "action": action}],
            "tasks": [{"name": NODE_GROUP, "replicas": spec.nnodes + options.standby,
                       "template": pod_template(spec, options, restart_policy="Never")}],
        },
    }
