"""The pod every node of a rendered job runs: one container starting ``undying run`` with the node
rank from the engine's index variable, its volumes (storage.py, certificates.py) and scheduling fields
(placement.py), and the Service, Secret and ConfigMap it reads.

Runs in the ``undying k8s render`` process (pure functions from the spec and the render options
to Kubernetes objects as plain dicts); nothing here talks to a cluster.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import yaml

from undying.config import JobSpec, spec_to_dict
from undying.k8s.certificates import certificate_arguments, certificate_volumes
from undying.k8s.labels import spec_annotations, spec_labels
from undying.k8s.options import Flavor, RenderOptions
from undying.k8s.placement import INSTANCE_LABEL, container_resources, pod_spec_placement
from undying.k8s.storage import POD_NAME_VARIABLE, RUN_DIR, credentials_env_from, storage_volumes

# Where the pod finds what `undying run` needs (the README's multi-node flags).
SPEC_DIR = "/etc/undying/spec"
SPEC_FILE = "job.yaml"
TOKEN_DIR = "/etc/undying/token"
TOKEN_KEY = "token"
POD_INFO_DIR = "/etc/undying/pod"  # Downward API: the pod's own labels and annotations
CONTROLLER_PORT = 29400
CONTROLLER_PORT_NAME = "undying-ctl"  # a named port: at most 15 characters
POD_IP_VARIABLE = "POD_IP"  # the pod's own address (Downward API), where an etcd candidate binds
# /dev/shm beyond the T1 snapshot slots: NCCL's buffers, DataLoader workers' batches.
SHM_HEADROOM_GIB = 1.0


# The variable each engine sets in a pod to that pod's index (0 for the first node).
NODE_INDEX_VARIABLE = {
    Flavor.JOBSET: "JOB_COMPLETION_INDEX",  # an Indexed Job's completion index
    Flavor.PYTORCHJOB: "PET_NODE_RANK",  # Master 0, Worker i -> i + 1
    Flavor.VOLCANO: "VC_TASK_INDEX",  # Volcano's env plugin
}
# PyTorchJob's operator only runs a container of this name.
CONTAINER_NAME = {Flavor.JOBSET: "undying", Flavor.PYTORCHJOB: "pytorch", Flavor.VOLCANO: "undying"}


def object_names(options: RenderOptions) -> dict[str, str]:
    return {"service": f"{options.name}-ctl", "secret": f"{options.name}-token", "spec": f"{options.name}-spec"}


def controller_address(options: RenderOptions) -> str:
    """How every pod reaches node 0's controller: the headless Service's name (same namespace)."""
    return f"{object_names(options)['service']}:{CONTROLLER_PORT}"


def shm_size_gib(spec: JobSpec, options: RenderOptions) -> float:
    """Node shared memory for T1: each local rank keeps ``snapshot_slots`` copies of its state."""
    return spec.nproc_per_node * spec.checkpoint.snapshot_slots * options.state_gib + SHM_HEADROOM_GIB


def quantity_gib(gib: float) -> str:
    """A memory quantity in whole MiB (``Mi``), rounded up."""
    return f"{math.ceil(gib * 1024)}Mi"


def node_script(spec: JobSpec, options: RenderOptions, first_node: int = 0) -> str:
    """The container's shell: read the engine's index, join as that node (``first_node`` + the
    index: a group of pods that starts at node 1), or as a spare beyond nnodes, then exec `undying
    run` with the fixed arguments ("$@")."""
    variable = NODE_INDEX_VARIABLE[options.flavor]
    index = f'"${{{variable}:?{variable} is not set: not started by the engine}}"'
    rank = f"node_rank={index}\n" if first_node == 0 else f"index={index}\nnode_rank=$((index + {first_node}))\n"
    return (
        f"{rank}"
        'spare=""\n'
        f'if [ "$node_rank" -ge {spec.nnodes} ]; then spare="--standby 1"; fi\n'
        'exec undying run --node-rank "$node_rank" $spare "$@"\n'
    )


def node_arguments(options: RenderOptions) -> list[str]:
    """`undying run`'s arguments, the same in every pod (the node rank is added by the script)."""
    arguments = ["--config", f"{SPEC_DIR}/{SPEC_FILE}",
                 "--pod-labels", f"{POD_INFO_DIR}/labels", "--pod-annotations", f"{POD_INFO_DIR}/annotations",
                 "--token-file", f"{TOKEN_DIR}/{TOKEN_KEY}", "--run-dir", RUN_DIR, *certificate_arguments(options)]
    if options.etcd:
        # Every pod is a controller candidate and advertises the address it binds: its own pod IP
        # (the kubelet expands $(POD_IP) from the container's environment).
        arguments += ["--controller-bind", f"$({POD_IP_VARIABLE})", "--etcd", options.etcd, "--job-name", options.name]
    else:
        arguments += ["--controller", controller_address(options), "--controller-bind", "0.0.0.0"]
    return [*arguments, *options.script]


