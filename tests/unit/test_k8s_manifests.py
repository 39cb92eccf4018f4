"""Rendered manifests are valid Kubernetes: core objects (Service, Secret, ConfigMap, the pod templates,
the JobSet's Job template) by ``kubernetes-validate`` (strict: an unknown field fails), the engines'
own objects by their CRD schemas (tests/k8s_schemas/README.md) with ``jsonschema``, made strict as
the API server's strict field validation is (an unknown field fails), for every flavour with a
PVC, a Secret, placement and a GPU resource. And each pod gets what `undying run` needs: its node
rank from the engine's index variable, the controller's Service, the token Secret, the spec,
/dev/shm sized for T1. Nothing here runs against a cluster."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from undying.config import validate_job_spec
from undying.k8s import Flavor, RenderOptions, render_job
from undying.k8s.engines import node0_selector
from undying.k8s.options import Placement, Resources, Toleration, VolumeKind, VolumeSource
from undying.k8s.pod import NODE_INDEX_VARIABLE, node_script
from undying.k8s.render import pod_templates

SCHEMAS = Path(__file__).resolve().parents[1] / "k8s_schemas"
CRD_SCHEMA = {"JobSet": "jobset.x-k8s.io_v1alpha2_jobset.json", "PyTorchJob": "kubeflow.org_v1_pytorchjob.json",
              "Job": "batch.volcano.sh_v1alpha1_job.json"}
POD_LEVEL = {"process_recover": True, "recover_strategy": ["recover-in-place", "recover"],
             "pod_rescheduling": "on", "nnodes": 3, "nproc_per_node": 4,
             "checkpoint": {"dir": "s3://bucket/ckpt", "snapshot_slots": 3}}
JOB_LEVEL = {"nnodes": 2, "nproc_per_node": 8, "max_restarts": 5, "checkpoint": {"dir": "/mnt/ckpt/run"}}
PVC = VolumeSource(VolumeKind.PVC, claim_name="llm-ckpt")
# Everything a real cluster asks for: storage, credentials, placement, queue, resources, a GPU, TLS.
CLUSTER = {"checkpoint_volume": PVC, "checkpoint_secret": "s3-credentials", "service_account": "trainer",
           "image_pull_secrets": ("regcred",), "gpu_resource": "nvidia.com/gpu",
           "placement": Placement(node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
                                  tolerations=(Toleration("nvidia.com/gpu", "present", "NoSchedule"),
                                               Toleration("dedicated")),
                                  priority_class="training-high", queue="team-a"),
           "resources": Resources("90", "96", "1500Gi", "1800Gi"), "tls_secret": "llm-tls"}


def rendered(fields: dict, flavor: Flavor, standby: int = 0, **options: Any) -> list[dict[str, Any]]:
    spec = validate_job_spec(fields)
    return render_job(spec, RenderOptions(name="llm-run", flavor=flavor, image="registry/undying:1",
                                          script=["/app/train.py", "--steps", "100"], standby=standby, **options))


def engine_object(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [job] = [item for item in objects if item["apiVersion"] != "v1"]
    return job


def core_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The core objects, plus the pod templates (and a JobSet's Job template) as objects of their own."""
    core = [item for item in objects if item["apiVersion"] == "v1"]
    job = engine_object(objects)
    for number, template in enumerate(pod_templates(job)):
        core.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{number}"},
                     "template": template})
    if job["kind"] == "JobSet":
        for replicated in job["spec"]["replicatedJobs"]:
            core.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": replicated["name"]},
                         "spec": replicated["template"]["spec"]})
    return core


