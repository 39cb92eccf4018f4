"""Every option of ``undying k8s render`` lands where the cluster reads it: checkpoint and run
volumes and object-store credentials, placement and gang scheduling, resources, service account
and image pull secrets, the token's Secret, the TLS certificates' Secrets, the job's own labels and annotations; renders repeat
byte for byte; and every bad option is one line naming it (exit 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from undying.cli import build_parser, main
from undying.config import SpecError, validate_job_spec
from undying.k8s import Flavor, RenderError, RenderOptions, render_job, spec_of_rendered
from undying.k8s.options import Placement, Resources, Toleration, VolumeKind, VolumeSource
from undying.k8s.render import pod_templates, render_with_notes

LOCAL = {"process_recover": True, "recover_strategy": ["recover-in-place", "recover"], "pod_rescheduling": "on",
         "nnodes": 2, "nproc_per_node": 2, "checkpoint": {"dir": "/mnt/ckpt/llm"}}
URL = {**LOCAL, "checkpoint": {"dir": "s3://bucket/llm"}}
PVC = VolumeSource(VolumeKind.PVC, claim_name="llm-ckpt")


def options(flavor: Flavor = Flavor.JOBSET, **fields: Any) -> RenderOptions:
    return RenderOptions(name="llm", flavor=flavor, image="img", script=["t.py"], **fields)


def rendered(spec_fields: dict, flavor: Flavor = Flavor.JOBSET, **fields: Any) -> list[dict[str, Any]]:
    return render_job(validate_job_spec(spec_fields), options(flavor, **fields))


def job_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [job] = [item for item in objects if item["apiVersion"] != "v1"]
    return job


def pod_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = pod_templates(job_of(objects))[0]["spec"]
    return spec


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [only] = pod_spec(objects)["containers"]
    return only


# ---------------------------------------------------------------- storage

@pytest.mark.parametrize("flavor", list(Flavor))
def test_a_pvc_holds_the_checkpoints_at_checkpoint_dir_and_each_pods_run_directory(flavor: Flavor) -> None:
    objects = rendered(LOCAL, flavor, checkpoint_volume=PVC, checkpoint_secret="s3-keys")
    volumes = {volume["name"]: volume for volume in pod_spec(objects)["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container(objects)["volumeMounts"]}
    checkpoints = mounts["/mnt/ckpt/llm"]
    assert volumes[checkpoints["name"]]["persistentVolumeClaim"] == {"claimName": "llm-ckpt"}
    runs = mounts["/var/lib/undying/run"]
    # the same claim, a directory per pod (a replacement pod gets its own): CHECKPOINT_DIR/runs/POD_NAME
    assert runs["name"] == checkpoints["name"] and runs["subPathExpr"] == "runs/$(POD_NAME)"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container(objects)["env"]
    assert container(objects)["envFrom"] == [{"secretRef": {"name": "s3-keys"}}]


def test_a_run_volume_of_its_own_and_a_host_path() -> None:
    objects = rendered(URL, run_volume=VolumeSource(VolumeKind.HOSTPATH, host_path="/mnt/shared/runs"))
    volumes = {volume["name"]: volume for volume in pod_spec(objects)["volumes"]}
    [runs] = [mount for mount in container(objects)["volumeMounts"] if mount["mountPath"] == "/var/lib/undying/run"]
    assert volumes[runs["name"]]["hostPath"] == {"path": "/mnt/shared/runs", "type": "DirectoryOrCreate"}
    assert "envFrom" not in container(objects)


def test_a_jobset_claim_is_created_for_the_job_and_kept_when_it_is_deleted() -> None:
    claim = VolumeSource(VolumeKind.CLAIM, size="4Ti", storage_class="filestore-rwx")
    job = job_of(rendered(LOCAL, checkpoint_volume=claim))
    [policy] = job["spec"]["volumeClaimPolicies"]
    [template] = policy["templates"]
    assert policy["retentionPolicy"] == {"whenDeleted": "Retain"}
    assert template["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "4Ti"}},
                                "storageClassName": "filestore-rwx"}
    pod = pod_templates(job)[0]["spec"]
    # JobSet adds the claim's volume to the pods: the template mounts it by name and declares none
    assert template["metadata"]["name"] not in {volume["name"] for volume in pod["volumes"]}
    assert {mount["name"] for mount in pod["containers"][0]["volumeMounts"]
            if mount["mountPath"] in ("/mnt/ckpt/llm", "/var/lib/undying/run")} == {template["metadata"]["name"]}


@pytest.mark.parametrize(("spec_fields", "fields", "message"), [
    (LOCAL, {}, "checkpoint.dir '/mnt/ckpt/llm': no volume is mounted there, so each pod would write T2"),
    ({**LOCAL, "checkpoint": {}}, {}, "checkpoint.dir (unset: RUN_DIR/checkpoints): no volume is mounted there"),
    (URL, {"checkpoint_volume": PVC}, "--checkpoint-volume: mounted at checkpoint.dir, which must then be an "
                                      "absolute path (got 's3://bucket/llm')"),
    ({**LOCAL, "checkpoint": {"dir": "/var/lib/undying"}}, {"checkpoint_volume": PVC},
     "checkpoint.dir: '/var/lib/undying' would cover the pod's own /var/lib/undying"),
    (LOCAL, {"flavor": Flavor.VOLCANO, "checkpoint_volume": VolumeSource(VolumeKind.CLAIM, size="1Ti")},
     "--checkpoint-volume: claim: is JobSet's (volumeClaimPolicies); with --flavor volcano create"),
])
def test_storage_the_job_cannot_start_on_is_refused(spec_fields: dict, fields: dict, message: str) -> None:
    flavor = fields.pop("flavor", Flavor.JOBSET)
    with pytest.raises(RenderError) as refused:
        rendered(spec_fields, flavor, **fields)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_notes_for_storage_that_works_but_loses_something() -> None:
    single = validate_job_spec({"checkpoint": {"dir": "/mnt/ckpt"}})
    _, notes = render_with_notes(single, options())
    assert [note.split(":")[0] for note in notes] == ["checkpoint.dir '/mnt/ckpt' is on the pod's own disk",
                                                      "run directories (events, logs, node 0's result.json) are on "
                                                      "each pod's own disk and go with the pod; --run-volume (or "
                                                      "--checkpoint-volume) keeps them"]
    _, notes = render_with_notes(validate_job_spec(URL), options())
    assert notes[0].startswith("checkpoint.dir 's3://bucket/llm': no --checkpoint-secret")
    _, notes = render_with_notes(validate_job_spec(URL), options(checkpoint_secret="keys", run_volume=PVC))
    assert notes == []
    _, notes = render_with_notes(validate_job_spec(LOCAL), options(
        checkpoint_volume=VolumeSource(VolumeKind.HOSTPATH, host_path="/lustre/ckpt")))
    assert notes == ["--checkpoint-volume hostpath: every pod reads what the others wrote only if every host mounts "
                     "one shared filesystem at that path (a node-local disk is not: the controller refuses the "
                     "nodes, exit 2)"]
    no_t2 = validate_job_spec({**LOCAL, "checkpoint": {"dir": "/mnt/ckpt", "persist": False}})
    assert render_with_notes(no_t2, options(run_volume=PVC))[1] == []


# ---------------------------------------------------------------- placement and scheduling

@pytest.mark.parametrize("flavor", list(Flavor))
def test_placement_priority_account_pull_secrets_and_resources_reach_the_pod(flavor: Flavor) -> None:
    placement = Placement(node_selector={"pool": "h100"},
                          tolerations=(Toleration("nvidia.com/gpu", "present", "NoSchedule"), Toleration("spot")),
                          priority_class="training-high")
    objects = rendered(URL, flavor, placement=placement, service_account="trainer", gpu_resource="nvidia.com/gpu",
                       image_pull_secrets=("regcred", "mirror"), resources=Resources("30", "32", "200Gi", "240Gi"))
    pod = pod_spec(objects)
    assert pod["nodeSelector"] == {"pool": "h100"}
    assert pod["tolerations"][:2] == [
        {"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"},
        {"key": "spot", "operator": "Exists"}]
    assert pod["affinity"] == {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "llm"}},
         "topologyKey": "kubernetes.io/hostname"}]}}
    assert pod_templates(job_of(objects))[0]["metadata"]["labels"]["app.kubernetes.io/instance"] == "llm"
    assert (pod["priorityClassName"], pod["serviceAccountName"]) == ("training-high", "trainer")
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    assert container(objects)["resources"] == {"requests": {"memory": "200Gi", "cpu": "30"},
                                               "limits": {"cpu": "32", "memory": "240Gi", "nvidia.com/gpu": 2}}
    job = job_of(objects)
    if flavor is Flavor.VOLCANO:
        assert job["spec"]["priorityClassName"] == "training-high"
    if flavor is Flavor.PYTORCHJOB:
        assert job["spec"]["runPolicy"]["schedulingPolicy"]["priorityClass"] == "training-high"


def test_one_pod_per_node_can_be_turned_off_and_jobset_places_the_job_alone_in_a_domain() -> None:
    shared = pod_spec(rendered(URL, placement=Placement(one_pod_per_node=False)))
    assert "affinity" not in shared
    job = job_of(rendered(URL, placement=Placement(exclusive_topology="cloud.google.com/gke-nodepool")))
    assert job["spec"]["replicatedJobs"][0]["template"]["metadata"] == {
        "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}}
    with pytest.raises(RenderError, match=r"^--exclusive-topology: JobSet's placement"):
        rendered(URL, Flavor.VOLCANO, placement=Placement(exclusive_topology="rack"))


def test_the_queue_is_volcanos_own_or_kueues_label() -> None:
    queued = Placement(queue="team-a")
    assert job_of(rendered(URL, Flavor.VOLCANO, placement=queued))["spec"]["queue"] == "team-a"
    for flavor in (Flavor.JOBSET, Flavor.PYTORCHJOB):
        job = job_of(rendered(URL, flavor, placement=queued))
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "queue" not in job_of(rendered(URL, Flavor.VOLCANO))["spec"]


@pytest.mark.parametrize(("fields", "gang"), [
    ({}, 4),
    ({"min_nodes": 2}, 4),  # without elastic training the job never runs on fewer nodes
    ({"min_nodes": 2, "recover_strategy": ["recover", "elastic-training"]}, 2),
])
def test_the_gang_is_every_node_or_min_nodes_with_elastic_training(fields: dict, gang: int) -> None:
    spec_fields = {**URL, "nnodes": 4, **fields}
    volcano = job_of(rendered(spec_fields, Flavor.VOLCANO, standby=1))
    assert volcano["spec"]["minAvailable"] == gang
    assert sum(task["replicas"] for task in volcano["spec"]["tasks"]) == 5
    pytorchjob = job_of(rendered(spec_fields, Flavor.PYTORCHJOB, standby=1))
    assert pytorchjob["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == gang


# ---------------------------------------------------------------- repeatable renders, the job's metadata

def test_an_existing_token_secret_is_named_and_none_is_rendered() -> None:
    objects = rendered(URL, token_secret="llm-token")
    assert [item["kind"] for item in objects if item["apiVersion"] == "v1"] == ["ConfigMap", "Service"]
    token = next(volume for volume in pod_spec(objects)["volumes"] if volume["name"] == "job-token")
    assert token["secret"]["secretName"] == "llm-token"
    assert rendered(URL, token_secret="llm-token") == objects  # nothing random left: the render repeats


def cli(*argv: str) -> int:
    return main(["k8s", "render", *argv])


def test_a_render_into_the_same_directory_is_byte_for_byte_the_same(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = tmp_path / "llm.yaml"
    spec_path.write_text(yaml.safe_dump(URL))
    out = tmp_path / "out"
    arguments = [str(spec_path), "--flavor", "jobset", "--script", "t.py", "--standby", "1", "--out", str(out),
                 "--checkpoint-secret", "keys", "--run-volume", "pvc:runs"]
    assert cli(*arguments) == 0
    first = {path.name: path.read_bytes() for path in out.iterdir()}
    assert cli(*arguments) == 0
    assert {path.name: path.read_bytes() for path in out.iterdir()} == first
    # without the controller's Service (etcd): the earlier Service file goes, the job's number moves
    assert cli(*arguments, "--etcd", "etcd-0:2379") == 0
    assert sorted(path.name for path in out.iterdir()) == [
        "00-secret-llm-token.yaml", "01-configmap-llm-spec.yaml", "02-jobset-llm.yaml"]
    assert (out / "00-secret-llm-token.yaml").read_bytes() == first["00-secret-llm-token.yaml"]
    capsys.readouterr()


def test_the_seeds_keys_given_as_the_jobs_metadata_set_the_spec_the_pods_and_the_engine() -> None:
    spec = validate_job_spec({"nnodes": 2, "checkpoint": {"dir": "s3://b/c"}})
    objects = render_job(spec, options(Flavor.VOLCANO, standby=1, job_labels={
        "process-recover-enable": "on", "pod-rescheduling": "on", "team": "llm"},
        job_annotations={"recover-strategy": "recover-in-place,recover", "owner": "ml@example.com"}))
    job = job_of(objects)
    template = pod_templates(job)[0]
    for metadata in (job["metadata"], template["metadata"]):
        assert metadata["labels"]["pod-rescheduling"] == "on" and metadata["labels"]["team"] == "llm"
        assert metadata["annotations"]["recover-strategy"] == "recover-in-place,recover"
        assert metadata["annotations"]["owner"] == "ml@example.com"
    assert job["spec"]["policies"][-1]["action"] == "RestartPod"  # the engine's policy follows the label
    [config_map] = [item for item in objects if item["kind"] == "ConfigMap"]
    in_config_map = validate_job_spec(yaml.safe_load(config_map["data"]["job.yaml"]))
    assert in_config_map.pod_rescheduling == "on" and in_config_map == spec_of_rendered(objects)
    # the pod's own keys win over the job's: an edit of the templates is what the pods read
    for edited in pod_templates(job):
        edited["metadata"]["labels"]["process-recover-enable"] = "off"
        edited["metadata"]["annotations"]["recover-strategy"] = "exit"
    assert spec_of_rendered(objects).process_recover is False


def test_a_bad_seed_key_on_the_job_is_one_line_naming_it() -> None:
    with pytest.raises(SpecError) as refused:
        rendered(URL, job_labels={"fault-scheduling": "soft"})
    assert str(refused.value) == ("job spec: job label fault-scheduling: unknown value; allowed: force, grace, off "
                                  "(got 'soft')")


# ---------------------------------------------------------------- TLS certificates from Secrets

def secret_files(objects: list[dict[str, Any]]) -> dict[str, str]:
    """Every file the pod's Secret volumes project: its path in the container -> 'SECRET/KEY'."""
    volumes = {volume["name"]: volume for volume in pod_spec(objects)["volumes"]}
    files = {}
    for mount in container(objects)["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret is not None and "items" in secret:
            assert mount["readOnly"] is True and secret["defaultMode"] == 0o400
            for item in secret["items"]:
                files[f"{mount['mountPath']}/{item['path']}"] = f"{secret['secretName']}/{item['key']}"
    return files


def run_arguments(objects: list[dict[str, Any]]) -> Any:
    """The pod's arguments as `undying run` parses them (the node rank is the script's)."""
    return build_parser().parse_args(["run", "--node-rank", "1", *container(objects)["args"]])


@pytest.mark.parametrize("flavor", list(Flavor))
def test_the_controllers_certificate_is_mounted_from_its_secret_and_passed_to_undying_run(flavor: Flavor) -> None:
    objects = rendered(URL, flavor, tls_secret="llm-tls")
    files = secret_files(objects)
    run = run_arguments(objects)
    assert (files[run.tls_cert], files[run.tls_key], files[run.tls_ca]) == (
        "llm-tls/tls.crt", "llm-tls/tls.key", "llm-tls/ca.crt")
    assert len(files) == 3  # only the keys undying reads: a Secret without one fails the mount, named
    assert run.etcd_ca is None and run.script == "t.py"
    without = rendered(URL, flavor)
    assert secret_files(without) == {} and run_arguments(without).tls_cert is None


@pytest.mark.parametrize("flavor", list(Flavor))
def test_etcds_ca_and_the_optional_client_certificate_come_from_their_own_secret(flavor: Flavor) -> None:
    ca_only = rendered(URL, flavor, etcd="etcd-0:2379", etcd_tls_secret="etcd-ca")
    run = run_arguments(ca_only)
    assert secret_files(ca_only) == {run.etcd_ca: "etcd-ca/ca.crt"}
    assert (run.etcd_cert, run.etcd_key, run.tls_cert) == (None, None, None)
    both = rendered(URL, flavor, etcd="etcd-0:2379", etcd_tls_secret="etcd-client", etcd_client_cert=True,
                    tls_secret="llm-tls")
    files = secret_files(both)
    run = run_arguments(both)
    assert (files[run.etcd_ca], files[run.etcd_cert], files[run.etcd_key]) == (
        "etcd-client/ca.crt", "etcd-client/tls.crt", "etcd-client/tls.key")
    assert files[run.tls_cert] == "llm-tls/tls.crt" and len(files) == 6
    assert len({path.rsplit("/", 1)[0] for path in files}) == 2  # two directories: same key names, no clash


def test_a_shared_certificate_with_etcd_gets_a_note_on_the_pods_addresses() -> None:
    spec = validate_job_spec(URL)
    _, plain = render_with_notes(spec, options(etcd="etcd-0:2379", checkpoint_secret="s3-keys"))
    _, notes = render_with_notes(spec, options(etcd="etcd-0:2379", tls_secret="llm-tls", checkpoint_secret="s3-keys"))
    [note] = [note for note in notes if note not in plain]
    assert note.startswith("--tls-secret 'llm-tls' with --etcd: each candidate pod serves the controller at its "
                           "own pod IP")
    _, without_etcd = render_with_notes(spec, options(tls_secret="llm-tls", checkpoint_secret="s3-keys"))
    assert without_etcd == render_with_notes(spec, options(checkpoint_secret="s3-keys"))[1]


# ---------------------------------------------------------------- one line for every bad option

BAD_OPTIONS = [
    (["--script", "/app/train.py --name 'a b"], "--script: No closing quotation; allowed one shell-quoted string"),
    (["--state-gib", "inf"], "--state-gib: allowed a size > 0 in GiB (got inf)"),
    (["--state-gib", "nan"], "--state-gib: allowed a size > 0 in GiB (got nan)"),
    (["--gpu-resource", "nvidia gpu"], "--gpu-resource: allowed an extended resource DOMAIN/NAME"),
    (["--gpu-resource", "gpu"], "--gpu-resource: allowed an extended resource DOMAIN/NAME"),
    (["--image", ""], "--image: allowed a container image reference"),
    (["--etcd", "etcd-0:two"], "--etcd: allowed HOST:PORT[,HOST:PORT...]"),
    (["--etcd", "etcd-0:2379,:2379"], "--etcd: allowed HOST:PORT[,HOST:PORT...]"),
    (["--name", "LLM_run"], "--name: allowed 1-40 lowercase letters, digits or '-'"),
    (["--checkpoint-volume", "nfs:server:/export"], "--checkpoint-volume: allowed pvc:CLAIM, claim:SIZE"),
    (["--checkpoint-volume", "pvc:Bad_Claim"], "--checkpoint-volume: allowed a Kubernetes object name"),
    (["--checkpoint-volume", "claim:lots"], "--checkpoint-volume: allowed a Kubernetes quantity"),
    (["--run-volume", "hostpath:relative/runs"], "--run-volume: allowed pvc:CLAIM, claim:SIZE"),
    (["--checkpoint-secret", "s3 keys"], "--checkpoint-secret: allowed a Kubernetes object name"),
    (["--token-secret", "Token"], "--token-secret: allowed a Kubernetes object name"),
    (["--tls-secret", "llm_tls"], "--tls-secret: allowed a Kubernetes object name"),
    (["--etcd-tls-secret", "etcd ca", "--etcd", "etcd-0:2379"], "--etcd-tls-secret: allowed a Kubernetes object name"),
    (["--etcd-tls-secret", "etcd-ca"],
     "--etcd-tls-secret: etcd's CA, used only with --etcd (allowed with --etcd HOST:PORT; got --etcd-tls-secret "
     "'etcd-ca' without --etcd)"),
    (["--etcd-client-cert", "--etcd", "etcd-0:2379"], "--etcd-client-cert: the client certificate's tls.crt and "
     "tls.key are read from --etcd-tls-secret (allowed with --etcd-tls-secret SECRET; got none)"),
    (["--node-selector", "pool"], "--node-selector: allowed KEY=VALUE"),
    (["--node-selector", "pool=h100 x"], "--node-selector: allowed a label value"),
    (["--toleration", "gpu:Sometimes"], "--toleration: allowed KEY[=VALUE][:EFFECT]"),
    (["--toleration", "bad key"], "--toleration: allowed a key [PREFIX/]NAME"),
    (["--priority-class", "High"], "--priority-class: allowed a Kubernetes object name"),
    (["--queue", "team/a"], "--queue: allowed a Kubernetes object name"),
    (["--service-account", "sa_1"], "--service-account: allowed a Kubernetes object name"),
    (["--image-pull-secret", "reg cred"], "--image-pull-secret: allowed a Kubernetes object name"),
    (["--cpu-request", "lots"], "--cpu-request: allowed a Kubernetes quantity"),
    (["--cpu-request", "8", "--cpu-limit", "4"], "--cpu-limit: must be at least --cpu-request"),
    (["--memory-request", "1Gi"], "--memory-request: must cover the memory-backed /dev/shm of 9216Mi"),
    (["--memory-limit", "0"], "--memory-limit: allowed a quantity > 0"),
    (["--pod-retries", "-1"], "--pod-retries: allowed 0 or more (got -1)"),
    (["--job-retries", "-2"], "--job-retries: allowed 0 or more (got -2)"),
    (["--exclusive-topology", "rack", "--flavor", "volcano"], "--exclusive-topology: JobSet's placement"),
    (["--label", "team"], "--label: allowed KEY=VALUE"),
    (["--label", "team=ML team"], "--label: allowed a label value"),
    (["--annotation", "bad key=x"], "--annotation: allowed a key [PREFIX/]NAME"),
    (["--label", "pod-rescheduling=maybe"], "job spec: job label pod-rescheduling: unknown value; allowed: on, off"),
    (["--standby", "-1"], "--standby: allowed 0 or more spare pods (got -1)"),
    (["--nodes", "0"], "job spec: nnodes:"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_OPTIONS, ids=[" ".join(extra) for extra, _ in BAD_OPTIONS])
def test_a_bad_option_is_one_line_naming_it(extra: list[str], message: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = tmp_path / "llm.yaml"
    spec_path.write_text(yaml.safe_dump({**LOCAL, "checkpoint": {"dir": "/mnt/ckpt", "snapshot_slots": 2}}))
    arguments = ["--flavor", "jobset", "--script", "t.py", "--checkpoint-volume", "pvc:ckpt", "--state-gib", "2"]
    with pytest.raises(SystemExit) as exited:
        cli(str(spec_path), *arguments, *extra)
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"undying: error: {message}"), line


def test_an_unwritable_out_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = tmp_path / "llm.yaml"
    spec_path.write_text(yaml.safe_dump(URL))
    with pytest.raises(SystemExit) as exited:
        cli(str(spec_path), "--flavor", "jobset", "--script", "t.py", "--out", str(spec_path / "manifests"))
    assert exited.value.code == 2
    [*notes, line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"undying: error: --out: cannot write the manifests to '{spec_path}/manifests': "), line
