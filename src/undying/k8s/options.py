"""What ``undying k8s render`` is asked for besides the spec: the engine, image and script, spares,
storage for checkpoints and run directories, placement, resources, retry budgets, the token and
the job's own labels and annotations; and the parsers of the options written as text.

Runs in the ``undying k8s render`` process (and in tests that render). A bad text is one
``RenderError`` line naming the option; whole-job checks are in ``option_checks``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from undying.k8s.names import (
    check_label_value,
    check_object_name,
    check_qualified_name,
    option_error,
    quantity_value,
)


class Flavor(enum.StrEnum):
    """The cluster engine a job is rendered for."""

    JOBSET = "jobset"
    PYTORCHJOB = "pytorchjob"
    VOLCANO = "volcano"


class VolumeKind(enum.StrEnum):
    """Where a volume's storage comes from."""

    PVC = "pvc"  # an existing PersistentVolumeClaim (ReadWriteMany: every pod mounts it)
    CLAIM = "claim"  # a claim the JobSet creates for the job (volumeClaimPolicies), kept when the job is deleted
    HOSTPATH = "hostpath"  # a directory of each host: shared only if every host mounts one filesystem there


VOLUME_FORMS = "pvc:CLAIM, claim:SIZE[:STORAGECLASS] (JobSet) or hostpath:/PATH"


@dataclass(frozen=True)
class VolumeSource:
    """One ``--checkpoint-volume`` / ``--run-volume``: its kind and what names its storage."""

    kind: VolumeKind
    claim_name: str = ""  # pvc
    size: str = ""  # claim: the storage it requests
    storage_class: str = ""  # claim: "" for the cluster's default class
    host_path: str = ""  # hostpath


def parse_volume(option: str, text: str) -> VolumeSource:
    kind_text, _, rest = text.partition(":")
    if kind_text == VolumeKind.PVC and rest:
        return VolumeSource(VolumeKind.PVC, claim_name=check_object_name(option, rest))
    if kind_text == VolumeKind.CLAIM and rest:
        size, _, storage_class = rest.partition(":")
        if quantity_value(option, size) <= 0:
            raise option_error(option, "a storage size > 0, e.g. claim:4Ti:filestore-rwx", text)
        return VolumeSource(VolumeKind.CLAIM, size=size,
                            storage_class=check_object_name(option, storage_class) if storage_class else "")
    if kind_text == VolumeKind.HOSTPATH and rest.startswith("/") and "\n" not in rest:
        return VolumeSource(VolumeKind.HOSTPATH, host_path=rest.rstrip("/") or "/")
    raise option_error(option, VOLUME_FORMS, text)


TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class Toleration:
    """``KEY[=VALUE][:EFFECT]``, as ``kubectl taint`` writes a taint: no VALUE tolerates any value
    (operator Exists), no EFFECT every effect."""

    key: str
    value: str | None = None
    effect: str | None = None

    def to_dict(self) -> dict[str, str]:
        toleration = {"key": self.key, "operator": "Exists" if self.value is None else "Equal"}
        if self.value is not None:
            toleration["value"] = self.value
        if self.effect is not None:
            toleration["effect"] = self.effect
        return toleration


def parse_toleration(text: str) -> Toleration:
    option = "--toleration"
    taint, colon, effect = text.rpartition(":") if ":" in text else (text, "", "")
    if colon and effect not in TOLERATION_EFFECTS:
        raise option_error(option, f"KEY[=VALUE][:EFFECT], EFFECT one of {', '.join(TOLERATION_EFFECTS)}", text)
    key, equals, value = taint.partition("=")
    check_qualified_name(option, key)
    if equals:
        check_label_value(option, value)
    return Toleration(key, value if equals else None, effect or None)


def parse_node_selector(texts: list[str]) -> dict[str, str]:
    selector = {}
    for text in texts:
        key, equals, value = text.partition("=")
        if not equals:
            raise option_error("--node-selector", "KEY=VALUE, a label of the nodes to run on", text)
        selector[check_qualified_name("--node-selector", key)] = check_label_value("--node-selector", value)
    return selector