def strict(schema: Any) -> Any:
    """A CRD schema as the API server's strict field validation applies it: an object schema that
    lists its properties (and does not preserve unknown fields) takes no others."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


def crd_schema(kind: str) -> dict[str, Any]:
    return strict(json.loads((SCHEMAS / CRD_SCHEMA[kind]).read_text()))


POD_LEVEL_LOCAL = {**POD_LEVEL, "checkpoint": {"dir": "/mnt/ckpt/run", "snapshot_slots": 3}}
CASES = [(flavor, fields, standby, CLUSTER) for flavor in Flavor
         for fields, standby in ((POD_LEVEL_LOCAL, 1), (JOB_LEVEL, 0))]
CASES += [(Flavor.JOBSET, POD_LEVEL_LOCAL, 2, {**CLUSTER, "checkpoint_volume": VolumeSource(
              VolumeKind.CLAIM, size="4Ti", storage_class="filestore-rwx"), "token_secret": "llm-token",
              "placement": Placement(exclusive_topology="cloud.google.com/gke-nodepool")}),
          (Flavor.VOLCANO, POD_LEVEL, 1, {"run_volume": VolumeSource(VolumeKind.HOSTPATH, host_path="/mnt/runs"),
                                           "etcd": "etcd-0:2379", "etcd_tls_secret": "etcd-client",
                                           "etcd_client_cert": True, "tls_secret": "llm-tls"})]
CASE_IDS = [f"{flavor.value}-{'pod' if fields.get('pod_rescheduling') else 'job'}-{number}"
            for number, (flavor, fields, _, _) in enumerate(CASES)]


@pytest.mark.parametrize(("flavor", "fields", "standby", "options"), CASES, ids=CASE_IDS)
def test_core_objects_validate_with_kubernetes_validate(flavor: Flavor, fields: dict, standby: int,
                                                        options: dict) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    version = kubernetes_validate.latest_version()
    for item in core_objects(rendered(fields, flavor, standby, **options)):
        kubernetes_validate.validate(item, version, strict=True)  # raises on any error


@pytest.mark.parametrize(("flavor", "fields", "standby", "options"), CASES, ids=CASE_IDS)
def test_engine_objects_validate_against_their_crd_schemas(flavor: Flavor, fields: dict, standby: int,
                                                           options: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    job = engine_object(rendered(fields, flavor, standby, **options))
    jsonschema.validate(job, crd_schema(job["kind"]))


def test_the_strict_crd_schemas_catch_a_wrong_type_and_an_unknown_field() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    for flavor in Flavor:
        job = engine_object(rendered(POD_LEVEL, flavor))
        schema = crd_schema(job["kind"])
        wrong_type = copy.deepcopy(job)
        pod_templates(wrong_type)[0]["spec"]["containers"][0]["ports"][0]["containerPort"] = "29400"
        unknown = copy.deepcopy(job)
        pod_templates(unknown)[0]["spec"]["terminationGracePeriod"] = 30
        misplaced = copy.deepcopy(job)
        misplaced["spec"]["backoffLimitPerIndex"] = 3
        for bad in (wrong_type, unknown, misplaced):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schema)


def job_api_problems(name: str, job: dict[str, Any]) -> list[str]:
    """What the API server's Job validation refuses beyond the schema (Kubernetes'
    pkg/apis/batch/validation: the failure, success and replacement policies' rules)."""
    problems = []
    indexed = job.get("completionMode") == "Indexed"
    completions = job.get("completions", 1)
    containers = {container["name"] for container in job["template"]["spec"]["containers"]}
    if indexed and len(f"{name}-{completions - 1}") > 63:
        problems.append("pod hostnames longer than a DNS label")
    if ("backoffLimitPerIndex" in job or "maxFailedIndexes" in job or "successPolicy" in job) and not indexed:
        problems.append("per-index fields need indexed completion mode")
    if "maxFailedIndexes" in job and ("backoffLimitPerIndex" not in job or job["maxFailedIndexes"] > completions):
        problems.append("maxFailedIndexes")
    if "podFailurePolicy" in job:
        if job["template"]["spec"]["restartPolicy"] != "Never" or job.get("podReplacementPolicy", "Failed") != "Failed":
            problems.append("podFailurePolicy needs restartPolicy Never and podReplacementPolicy Failed")
        for rule in job["podFailurePolicy"]["rules"]:
            if ("onExitCodes" in rule) == bool(rule.get("onPodConditions")):
                problems.append("a rule needs one of onExitCodes and onPodConditions")
            codes = rule.get("onExitCodes", {})
            values = codes.get("values", [])
            if codes and (not values or values != sorted(set(values)) or (codes["operator"] == "In" and 0 in values)
                          or codes.get("containerName", next(iter(containers))) not in containers):
                problems.append(f"onExitCodes {codes}")
            if any(pattern.get("status") not in ("True", "False", "Unknown") for pattern in rule.get("onPodConditions", [])):
                problems.append("onPodConditions status")
    for rule in job.get("successPolicy", {}).get("rules", []):
        indexes = [int(part) for item in rule.get("succeededIndexes", "").split(",") if item
                   for part in item.split("-")]
        if not indexes or max(indexes) >= completions:
            problems.append(f"successPolicy {rule}")
    return problems


