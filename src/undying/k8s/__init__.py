"""Kubernetes: manifests for the cluster engines users run (JobSet, Kubeflow PyTorchJob, Volcano),
and the seeds' labels and annotations read back by a pod's ``undying run``.

``labels`` maps the seeds' keys to spec fields, ``pod`` builds the pod every node runs, ``engines``
wraps it in each engine's job object, ``render`` assembles and writes a job, ``command`` is the
CLI's ``undying k8s render``. Runs in the CLI process and in a pod's ``undying run``; nothing here
talks to an API server.
"""

from __future__ import annotations

from undying.k8s.labels import apply_pod_metadata, read_downward_api_file, spec_annotations, spec_labels
from undying.k8s.pod import Flavor, RenderOptions
from undying.k8s.render import RenderError, render_job, spec_of_rendered

__all__ = [
    "Flavor",
    "RenderError",
    "RenderOptions",
    "apply_pod_metadata",
    "read_downward_api_file",
    "render_job",
    "spec_annotations",
    "spec_labels",
    "spec_of_rendered",
]
