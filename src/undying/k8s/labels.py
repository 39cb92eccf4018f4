"""The seeds' Kubernetes labels and annotations <-> job spec fields, both ways.

Runs in the ``undying k8s render`` process (spec -> metadata) and in a pod's ``undying run``
(metadata -> spec: the pod's labels and annotations, read from Downward API files, applied over
the spec before the launcher starts). A bad value is one ``SpecError`` line naming the label or
annotation and its allowed values, as a bad YAML value names its field.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from undying.config import JobSpec, SpecError, validate_job_spec
from undying.config.errors import allowed_strategy_list
from undying.config.loading import spec_to_dict


class Place(enum.StrEnum):
    """Where a seed key lives on the pod (MindCluster puts switches in labels, lists in annotations)."""

    LABEL = "label"
    ANNOTATION = "annotation"


@dataclass(frozen=True)
class SeedKey:
    """One of the seeds' keys: its name on the pod, the spec field it sets, how its text reads."""

    name: str
    place: Place
    field: str
    allowed: str
    to_text: Callable[[Any], str]
    from_text: Callable[[str], Any]  # raises ValueError for a value outside ``allowed``


def _on_off_to_bool(text: str) -> bool:
    if text not in ("on", "off"):
        raise ValueError(text)
    return text == "on"


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(text)
        return text

    return parse


def _whole_number(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(text)
    return int(text)


def _strategy_list(text: str) -> list[str]:
    # Each name is checked by the spec itself, which names the unknown one.
    return [name.strip() for name in text.split(",")]


SEED_KEYS: tuple[SeedKey, ...] = (
    SeedKey("process-recover-enable", Place.LABEL, "process_recover", "on, off",
            lambda enabled: "on" if enabled else "off", _on_off_to_bool),
    SeedKey("pod-rescheduling", Place.LABEL, "pod_rescheduling", "on, off", str, _choice("on", "off")),
    SeedKey("fault-scheduling", Place.LABEL, "fault_scheduling", "force, grace, off", str,
            _choice("force", "grace", "off")),
    SeedKey("recover-strategy", Place.ANNOTATION, "recover_strategy", allowed_strategy_list(),
            lambda names: ",".join(str(name) for name in names), _strategy_list),
    SeedKey("wait-reschedule-timeout", Place.ANNOTATION, "wait_reschedule_timeout", "30..270 (seconds)",
            str, _whole_number),
)
_KEY_OF_FIELD = {key.field: key for key in SEED_KEYS}


def spec_labels(spec: JobSpec) -> dict[str, str]:
    """The seeds' labels for a pod of this job."""
    return _texts(spec, Place.LABEL)


def spec_annotations(spec: JobSpec) -> dict[str, str]:
    """The seeds' annotations for a pod of this job."""
    return _texts(spec, Place.ANNOTATION)


def _texts(spec: JobSpec, place: Place) -> dict[str, str]:
    return {key.name: key.to_text(getattr(spec, key.field)) for key in SEED_KEYS if key.place is place}


def apply_pod_metadata(spec: JobSpec, labels: Mapping[str, str], annotations: Mapping[str, str],
                       owner: str = "pod") -> JobSpec:
    """``spec`` with the seeds' keys found in ``labels`` and ``annotations`` applied over it.

    Other keys (the engine's own, ``kubectl``'s) are ignored. A seed key under the wrong kind
    (an annotation that should be a label) is read as well: either place states the user's intent.
    Raises ``SpecError`` naming the label or annotation (of the ``owner``: the pod's, or the job's
    given to ``undying k8s render``) when its value, or the spec it makes, is not allowed."""
    found = {**_present(labels, Place.LABEL), **_present(annotations, Place.ANNOTATION)}
    if not found:
        return spec
    merged = spec_to_dict(spec)
    for key, (place, text) in found.items():
        try:
            merged[key.field] = key.from_text(text.strip())
        except ValueError:
            raise SpecError(f"{owner} {place.value} {key.name}", "unknown value", key.allowed, text) from None
    try:
        return validate_job_spec(merged)
    except SpecError as error:
        field = error.field.split("[")[0].split(".")[0]
        named = _KEY_OF_FIELD.get(field)
        if named is None or named not in found:
            raise
        place = found[named][0]
        raise SpecError(f"{owner} {place.value} {named.name}", error.problem, error.allowed, error.value) from None


def _present(metadata: Mapping[str, str], place: Place) -> dict[SeedKey, tuple[Place, str]]:
    return {key: (place, str(metadata[key.name])) for key in SEED_KEYS if key.name in metadata}


def read_downward_api_file(path: str | Path, what: str) -> dict[str, str]:
    """Parse a Downward API ``metadata.labels``/``metadata.annotations`` file: one ``key="value"``
    per line, the value quoted as a Go string (``\\"``, ``\\\\``, ``\\n`` escapes). ``what`` names
    the option the file came from in the one-line error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise SpecError(what, f"cannot read {path}: {error.strerror}",
                        "a Downward API file of the pod's metadata", str(path)) from None
    entries: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        key, sep, quoted = line.partition("=")
        try:
            if not sep:
                raise ValueError(line)
            value = json.loads(quoted)
            if not isinstance(value, str):
                raise ValueError(line)
        except ValueError:
            raise SpecError(what, f"line {number} of {path} is not key=\"value\"",
                            "a Downward API file of the pod's metadata", line) from None
        entries[key.strip()] = value
    return entries


def format_downward_api_file(entries: Mapping[str, str]) -> str:
    """``entries`` as the kubelet writes a Downward API metadata file (sorted ``key="value"``
    lines); for tests and local runs that stand in for a pod."""
    return "".join(f"{key}={json.dumps(value)}\n" for key, value in sorted(entries.items()))


def apply_pod_metadata_files(spec: JobSpec, labels_file: str | None, annotations_file: str | None) -> JobSpec:
    """``apply_pod_metadata`` of the Downward API files given to `undying run`
    (``--pod-labels``, ``--pod-annotations``); a file not given counts as empty."""
    labels = read_downward_api_file(labels_file, "--pod-labels") if labels_file else {}
    annotations = read_downward_api_file(annotations_file, "--pod-annotations") if annotations_file else {}
    return apply_pod_metadata(spec, labels, annotations)
