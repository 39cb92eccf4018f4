"""A whole rendered job: Secret (token), ConfigMap (job.yaml), headless Service (controller) and
the engine's job object; written as YAML, and read back into the spec the pods will run.

Runs in the ``undying k8s render`` process, and in tests that check the manifests.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from undying.config import JobSpec, load_job_spec
from undying.config.loading import validate_job_spec
from undying.k8s.engines import engine_job, node0_selector
from undying.k8s.labels import apply_pod_metadata
from undying.k8s.pod import SPEC_FILE, RenderOptions, controller_service, spec_config_map, token_secret

# The job's name prefixes every object's name and, with JobSet, its pods' hostnames (63 at most).
_JOB_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?")


class RenderError(ValueError):
    """A render option that cannot make a valid job; ``str()`` is one line naming the option."""


def check_render_options(spec: JobSpec, options: RenderOptions) -> None:
    if not _JOB_NAME.fullmatch(options.name):
        raise RenderError(f"--name: allowed 1-40 lowercase letters, digits or '-', starting and ending "
                          f"with a letter or digit (got {options.name!r})")
    if options.standby < 0:
        raise RenderError(f"--standby: allowed 0 or more spare pods (got {options.standby})")
    if options.standby and spec.pod_rescheduling != "on":
        raise RenderError("--standby: spare pods take a lost node's place only with pod_rescheduling: on "
                          f"(got {spec.pod_rescheduling!r})")
    if not options.state_gib > 0:
        raise RenderError(f"--state-gib: allowed a size > 0 in GiB (got {options.state_gib})")
    if not options.script:
        raise RenderError("--script: allowed the training script and its arguments, e.g. '/app/train.py --steps 100' "
                          "(got nothing)")


def render_job(spec: JobSpec, options: RenderOptions) -> list[dict[str, Any]]:
    """Every object of the job, in the order to apply them (the pods' inputs before the pods)."""
    check_render_options(spec, options)
    # With etcd the leader is found in etcd, on whichever pod it runs: no Service for node 0.
    service = [] if options.etcd else [controller_service(options, node0_selector(options))]
    return [token_secret(options), spec_config_map(spec, options), *service, engine_job(spec, options)]


def render_file(path: str | Path, options: RenderOptions, nodes: int | None = None) -> list[dict[str, Any]]:
    """``render_job`` of the YAML spec at ``path``; ``nodes`` overrides its ``nnodes``."""
    spec = load_job_spec(path, {"nnodes": nodes})
    return render_job(spec, options)


class _ManifestDumper(yaml.SafeDumper):
    """Writes multi-line strings (the node script, job.yaml) as literal blocks a reader can follow."""


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_ManifestDumper.add_representer(str, _represent_text)


def dump_manifests(objects: Sequence[dict[str, Any]]) -> str:
    """The objects as one multi-document YAML stream (``kubectl apply -f``)."""
    return yaml.dump_all(objects, Dumper=_ManifestDumper, sort_keys=False)


def write_manifests(objects: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """One file per object, numbered in apply order: ``DIR/NN-kind-name.yaml``."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for number, manifest in enumerate(objects):
        path = directory / f"{number:02d}-{manifest['kind'].lower()}-{manifest['metadata']['name']}.yaml"
        path.write_text(dump_manifests([manifest]))
        written.append(path)
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