def parse_metadata(option: str, texts: list[str], labels: bool) -> dict[str, str]:
    """``--label``/``--annotation KEY=VALUE`` (a label's value is checked as one)."""
    entries = {}
    for text in texts:
        key, equals, value = text.partition("=")
        if not equals:
            raise option_error(option, "KEY=VALUE", text)
        check_qualified_name(option, key)
        entries[key] = check_label_value(option, value) if labels else value
    return entries


@dataclass(frozen=True)
class Placement:
    """Where the pods may run and in which order the cluster admits them."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    one_pod_per_node: bool = True  # required anti-affinity on the host: no two pods of the job share a node
    exclusive_topology: str | None = None  # JobSet: the job alone in one domain of this node label
    priority_class: str | None = None
    queue: str | None = None  # Volcano's queue, or Kueue's LocalQueue (JobSet, PyTorchJob)


@dataclass(frozen=True)
class Resources:
    """The container's CPU and memory (quantities as Kubernetes writes them); the memory request
    defaults to the memory-backed /dev/shm's size, which counts against the pod's memory."""

    cpu_request: str | None = None
    cpu_limit: str | None = None
    memory_request: str | None = None
    memory_limit: str | None = None


# Pod failures other than a drain, a preemption or a stop: recreations of one pod (JobSet: per
# index; Volcano: times the pods, in its one job-wide count); then whole-job restarts.
DEFAULT_POD_RETRIES = 10
DEFAULT_JOB_RETRIES = 3


@dataclass(frozen=True)
class Retries:
    """The engine's retry budgets (docs/kubernetes.md maps them per engine). undying's own
    ``max_restarts`` (restarts inside live pods) is not one of them."""

    pod: int = DEFAULT_POD_RETRIES
    job: int = DEFAULT_JOB_RETRIES


@dataclass(frozen=True)
class RenderOptions:
    """What ``undying k8s render`` was asked for besides the spec.

    ``state_gib``: one rank's training state (parameters + optimizer state) in GiB, which sizes
    ``/dev/shm`` for the T1 snapshot slots. ``standby``: spare pods (node ranks nnodes and up).
    ``etcd``: controller failover endpoints (every pod a controller candidate). ``token``: the job's
    secret (generated when None); ``token_secret``: an existing Secret holding it (none rendered).
    ``checkpoint_volume`` is mounted at ``checkpoint.dir``; run directories go to ``run_volume``
    (default: the checkpoint volume), else to the pod's own disk. ``job_labels`` and
    ``job_annotations`` go on the job object and its pods; the seeds' keys among them set the spec.
    ``tls_secret``: the controller's certificate, key and CA (tls.crt, tls.key, ca.crt);
    ``etcd_tls_secret``: etcd's CA (ca.crt), with ``etcd_client_cert`` also this job's client
    certificate (tls.crt, tls.key); all existing Secrets, mounted in every pod (certificates.py)."""

    name: str
    flavor: Flavor
    image: str
    script: list[str]  # the training script and its arguments, as `undying run` takes them
    standby: int = 0
    state_gib: float = 1.0
    gpu_resource: str | None = None  # e.g. nvidia.com/gpu: nproc_per_node of them per pod
    etcd: str | None = None
    token: str | None = None
    token_secret: str | None = None
    tls_secret: str | None = None
    etcd_tls_secret: str | None = None
    etcd_client_cert: bool = False
    checkpoint_volume: VolumeSource | None = None
    run_volume: VolumeSource | None = None
    checkpoint_secret: str | None = None  # object-store credentials: every key becomes a variable
    service_account: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    placement: Placement = field(default_factory=Placement)
    resources: Resources = field(default_factory=Resources)
    retries: Retries = field(default_factory=Retries)
    job_labels: dict[str, str] = field(default_factory=dict)
    job_annotations: dict[str, str] = field(default_factory=dict)

    @property
    def volume_for_runs(self) -> VolumeSource | None:
        return self.run_volume or self.checkpoint_volume

