"""A whole rendered job: Secret (token), ConfigMap (job.yaml), headless Service (controller) and
the engine's job object; written as YAML (a render into the same directory keeps the token and
removes what it no longer writes), and read back into the spec the pods will run.

Runs in the ``undying k8s render`` process, and in tests that check the manifests.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from undying.config import JobSpec
from undying.config.loading import validate_job_spec
from undying.k8s.engines import engine_job, node0_selector
from undying.k8s.labels import apply_pod_metadata
from undying.k8s.names import RenderError
from undying.k8s.option_checks import check_render_options
from undying.k8s.pod import (
    SPEC_FILE,
    TOKEN_KEY,
    RenderOptions,
    controller_service,
    spec_config_map,
    token_secret,
)


def render_with_notes(spec: JobSpec, options: RenderOptions) -> tuple[list[dict[str, Any]], list[str]]:
    """Every object of the job, in the order to apply them (the pods' inputs before the pods), and
    the notes (one line each) on what the job as rendered loses. The seeds' keys among the job's
    labels and annotations (``--label``, ``--annotation``) are applied over ``spec`` first: they
    reach the pods' spec and metadata, and the engine's policies, like the spec's own fields."""
    spec = apply_pod_metadata(spec, options.job_labels, options.job_annotations, owner="job")
    notes = check_render_options(spec, options)
    # With etcd the leader is found in etcd, on whichever pod it runs: no Service for node 0.
    service = [] if options.etcd else [controller_service(options, node0_selector(options))]
    secret = [] if options.token_secret else [token_secret(options)]
    return [*secret, spec_config_map(spec, options), *service, engine_job(spec, options)], notes


def render_job(spec: JobSpec, options: RenderOptions) -> list[dict[str, Any]]:
    """``render_with_notes`` without the notes."""
    return render_with_notes(spec, options)[0]


class _ManifestDumper(yaml.SafeDumper):
    """Writes multi-line strings (the node script, job.yaml) as literal blocks a reader can follow."""


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_ManifestDumper.add_representer(str, _represent_text)


def dump_manifests(objects: Sequence[dict[str, Any]]) -> str:
    """The objects as one multi-document YAML stream (``kubectl apply -f``)."""
    return yaml.dump_all(objects, Dumper=_ManifestDumper, sort_keys=False)


# What write_manifests names its files: NN-KIND-NAME.yaml, NAME the job's name or one of its objects'.
_MANIFEST_FILE = re.compile(r"\d\d-[a-z0-9]+-(?P<name>[a-z0-9-]+)\.yaml")


def _files_of_job(directory: Path, job_name: str) -> list[Path]:
    """The manifest files an earlier render of this job wrote in ``directory``."""
    names = {job_name, f"{job_name}-ctl", f"{job_name}-spec", f"{job_name}-token"}
    return [path for path in sorted(directory.glob("[0-9][0-9]-*.yaml"))
            if (match := _MANIFEST_FILE.fullmatch(path.name)) and match["name"] in names]


def kept_token(out_dir: str | Path, job_name: str) -> str | None:
    """The token of the Secret an earlier render of this job wrote to ``out_dir``, if any: a render
    into the same directory keeps it, so that applying again changes nothing."""
    directory = Path(out_dir)
    if not directory.is_dir():
        return None
    for path in _files_of_job(directory, job_name):
        try:
            manifest = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(manifest, dict) and manifest.get("kind") == "Secret":
            token = (manifest.get("stringData") or {}).get(TOKEN_KEY)
            if isinstance(token, str) and token:
                return token
    return None


def write_manifests(objects: Sequence[dict[str, Any]], out_dir: str | Path, job_name: str) -> list[Path]:
    """One file per object, numbered in apply order: ``DIR/NN-kind-name.yaml``. Files an earlier
    render of the same job left that this one does not write are removed (``kubectl apply -f DIR``
    would apply them too). Raises ``RenderError`` naming ``--out`` when the directory is not writable."""
    directory = Path(out_dir)
    written = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        earlier = _files_of_job(directory, job_name)
        for number, manifest in enumerate(objects):
            path = directory / f"{number:02d}-{manifest['kind'].lower()}-{manifest['metadata']['name']}.yaml"
            path.write_text(dump_manifests([manifest]))
            written.append(path)
        for stale in set(earlier) - set(written):
            stale.unlink()
    except OSError as error:
        raise RenderError(f"--out: cannot write the manifests to {str(directory)!r}: "
                          f"{error.strerror or error}") from None
    return written


def pod_templates(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates inside an engine's job object (one per replica group)."""
    spec = job["spec"]
    if job["kind"] == "JobSet":
        return [replicated["template"]["spec"]["template"] for replicated in spec["replicatedJobs"]]
    if job["kind"] == "PyTorchJob":
        return [replica["template"] for replica in spec["pytorchReplicaSpecs"].values()]
    return [task["template"] for task in spec["tasks"]]


def spec_of_rendered(objects: Sequence[dict[str, Any]]) -> JobSpec:
    """The spec a pod of these manifests runs: the ConfigMap's job.yaml with the pod template's
    labels and annotations applied over it, as `undying run` does through the Downward API."""
    [config_map] = [item for item in objects if item["kind"] == "ConfigMap"]
    base = validate_job_spec(yaml.safe_load(config_map["data"][SPEC_FILE]))
    [job] = [item for item in objects if item["kind"] not in ("Secret", "ConfigMap", "Service")]
    [template, *others] = pod_templates(job)
    metadata = template["metadata"]
    if any(other["metadata"] != metadata for other in others):
        raise ValueError("the replica groups' pod templates carry different labels or annotations")
    return apply_pod_metadata(base, metadata.get("labels", {}), metadata.get("annotations", {}))