def volcano_policy_problems(policies: list[dict[str, Any]]) -> list[str]:
    """What Volcano's admission webhook refuses in a list of policies (v1.15.1,
    pkg/webhooks/admission/jobs/validate/util.go validatePolicies)."""
    events: list[str] = []
    codes: list[int] = []
    problems = []
    for policy in policies:
        listed = [*policy.get("events", []), *([policy["event"]] if "event" in policy else [])]
        if bool(listed) == ("exitCode" in policy):
            problems.append(f"one of event(s) and exitCode: {policy}")
        if listed and policy["action"] not in ("AbortJob", "RestartJob", "RestartTask", "RestartPod",
                                               "RestartPartition", "TerminateJob", "CompleteJob", "ResumeJob"):
            problems.append(f"action {policy['action']}")
        events += listed
        codes += [policy["exitCode"]] if "exitCode" in policy else []
    if len(set(events)) < len(events) or len(set(codes)) < len(codes) or 0 in codes:
        problems.append("duplicate events or exit codes, or exit code 0")
    return problems


@pytest.mark.parametrize(("flavor", "fields", "standby", "options"), CASES, ids=CASE_IDS)
def test_the_api_servers_and_volcanos_own_rules_hold(flavor: Flavor, fields: dict, standby: int,
                                                     options: dict) -> None:
    job = engine_object(rendered(fields, flavor, standby, **options))
    if job["kind"] == "JobSet":
        [replicated] = job["spec"]["replicatedJobs"]
        assert job_api_problems(f"{job['metadata']['name']}-{replicated['name']}-0", replicated["template"]["spec"]) == []
    if job["kind"] == "Job":
        tasks = job["spec"]["tasks"]
        assert volcano_policy_problems(job["spec"]["policies"]) == []
        assert all(volcano_policy_problems(task.get("policies", [])) == [] for task in tasks)
        assert job["spec"]["minAvailable"] <= sum(task["replicas"] for task in tasks)


def test_the_rule_checks_catch_what_the_api_server_and_volcano_refuse() -> None:
    jobset = engine_object(rendered(POD_LEVEL, Flavor.JOBSET, 1))
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    unsorted = copy.deepcopy(job)
    unsorted["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"] = [130, 75]
    never = copy.deepcopy(job)
    never["template"]["spec"]["restartPolicy"] = "OnFailure"
    beyond = copy.deepcopy(job)
    beyond["successPolicy"]["rules"][0]["succeededIndexes"] = "4"
    for bad in (unsorted, never, beyond):
        assert job_api_problems("llm-run-node-0", bad)
    volcano = engine_object(rendered(POD_LEVEL, Flavor.VOLCANO, 1))
    assert volcano_policy_problems([*volcano["spec"]["policies"], {"exitCode": 75, "action": "RestartPod"}])
    assert volcano_policy_problems([{"event": "PodFailed", "exitCode": 1, "action": "RestartJob"}])


def container(template: dict[str, Any]) -> dict[str, Any]:
    [only] = template["spec"]["containers"]
    return only


