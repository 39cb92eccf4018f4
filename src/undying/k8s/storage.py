"""Storage a rendered pod mounts: the checkpoint volume at ``checkpoint.dir`` (T2, which every pod
must reach: the controller refuses a node that does not share the root, root_probe.py), the run
directories on a volume that outlives the pods, object-store credentials from a Secret; and the
check, at render time, that T2 lands where every pod reads it.

Runs in the ``undying k8s render`` process.
"""

from __future__ import annotations

import posixpath
from typing import Any

from undying.config import JobSpec
from undying.k8s.names import RenderError
from undying.k8s.options import VOLUME_FORMS, Flavor, RenderOptions, VolumeKind, VolumeSource
from undying.root_probe import writes_t2

RUN_DIR = "/var/lib/undying/run"
# Paths the pod mounts for itself, which a checkpoint volume must not cover.
RESERVED_PATHS = ("/etc/undying", "/dev/shm", "/var/lib/undying")
CHECKPOINT_VOLUME = "checkpoints"
RUN_VOLUME = "runs"
RUNS_SUBDIR = "runs"  # on the run volume: one directory per pod, named after the pod
POD_NAME_VARIABLE = "POD_NAME"


def is_url(directory: str) -> bool:
    return "://" in directory


def pod_count(spec: JobSpec, options: RenderOptions) -> int:
    return spec.nnodes + options.standby


def _volume(name: str, source: VolumeSource) -> dict[str, Any] | None:
    """The pod's volume for ``source``; None for a JobSet claim (JobSet adds it to the pods)."""
    if source.kind is VolumeKind.PVC:
        return {"name": name, "persistentVolumeClaim": {"claimName": source.claim_name}}
    if source.kind is VolumeKind.HOSTPATH:
        return {"name": name, "hostPath": {"path": source.host_path, "type": "DirectoryOrCreate"}}
    return None


def _named_sources(options: RenderOptions) -> list[tuple[str, VolumeSource]]:
    sources = []
    if options.checkpoint_volume is not None:
        sources.append((CHECKPOINT_VOLUME, options.checkpoint_volume))
    if options.run_volume is not None and options.run_volume != options.checkpoint_volume:
        sources.append((RUN_VOLUME, options.run_volume))
    return sources


def _run_volume_name(options: RenderOptions) -> str | None:
    if options.volume_for_runs is None:
        return None
    return CHECKPOINT_VOLUME if options.volume_for_runs == options.checkpoint_volume else RUN_VOLUME


def storage_volumes(spec: JobSpec, options: RenderOptions) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's storage volumes and the container's mounts of them: the checkpoint volume at
    ``checkpoint.dir``, and ``RUN_DIR`` as ``runs/POD_NAME`` of the run volume (each pod, and each
    replacement, a directory of its own), else the pod's own disk (emptyDir)."""
    volumes = [volume for name, source in _named_sources(options) if (volume := _volume(name, source))]
    mounts = []
    if options.checkpoint_volume is not None:
        assert spec.checkpoint.dir is not None  # option_checks: a checkpoint volume needs checkpoint.dir
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": spec.checkpoint.dir})
    run_volume = _run_volume_name(options)
    if run_volume is None:
        volumes.append({"name": "run-dir", "emptyDir": {}})
        mounts.append({"name": "run-dir", "mountPath": RUN_DIR})
    else:
        mounts.append({"name": run_volume, "mountPath": RUN_DIR,
                       "subPathExpr": f"{RUNS_SUBDIR}/$({POD_NAME_VARIABLE})"})
    return volumes, mounts


def credentials_env_from(options: RenderOptions) -> list[dict[str, Any]]:
    """Every key of the credentials Secret as a variable (fsspec's backends read AWS_*, GOOGLE_*, ...)."""
    if options.checkpoint_secret is None:
        return []
    return [{"secretRef": {"name": options.checkpoint_secret}}]


def volume_claim_policies(options: RenderOptions) -> list[dict[str, Any]]:
    """JobSet's claims for ``claim:`` volumes: one ReadWriteMany PVC per job (named
    ``VOLUME-JOBNAME``), kept when the JobSet is deleted so that a new one resumes from it."""
    templates = []
    for name, source in _named_sources(options):
        if source.kind is not VolumeKind.CLAIM:
            continue
        claim_spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"],
                                      "resources": {"requests": {"storage": source.size}}}
        if source.storage_class:
            claim_spec["storageClassName"] = source.storage_class
        templates.append({"metadata": {"name": name}, "spec": claim_spec})
    return [{"templates": templates, "retentionPolicy": {"whenDeleted": "Retain"}}] if templates else []


def check_storage(spec: JobSpec, options: RenderOptions) -> list[str]:
    """Refuse storage the job cannot run on (one ``RenderError`` line); return notes for storage
    that works but loses something (one line each)."""
    directory = spec.checkpoint.dir
    for option, source in (("--checkpoint-volume", options.checkpoint_volume), ("--run-volume", options.run_volume)):
        if source is not None and source.kind is VolumeKind.CLAIM and options.flavor is not Flavor.JOBSET:
            raise RenderError(f"{option}: claim: is JobSet's (volumeClaimPolicies); with --flavor "
                              f"{options.flavor} create a ReadWriteMany PVC and give pvc:CLAIM (allowed {VOLUME_FORMS})")
    if options.checkpoint_volume is not None:
        if directory is None or is_url(directory) or not posixpath.isabs(directory):
            raise RenderError("--checkpoint-volume: mounted at checkpoint.dir, which must then be an absolute path "
                              f"(got {directory!r})")
        normalized = posixpath.normpath(directory)
        clash = next((path for path in RESERVED_PATHS if normalized == path or normalized.startswith(path + "/")
                      or path.startswith(normalized + "/") or normalized == "/"), None)
        if clash is not None:
            raise RenderError(f"checkpoint.dir: {directory!r} would cover the pod's own {clash}; choose another "
                              "mount point, e.g. /mnt/checkpoints")
    notes = []
    shared = options.checkpoint_volume is not None or (directory is not None and is_url(directory))
    if writes_t2(spec) and not shared:
        where = f"checkpoint.dir {directory!r}" if directory else "checkpoint.dir (unset: RUN_DIR/checkpoints)"
        if pod_count(spec, options) > 1:
            raise RenderError(f"{where}: no volume is mounted there, so each pod would write T2 checkpoints to its "
                              "own disk and the controller refuses the nodes at start (exit 2); give "
                              f"--checkpoint-volume {VOLUME_FORMS}, or an object-store URL, or "
                              "checkpoint.persist: false")
        notes.append(f"{where} is on the pod's own disk: T2 checkpoints are lost with the pod; "
                     "--checkpoint-volume keeps them")
    if directory is not None and is_url(directory) and not (options.checkpoint_secret or options.service_account):
        notes.append(f"checkpoint.dir {directory!r}: no --checkpoint-secret (credentials as environment) nor "
                     "--service-account (workload identity): the pods use whatever credentials the image "
                     "or the node gives")
    if options.volume_for_runs is None:
        notes.append("run directories (events, logs, node 0's result.json) are on each pod's own disk and "
                     "go with the pod; --run-volume (or --checkpoint-volume) keeps them")
    if options.checkpoint_volume is not None and options.checkpoint_volume.kind is VolumeKind.HOSTPATH:
        notes.append("--checkpoint-volume hostpath: every pod reads what the others wrote only if every host mounts one shared "
                     "filesystem at that path (a node-local disk is not: the controller refuses the nodes, exit 2)")
    return notes
