"""Kubernetes: manifests for the cluster engines users run (JobSet, Kubeflow PyTorchJob, Volcano),
and the seeds' labels and annotations read back by a pod's ``undying run``.

``labels`` maps the seeds' keys to spec fields; ``options`` holds what the render is asked for
(``names``: Kubernetes' name and quantity rules, ``option_checks``: the options checked together);
``pod`` builds the pod every node runs, with ``storage`` (checkpoint and run volumes) and
``placement`` (scheduling, resources, grace); ``exit_codes`` is the table of what a pod's exit
means, which ``engines`` renders as each engine's policies around the pod; ``render`` assembles
and writes a job, ``command`` is the CLI's ``undying k8s render``. Runs in the CLI process and in
a pod's ``undying run``; nothing here talks to an API server.
"""

from __future__ import annotations

from undying.k8s.labels import apply_pod_metadata, read_downward_api_file, spec_annotations, spec_labels
from undying.k8s.names import RenderError
from undying.k8s.options import Flavor, RenderOptions
from undying.k8s.render import render_job, spec_of_rendered

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
