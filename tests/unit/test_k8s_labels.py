"""The seeds' labels and annotations: written from the spec, read back over it, and a bad value
is one line naming the label or annotation and its allowed values (as a bad YAML value names its
field). The round trip spec -> rendered manifests -> spec must give back an equal spec."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from undying.config import JobSpec, SpecError, validate_job_spec
from undying.k8s import Flavor, RenderOptions, apply_pod_metadata, render_job, spec_annotations, spec_labels
from undying.k8s.labels import SEED_KEYS, format_downward_api_file, read_downward_api_file
from undying.k8s.render import spec_of_rendered

RECOVERING = {"process_recover": True, "recover_strategy": ["recover-in-place", "recover", "dump"],
              "pod_rescheduling": "on", "fault_scheduling": "grace", "wait_reschedule_timeout": 90,
              "nnodes": 3, "nproc_per_node": 4, "checkpoint": {"dir": "s3://bucket/ckpt", "interval": 50}}


def test_the_seeds_keys_are_written_where_the_seeds_put_them() -> None:
    spec = validate_job_spec(RECOVERING)
    assert spec_labels(spec) == {"process-recover-enable": "on", "pod-rescheduling": "on",
                                 "fault-scheduling": "grace"}
    assert spec_annotations(spec) == {"recover-strategy": "recover-in-place,recover,dump",
                                      "wait-reschedule-timeout": "90"}


@pytest.mark.parametrize("fields", [RECOVERING, {}, {"fault_scheduling": "off", "wait_reschedule_timeout": 30}])
def test_metadata_applied_over_defaults_gives_back_the_seed_fields(fields: dict) -> None:
    spec = validate_job_spec(fields)
    read_back = apply_pod_metadata(JobSpec(), spec_labels(spec), spec_annotations(spec))
    for key in SEED_KEYS:
        assert getattr(read_back, key.field) == getattr(spec, key.field), key.name


@pytest.mark.parametrize("flavor", list(Flavor))
@pytest.mark.parametrize("fields", [RECOVERING, {"nnodes": 2, "checkpoint": {"dir": "s3://bucket/ckpt"}}])
def test_round_trip_spec_manifests_spec(flavor: Flavor, fields: dict) -> None:
    spec = validate_job_spec(fields)
    standby = 1 if spec.pod_rescheduling == "on" else 0
    objects = render_job(spec, RenderOptions(name="llm", flavor=flavor, image="img", script=["train.py"],
                                             standby=standby))
    assert spec_of_rendered(objects) == spec


def test_annotations_edited_on_the_manifest_change_the_spec_read_back() -> None:
    spec = validate_job_spec({"nnodes": 2, "checkpoint": {"dir": "s3://bucket/ckpt"}})
    objects = render_job(spec, RenderOptions(name="llm", flavor=Flavor.JOBSET, image="img", script=["t.py"]))
    template = objects[-1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    template["metadata"]["labels"]["process-recover-enable"] = "on"
    template["metadata"]["annotations"]["recover-strategy"] = "retry,recover-in-place"
    edited = spec_of_rendered(objects)
    assert edited.process_recover and [str(name) for name in edited.recover_strategy] == ["retry", "recover-in-place"]


@pytest.mark.parametrize(("labels", "annotations", "message"), [
    ({"process-recover-enable": "yes"}, {},
     "job spec: pod label process-recover-enable: unknown value; allowed: on, off (got 'yes')"),
    ({"pod-rescheduling": "true"}, {}, "job spec: pod label pod-rescheduling: unknown value; allowed: on, off"),
    ({"fault-scheduling": "soft"}, {},
     "job spec: pod label fault-scheduling: unknown value; allowed: force, grace, off (got 'soft')"),
    ({}, {"wait-reschedule-timeout": "20"},
     "job spec: pod annotation wait-reschedule-timeout: out of range; allowed: 30..270 (got 20)"),
    ({}, {"wait-reschedule-timeout": "soon"},
     "job spec: pod annotation wait-reschedule-timeout: unknown value; allowed: 30..270 (seconds) (got 'soon')"),
    ({"process-recover-enable": "on"}, {"recover-strategy": "recover,restart"},
     "job spec: pod annotation recover-strategy: unknown strategy; allowed: retry, recover-in-place"),
    ({}, {"recover-strategy": "recover"},
     "job spec: pod annotation recover-strategy: needs process_recover: true"),
])
def test_a_bad_value_is_one_line_naming_the_label_or_annotation(labels: dict, annotations: dict,
                                                                 message: str) -> None:
    with pytest.raises(SpecError) as caught:
        apply_pod_metadata(JobSpec(), labels, annotations)
    text = str(caught.value)
    assert "\n" not in text
    assert text.startswith(message), text


def test_other_keys_are_ignored_and_no_seed_key_leaves_the_spec_as_it_is() -> None:
    spec = validate_job_spec(RECOVERING)
    metadata = {"batch.kubernetes.io/job-completion-index": "1", "kubectl.kubernetes.io/restartedAt": "x"}
    assert apply_pod_metadata(spec, metadata, metadata) is spec


def test_downward_api_files_are_parsed_as_the_kubelet_writes_them(tmp_path: Path) -> None:
    entries = {"recover-strategy": "retry,exit", "note": 'say "hi"\nback\\slash', "empty": ""}
    path = tmp_path / "annotations"
    path.write_text(format_downward_api_file(entries))
    assert path.read_text().splitlines()[0] == 'empty=""'
    assert read_downward_api_file(path, "--pod-annotations") == entries


def test_a_malformed_or_missing_downward_api_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "labels"
    path.write_text('pod-rescheduling="on"\npod-rescheduling on\n')
    with pytest.raises(SpecError, match=r"^job spec: --pod-labels: line 2 of .* is not key=\"value\""):
        read_downward_api_file(path, "--pod-labels")
    with pytest.raises(SpecError, match=r"^job spec: --pod-labels: cannot read .*/missing: No such file"):
        read_downward_api_file(tmp_path / "missing", "--pod-labels")


def test_undying_run_refuses_a_bad_annotation_with_one_line_and_exit_2(tmp_path: Path) -> None:
    annotations = tmp_path / "annotations"
    annotations.write_text(format_downward_api_file({"recover-strategy": "recover,teleport"}))
    labels = tmp_path / "labels"
    labels.write_text(format_downward_api_file({"process-recover-enable": "on"}))
    result = subprocess.run(
        [sys.executable, "-m", "undying.cli", "run", "--pod-labels", str(labels), "--pod-annotations",
         str(annotations), "--run-dir", str(tmp_path / "run"), "examples/gpt/train.py"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "undying: error: job spec: pod annotation recover-strategy: unknown strategy; allowed: retry, "
        "recover-in-place, recover, elastic-training, dump, exit (got 'teleport')"]
    assert not (tmp_path / "run").exists()
