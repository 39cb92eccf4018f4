"""Where a rendered job's pods run and how long Kubernetes gives them: node selection, tolerations,
one pod per node, priority, service account and image pull secrets, the container's resources,
and the two delays derived from the spec (the termination grace period, the not-ready eviction).

Runs in the ``undying k8s render`` process (pure functions from the spec and the render options
to fields of the pod spec).
"""

from __future__ import annotations

import math
from typing import Any

from undying.config import JobSpec
from undying.k8s.options import RenderOptions

INSTANCE_LABEL = "app.kubernetes.io/instance"  # every pod of the job carries it, valued the job's name
HOST_TOPOLOGY = "kubernetes.io/hostname"
# The taints a node gets when it stops reporting; a pod not tolerating them for longer is evicted.
NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
# Beyond the graceful stop and the workers' grace: the agents' own exits, a leaving node's notice to
# the controller (agent/node_agent.py's LEAVE_TIMEOUT), the controller's last events.
TERMINATION_MARGIN_S = 30


def termination_grace_seconds(spec: JobSpec) -> int:
    """Seconds between a pod's SIGTERM and the kubelet's SIGKILL. On its SIGTERM node 0 stops the
    job after every rank persisted the newest committed step (``stop_timeout`` at most), then its
    agents stop their workers: at once, or under ``fault_scheduling: grace`` with ``grace_period``
    after each worker's own SIGTERM (a dump or a save in the script's handler)."""
    worker_grace = spec.grace_period if spec.fault_scheduling == "grace" else 0.0
    return math.ceil(spec.stop_timeout + worker_grace) + TERMINATION_MARGIN_S


def not_ready_toleration_seconds(spec: JobSpec) -> int:
    """How long a pod stays bound to a node that stopped reporting before Kubernetes evicts it
    (its default, 300 s, outlasts the longest ``wait_reschedule_timeout``): half of
    ``wait_reschedule_timeout``, which leaves the replacement pod the other half to be scheduled
    and start before elastic training stops waiting for it."""
    return spec.wait_reschedule_timeout // 2


def pod_spec_placement(spec: JobSpec, options: RenderOptions) -> dict[str, Any]:
    """The pod spec's scheduling fields."""
    placement = options.placement
    fields: dict[str, Any] = {}
    if placement.node_selector:
        fields["nodeSelector"] = dict(placement.node_selector)
    evict_after = not_ready_toleration_seconds(spec)
    fields["tolerations"] = [toleration.to_dict() for toleration in placement.tolerations] + [
        {"key": taint, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": evict_after}
        for taint in NOT_READY_TAINTS]
    if placement.one_pod_per_node:
        # Two pods of one job on a host would share its GPUs' bandwidth and one failure domain.
        fields["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {INSTANCE_LABEL: options.name}}, "topologyKey": HOST_TOPOLOGY}]}}
    if placement.priority_class:
        fields["priorityClassName"] = placement.priority_class
    if options.service_account:
        fields["serviceAccountName"] = options.service_account
    if options.image_pull_secrets:
        fields["imagePullSecrets"] = [{"name": secret} for secret in options.image_pull_secrets]
    fields["terminationGracePeriodSeconds"] = termination_grace_seconds(spec)
    return fields


def container_resources(spec: JobSpec, options: RenderOptions, shm_size: str) -> dict[str, Any]:
    """Requests and limits: the memory request covers the memory-backed /dev/shm (``shm_size``)
    unless a larger one is given; one device of ``gpu_resource`` per local rank."""
    wanted = options.resources
    requests: dict[str, Any] = {"memory": wanted.memory_request or shm_size}
    limits: dict[str, Any] = {}
    if wanted.cpu_request:
        requests["cpu"] = wanted.cpu_request
    if wanted.cpu_limit:
        limits["cpu"] = wanted.cpu_limit
    if wanted.memory_limit:
        limits["memory"] = wanted.memory_limit
    if options.gpu_resource:
        limits[options.gpu_resource] = spec.nproc_per_node
    return {"requests": requests, "limits": limits} if limits else {"requests": requests}