def pod_template(spec: JobSpec, options: RenderOptions, restart_policy: str, first_node: int = 0) -> dict[str, Any]:
    """The pod template of every node and spare (of those from ``first_node`` on, where an engine
    holds node 0 apart); the seeds' keys on its metadata are what `undying run` reads back through
    the Downward API."""
    names = object_names(options)
    shm = quantity_gib(shm_size_gib(spec, options))
    storage, storage_mounts = storage_volumes(spec, options)
    certificates, certificate_mounts = certificate_volumes(options)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME[options.flavor],
        "image": options.image,
        "command": ["/bin/sh", "-c", node_script(spec, options, first_node), "undying-node"],
        "args": node_arguments(options),
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"},
                {"name": POD_IP_VARIABLE, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                # names the pod's run directory on a run volume (subPathExpr)
                {"name": POD_NAME_VARIABLE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": CONTROLLER_PORT_NAME, "containerPort": CONTROLLER_PORT, "protocol": "TCP"}],
        "resources": container_resources(spec, options, shm),
        "volumeMounts": [
            {"name": "job-spec", "mountPath": SPEC_DIR, "readOnly": True},
            {"name": "job-token", "mountPath": TOKEN_DIR, "readOnly": True},
            {"name": "pod-info", "mountPath": POD_INFO_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *certificate_mounts,
            *storage_mounts,
        ],
    }
    credentials = credentials_env_from(options)
    if credentials:
        container["envFrom"] = credentials
    volumes = [
        {"name": "job-spec", "configMap": {"name": names["spec"]}},
        {"name": "job-token", "secret": {"secretName": token_secret_name(options), "defaultMode": 0o400}},
        {"name": "pod-info", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
        ]}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
        *certificates,
        *storage,
    ]
    return {
        "metadata": {"labels": {**options.job_labels, **spec_labels(spec), "app.kubernetes.io/name": "undying",
                                INSTANCE_LABEL: options.name},
                     "annotations": {**options.job_annotations, **spec_annotations(spec)}},
        "spec": {"restartPolicy": restart_policy, "containers": [container], "volumes": volumes,
                 **pod_spec_placement(spec, options)},
    }


def controller_service(options: RenderOptions, node0_selector: dict[str, str]) -> dict[str, Any]:
    """Headless Service naming node 0's pod: its DNS name resolves to that pod's own address, so the
    controller and its store are reached directly (published before the pod is ready: agents poll)."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": object_names(options)["service"], "labels": {INSTANCE_LABEL: options.name}},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": node0_selector,
                 "ports": [{"name": CONTROLLER_PORT_NAME, "port": CONTROLLER_PORT,
                            "targetPort": CONTROLLER_PORT_NAME, "protocol": "TCP"}]},
    }


def token_secret_name(options: RenderOptions) -> str:
    """The Secret the pods read the token from: ``--token-secret``'s, else the rendered one."""
    return options.token_secret or object_names(options)["secret"]


def token_secret(options: RenderOptions) -> dict[str, Any]:
    token = options.token or secrets.token_hex(24)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": object_names(options)["secret"], "labels": {INSTANCE_LABEL: options.name}},
            "stringData": {TOKEN_KEY: token}}


def spec_config_map(spec: JobSpec, options: RenderOptions) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": object_names(options)["spec"], "labels": {INSTANCE_LABEL: options.name}},
            "data": {SPEC_FILE: yaml.safe_dump(spec_to_dict(spec), sort_keys=False)}}