@pytest.mark.parametrize("flavor", list(Flavor))
def test_each_pod_reaches_the_controller_token_spec_and_pod_metadata(flavor: Flavor) -> None:
    objects = rendered(POD_LEVEL, flavor, standby=1)
    secret, config_map, service, job = objects
    templates = pod_templates(job)
    assert {template["metadata"]["annotations"]["recover-strategy"] for template in templates} == {
        "recover-in-place,recover"}
    pod = container(templates[0])
    assert pod["command"][:2] == ["/bin/sh", "-c"]
    arguments = pod["args"]

    def value(flag: str) -> str:
        return arguments[arguments.index(flag) + 1]

    assert value("--controller") == f"{service['metadata']['name']}:29400"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == node0_selector(
        RenderOptions(name="llm-run", flavor=flavor, image="", script=[]))
    assert service["spec"]["ports"][0]["targetPort"] == pod["ports"][0]["name"]
    volumes = {volume["name"]: volume for volume in templates[0]["spec"]["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in pod["volumeMounts"]}
    token_dir, token_key = value("--token-file").rsplit("/", 1)
    assert volumes[mounts[token_dir]]["secret"]["secretName"] == secret["metadata"]["name"]
    assert token_key in secret["stringData"] and len(secret["stringData"][token_key]) >= 16
    spec_dir, spec_file = value("--config").rsplit("/", 1)
    assert volumes[mounts[spec_dir]]["configMap"]["name"] == config_map["metadata"]["name"]
    assert validate_job_spec(yaml.safe_load(config_map["data"][spec_file])) == validate_job_spec(POD_LEVEL)
    info_dir = value("--pod-annotations").rsplit("/", 1)[0]
    paths = {item["path"]: item["fieldRef"]["fieldPath"] for item in volumes[mounts[info_dir]]["downwardAPI"]["items"]}
    assert paths == {"labels": "metadata.labels", "annotations": "metadata.annotations"}
    assert arguments[-3:] == ["/app/train.py", "--steps", "100"]


def test_dev_shm_is_a_memory_volume_sized_for_the_t1_slots() -> None:
    template = pod_templates(engine_object(rendered(POD_LEVEL, Flavor.JOBSET, state_gib=2.5)))[0]
    shm = next(volume for volume in template["spec"]["volumes"] if volume["name"] == "dshm")
    # 4 ranks x 3 slots x 2.5 GiB + 1 GiB headroom
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{31 * 1024}Mi"}
    assert container(template)["resources"]["requests"]["memory"] == f"{31 * 1024}Mi"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(template)["volumeMounts"]


def run_node_script(flavor: Flavor, environment: dict[str, str], tmp_path: Path, first_node: int = 0) -> list[str]:
    """The pod's shell with ``undying`` replaced by a stub that prints its arguments."""
    stub = tmp_path / "undying"
    stub.write_text('#!/bin/sh\nfor arg in "$@"; do echo "$arg"; done\n')
    stub.chmod(0o755)
    script = node_script(validate_job_spec(POD_LEVEL), RenderOptions(name="j", flavor=flavor, image="", script=[]),
                         first_node)
    result = subprocess.run(["/bin/sh", "-c", script, "undying-node", "--config", "f", "t.py"], capture_output=True,
                            text=True, env={"PATH": f"{tmp_path}:/usr/bin:/bin", **environment})
    return result.stdout.splitlines() if result.returncode == 0 else [result.stderr.strip()]


@pytest.mark.parametrize("flavor", list(Flavor))
def test_the_node_rank_comes_from_the_engines_index_and_spares_join_beyond_nnodes(flavor: Flavor,
                                                                                  tmp_path: Path) -> None:
    variable = NODE_INDEX_VARIABLE[flavor]
    assert run_node_script(flavor, {variable: "2"}, tmp_path) == ["run", "--node-rank", "2", "--config", "f", "t.py"]
    assert run_node_script(flavor, {variable: "3"}, tmp_path) == [
        "run", "--node-rank", "3", "--standby", "1", "--config", "f", "t.py"]
    [error] = run_node_script(flavor, {}, tmp_path)
    assert f"{variable} is not set" in error
    # Volcano's task of nodes 1 and up counts its own indices from 0
    assert run_node_script(flavor, {variable: "1"}, tmp_path, first_node=1) == [
        "run", "--node-rank", "2", "--config", "f", "t.py"]
    assert run_node_script(flavor, {variable: "2"}, tmp_path, first_node=1) == [
        "run", "--node-rank", "3", "--standby", "1", "--config", "f", "t.py"]


@pytest.mark.parametrize("flavor", list(Flavor))
def test_replicas_and_restart_policies_follow_pod_rescheduling(flavor: Flavor) -> None:
    pod_level = engine_object(rendered(POD_LEVEL, flavor, 1))
    job_level = engine_object(rendered(JOB_LEVEL, flavor, checkpoint_volume=PVC))
    if flavor is Flavor.JOBSET:
        pod_job = pod_level["spec"]["replicatedJobs"][0]["template"]["spec"]
        job_job = job_level["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert pod_job["backoffLimitPerIndex"] == 10 and pod_job["maxFailedIndexes"] == 0
        assert "backoffLimit" not in pod_job and job_job["backoffLimit"] == 0
        assert pod_job["completions"] == pod_job["parallelism"] == 4  # 3 nodes + 1 spare
        assert {job["podReplacementPolicy"] for job in (pod_job, job_job)} == {"Failed"}
    elif flavor is Flavor.PYTORCHJOB:
        replicas = pod_level["spec"]["pytorchReplicaSpecs"]
        assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
        assert {spec["restartPolicy"] for spec in replicas.values()} == {"ExitCode"}
        assert {spec["restartPolicy"] for spec in job_level["spec"]["pytorchReplicaSpecs"].values()} == {"Never"}
        assert "backoffLimit" not in pod_level["spec"]["runPolicy"]
        # at the Master's end, pods still running stop; finished ones (their logs) stay
        assert pod_level["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    else:
        assert pod_level["spec"]["policies"][-1] == {"events": ["PodFailed", "PodEvicted"], "action": "RestartPod"}
        assert job_level["spec"]["policies"][-1] == {"events": ["PodFailed", "PodEvicted"], "action": "RestartJob"}
        assert pod_level["spec"]["minAvailable"] == 3
        head, nodes = pod_level["spec"]["tasks"]
        assert (head["replicas"], nodes["replicas"]) == (1, 3)  # node 0 apart: its success completes the job
        assert head["policies"] == [{"event": "TaskCompleted", "action": "CompleteJob"}]
    for job in (pod_level, job_level):
        assert {template["spec"]["restartPolicy"] for template in pod_templates(job)} == {"Never"}


def test_the_cli_writes_one_file_per_object_and_refuses_bad_options(tmp_path: Path) -> None:
    spec_path = tmp_path / "llm_run.yaml"
    spec_path.write_text(yaml.safe_dump({"nnodes": 2, "nproc_per_node": 2, "checkpoint": {"dir": "/mnt/ckpt"}}))

    def render(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "undying.cli", "k8s", "render", str(spec_path),
                               "--script", "/app/train.py --steps 5", *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=60)

    result = render("--flavor", "volcano", "--nodes", "3", "--checkpoint-volume", "pvc:ckpt",
                    "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # checkpoints and run directories on the PVC: nothing is lost
    files = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert files == ["00-secret-llm-run-token.yaml", "01-configmap-llm-run-spec.yaml",
                     "02-service-llm-run-ctl.yaml", "03-job-llm-run.yaml"]
    job = yaml.safe_load((tmp_path / "out" / files[-1]).read_text())
    assert job["spec"]["minAvailable"] == 3
    refused = render("--flavor", "jobset", "--standby", "1", "--checkpoint-volume", "pvc:ckpt")
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        "undying: error: --standby: spare pods take a lost node's place only with pod_rescheduling: on (got 'off')"]
    bad_flavor = render("--flavor", "mpijob")
    assert bad_flavor.returncode == 2 and len(bad_flavor.stderr.splitlines()) == 1


def test_every_flavour_runs_the_same_node_command_but_for_its_index_variable() -> None:
    """The engines' pods differ only in the variable the node rank is read from (the real-process
    test, tests/faults/test_k8s_pods.py, runs each engine's pods with its own variables)."""
    commands = {}
    for flavor in Flavor:
        pod = container(pod_templates(engine_object(rendered(POD_LEVEL, flavor, standby=1)))[0])
        script = pod["command"][2].replace(NODE_INDEX_VARIABLE[flavor], "INDEX")
        # PyTorchJob's pods also name the port its operator reads MASTER_PORT from (unused by undying).
        ports = [port for port in pod["ports"] if port["name"] != "pytorchjob-port"]
        assert (len(ports) < len(pod["ports"])) == (flavor == Flavor.PYTORCHJOB)
        commands[flavor] = (pod["command"][:2], script, pod["command"][3:], pod["args"], pod["env"], ports)
    assert commands[Flavor.PYTORCHJOB] == commands[Flavor.JOBSET] == commands[Flavor.VOLCANO]


@pytest.mark.parametrize("flavor", list(Flavor))
def test_with_etcd_every_pod_is_a_candidate_bound_to_its_pod_ip(flavor: Flavor) -> None:
    objects = rendered(POD_LEVEL, flavor, standby=1, etcd="etcd-0:2379,etcd-1:2379")
    assert [item["kind"] for item in objects if item["apiVersion"] == "v1"] == ["Secret", "ConfigMap"]
    pod = container(pod_templates(engine_object(objects))[0])
    arguments = pod["args"]
    assert "--controller" not in arguments
    assert arguments[arguments.index("--controller-bind") + 1] == "$(POD_IP)"
    assert arguments[arguments.index("--etcd") + 1:arguments.index("--etcd") + 4] == [
        "etcd-0:2379,etcd-1:2379", "--job-name", "llm-run"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in pod["env"]
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    for item in core_objects(objects):
        kubernetes_validate.validate(item, kubernetes_validate.latest_version(), strict=True)
