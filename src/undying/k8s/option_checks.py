"""The render options checked against each other and the spec before anything is rendered: every
name and quantity as the API server would take it, the options one engine has and the others do
not, resources that cover /dev/shm, storage every pod reaches.

Runs in the ``undying k8s render`` process. A refusal is one ``RenderError`` line naming the option;
``check_render_options`` returns the notes (one line each) for a job that runs but loses something.
"""

from __future__ import annotations

import math

from undying.config import JobSpec
from undying.etcd import parse_endpoints
from undying.k8s.certificates import check_certificates
from undying.k8s.names import (
    RenderError,
    check_dns_label,
    check_extended_resource,
    check_label_value,
    check_object_name,
    check_qualified_name,
    option_error,
    quantity_value,
)
from undying.k8s.options import Flavor, RenderOptions
from undying.k8s.pod import quantity_gib, shm_size_gib
from undying.k8s.storage import check_storage

# The job's name prefixes every object's name and its pods' names and hostnames (63 at most).
LONGEST_JOB_NAME = 40


def check_render_options(spec: JobSpec, options: RenderOptions) -> list[str]:
    """Raise ``RenderError`` for options that cannot make a valid job; return the render's notes."""
    check_dns_label("--name", options.name, LONGEST_JOB_NAME)
    if options.standby < 0:
        raise option_error("--standby", "0 or more spare pods", options.standby)
    if options.standby and spec.pod_rescheduling != "on":
        raise RenderError("--standby: spare pods take a lost node's place only with pod_rescheduling: on "
                          f"(got {spec.pod_rescheduling!r})")
    if not (math.isfinite(options.state_gib) and options.state_gib > 0):
        raise option_error("--state-gib", "a size > 0 in GiB", options.state_gib)
    if not options.script:
        raise option_error("--script", "the training script and its arguments, e.g. '/app/train.py --steps 100'", "")
    if not options.image or any(character.isspace() for character in options.image):
        raise option_error("--image", "a container image reference, e.g. registry.example.com/llm:1", options.image)
    if options.gpu_resource is not None:
        check_extended_resource("--gpu-resource", options.gpu_resource)
    if options.etcd is not None:
        _check_etcd(options.etcd)
    _check_names(options)
    _check_resources(spec, options)
    if options.retries.pod < 0 or options.retries.job < 0:
        option = "--pod-retries" if options.retries.pod < 0 else "--job-retries"
        raise option_error(option, "0 or more", min(options.retries.pod, options.retries.job))
    for key, value in options.job_labels.items():
        check_qualified_name("--label", key)
        check_label_value("--label", value)
    for key in options.job_annotations:
        check_qualified_name("--annotation", key)
    return [*check_certificates(options), *check_storage(spec, options)]


def _check_etcd(endpoints: str) -> None:
    try:
        parsed = parse_endpoints(endpoints)
    except ValueError:
        parsed = []
    if not parsed or any(not host or not 0 < port < 65536 for host, port in parsed):
        raise option_error("--etcd", "HOST:PORT[,HOST:PORT...], the etcd cluster's client endpoints", endpoints)


def _check_names(options: RenderOptions) -> None:
    named = [("--token-secret", options.token_secret), ("--checkpoint-secret", options.checkpoint_secret),
             ("--tls-secret", options.tls_secret), ("--etcd-tls-secret", options.etcd_tls_secret),
             ("--service-account", options.service_account), ("--priority-class", options.placement.priority_class),
             *(("--image-pull-secret", secret) for secret in options.image_pull_secrets)]
    for option, name in named:
        if name is not None:
            check_object_name(option, name)
    if options.placement.queue is not None:
        # a Volcano queue, or a Kueue LocalQueue whose name is also the value of a label
        check_object_name("--queue", options.placement.queue)
        check_label_value("--queue", options.placement.queue)
    if options.placement.exclusive_topology is not None:
        if options.flavor is not Flavor.JOBSET:
            raise RenderError(f"--exclusive-topology: JobSet's placement (allowed with --flavor jobset; got "
                              f"--flavor {options.flavor})")
        check_qualified_name("--exclusive-topology", options.placement.exclusive_topology)


def _check_resources(spec: JobSpec, options: RenderOptions) -> None:
    wanted = options.resources
    texts = {"--cpu-request": wanted.cpu_request, "--cpu-limit": wanted.cpu_limit,
             "--memory-request": wanted.memory_request, "--memory-limit": wanted.memory_limit}
    quantities = {option: quantity_value(option, text) for option, text in texts.items() if text is not None}
    for option, value in quantities.items():
        if value <= 0:
            raise option_error(option, "a quantity > 0", texts[option])
    shm = quantity_gib(shm_size_gib(spec, options))
    shm_bytes = quantity_value("/dev/shm", shm)
    for option in ("--memory-request", "--memory-limit"):
        if option in quantities and quantities[option] < shm_bytes:
            raise RenderError(f"{option}: must cover the memory-backed /dev/shm of {shm} (nproc_per_node x "
                              "checkpoint.snapshot_slots x --state-gib + 1 GiB), which counts as the pod's "
                              f"memory (got {texts[option]!r})")
    for kind in ("cpu", "memory"):
        request, limit = f"--{kind}-request", f"--{kind}-limit"
        if request in quantities and limit in quantities and quantities[limit] < quantities[request]:
            raise RenderError(f"{limit}: must be at least {request} (got {texts[limit]!r} < {texts[request]!r})")
