"""Rendered pods run for real, without a cluster, for every engine (JobSet, PyTorchJob, Volcano):
the container command, arguments and environment of each pod the engine would create from the
rendered job object, started as one process group per "pod" on 127.0.0.1, with only what a
cluster provides substituted (the Service's host by 127.0.0.1, the Secret, ConfigMap and Downward
API mounts by files holding the same content, the variables the engine sets in each pod). A killed
pod's node is taken over by the spare pod and the job ends with the fault-free parameters.

What this does not show: that a cluster schedules these objects, that the engine creates the pods
and sets the variables as ``engine_pods`` says, resolves the Service to node 0's pod, or recreates
a failed pod. No API server was run (docs/kubernetes.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import (
    EXAMPLE,
    MARK_ENV,
    REPO,
    STEPS,
    JobRun,
    assert_ends_bitwise,
    run_job,
    wait_no_processes,
)
from tests.faults.test_real_hosts import Hosts
from undying import events as ev
from undying.config import validate_job_spec
from undying.k8s import Flavor, RenderOptions, render_job
from undying.k8s.labels import format_downward_api_file
from undying.k8s.pod import POD_INFO_DIR, RUN_DIR, SPEC_DIR, TOKEN_DIR, controller_address

pytestmark = pytest.mark.faults

# tests/conftest.py's BASE_ARGS as a job.yaml, with pod-level recovery onto a spare.
JOB_YAML = {"nnodes": 2, "nproc_per_node": 2, "monitor_interval": 0.3, "heartbeat_interval": 0.5,
            "heartbeat_timeout": 4, "node_return_timeout": 60, "comm_timeout": 20, "warm_standby": False,
            "sample_log": True, "state_digests": True, "process_recover": True, "pod_rescheduling": "on",
            "recover_strategy": ["recover-in-place", "recover"]}
KILL_AT_STEP = 8
# Each step sleeps (numbers unchanged, so the 30-step fault-free reference holds) so that the pod
# is killed while the job trains. JobSet keeps the sleep it was first run with; the other engines,
# whose pods differ in what the engine sets rather than in how undying recovers, sleep less to keep
# the file short: 22 steps after the kill still last several seconds, far beyond the heartbeat
# (0.5 s) by which the kill is timed.
STEP_SLEEP = {Flavor.JOBSET: 0.3, Flavor.PYTORCHJOB: 0.15, Flavor.VOLCANO: 0.15}
# The training operator's default master port (its defaulting adds a container port
# `pytorchjob-port` when the template names none).
PYTORCHJOB_MASTER_PORT = 23456


@dataclass(frozen=True)
class EnginePod:
    """One pod as the engine creates it: the template it comes from and the variables it sets."""

    template: dict[str, Any]
    engine_env: dict[str, str]


def engine_pods(job: dict[str, Any], flavor: Flavor) -> list[EnginePod]:
    """The pods the engine creates from its rendered job object, in node-rank order (docs/kubernetes.md's
    engine table): a JobSet's Indexed Job gives completion index i; a PyTorchJob's Master is rank 0
    and Worker i rank i + 1 (the operator also sets torchrun's variables); Volcano's env plugin
    gives task index i (as VC_TASK_INDEX and VK_TASK_INDEX). The variable names are written out
    here, not taken from undying.k8s: a rendered script that read another one would fail here."""
    if flavor is Flavor.JOBSET:
        [replicated] = job["spec"]["replicatedJobs"]
        job_spec = replicated["template"]["spec"]
        assert replicated["replicas"] == 1 and job_spec["completionMode"] == "Indexed"
        template = job_spec["template"]
        return [EnginePod(template, {"JOB_COMPLETION_INDEX": str(i)}) for i in range(job_spec["completions"])]
    if flavor is Flavor.PYTORCHJOB:
        replicas = job["spec"]["pytorchReplicaSpecs"]
        assert replicas["Master"]["replicas"] == 1
        templates = [replicas["Master"]["template"]] + [replicas["Worker"]["template"]] * replicas["Worker"]["replicas"]
        # What the training operator v1.9.0 sets besides PET_NODE_RANK (pytorch/envvar.go, master.go;
        # nprocPerNode unset, so WORLD_SIZE counts pods): torchrun's variables, which undying's
        # agent replaces in every worker and `undying run` does not read.
        master = f"{job['metadata']['name']}-master-0"
        torchrun = {"PYTHONUNBUFFERED": "1", "MASTER_ADDR": master, "PET_MASTER_ADDR": master,
                    "MASTER_PORT": str(PYTORCHJOB_MASTER_PORT), "PET_MASTER_PORT": str(PYTORCHJOB_MASTER_PORT),
                    "WORLD_SIZE": str(len(templates)), "PET_NNODES": str(len(templates))}
        return [EnginePod(template, {**torchrun, "RANK": str(rank), "PET_NODE_RANK": str(rank)})
                for rank, template in enumerate(templates)]
    [task] = job["spec"]["tasks"]
    assert "env" in job["spec"]["plugins"]
    return [EnginePod(task["template"], {"VC_TASK_INDEX": str(i), "VK_TASK_INDEX": str(i)})
            for i in range(task["replicas"])]


class Pods(Hosts):
    """The pods of a rendered job as local process groups (``Hosts`` starts, signals, waits for and
    reaps them): each runs its container's command with its arguments and environment, and the
    variables its engine sets."""

    def __init__(self, root: Path, objects: list[dict[str, Any]], options: RenderOptions) -> None:
        super().__init__(root, extra=[])
        secret, config_map, _service, job = objects
        self.engine_pods = engine_pods(job, options.flavor)
        # One set of mount files stands in for every pod's: their templates carry the same metadata.
        metadata = self.engine_pods[0].template["metadata"]
        assert all(pod.template["metadata"] == metadata for pod in self.engine_pods)
        self.mounts = {SPEC_DIR: root / "spec", TOKEN_DIR: root / "token-secret", POD_INFO_DIR: root / "pod-info"}
        for directory in self.mounts.values():
            directory.mkdir()
        for name, text in config_map["data"].items():
            (self.mounts[SPEC_DIR] / name).write_text(text)
        for name, text in secret["stringData"].items():
            (self.mounts[TOKEN_DIR] / name).write_text(text)
        (self.mounts[POD_INFO_DIR] / "labels").write_text(format_downward_api_file(metadata["labels"]))
        (self.mounts[POD_INFO_DIR] / "annotations").write_text(format_downward_api_file(metadata["annotations"]))
        self.service = controller_address(options)

    def localize(self, argument: str, node: int) -> str:
        """An argument as this machine runs it: the Service is node 0 on 127.0.0.1, mounts are files."""
        if argument == self.service:
            return f"127.0.0.1:{self.port}"
        if argument == RUN_DIR:
            return str(self.run_dir(node))
        for mount, local in self.mounts.items():
            if argument.startswith(mount + "/"):
                return str(local) + argument[len(mount):]
        return argument

    def start(self, node: int, spare: bool = False) -> None:
        """Pod ``node`` (the engine's index; at nnodes and beyond the script makes it a spare)."""
        pod = self.engine_pods[node]
        [container] = pod.template["spec"]["containers"]
        environment = dict(os.environ, **{item["name"]: item["value"] for item in container["env"]
                                          if "value" in item})
        environment.update({**pod.engine_env, MARK_ENV: self.mark,
                            # the image's `undying` is this checkout's
                            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
        command = [*container["command"], *(self.localize(arg, node) for arg in container["args"])]
        self.processes[node] = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                                start_new_session=True)


@pytest.fixture
def pods(tmp_path: Path):
    made: list[Pods] = []

    def make(job_yaml: dict[str, Any], flavor: Flavor, standby: int) -> Pods:
        spec = validate_job_spec({**job_yaml, "checkpoint": {"dir": str(tmp_path / "checkpoints"), "interval": 10}})
        script = [str(EXAMPLE), "--steps", str(STEPS), "--step-sleep", str(STEP_SLEEP[flavor])]
        options = RenderOptions(name="llm", flavor=flavor, image="local", script=script, standby=standby)
        made.append(Pods(tmp_path, render_job(spec, options), options))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()
        assert wait_no_processes(cluster.mark) == []


@pytest.mark.parametrize("flavor", list(Flavor), ids=[flavor.value for flavor in Flavor])
def test_rendered_pods_train_and_a_killed_pod_is_replaced_by_the_spare_pod(reference_run: JobRun, pods,
                                                                           flavor: Flavor) -> None:
    """Three rendered pods (2 nodes + 1 spare); node 1's pod is SIGKILLed (its whole process group)
    mid-run: the spare pod takes its place, the survivors keep their processes, no job restart,
    and the final parameters equal the fault-free run's."""
    cluster = pods(JOB_YAML, flavor, standby=1)
    assert len(cluster.engine_pods) == 3
    for node in (0, 1, 2):
        cluster.start(node)
    cluster.wait_for_event(f"step {KILL_AT_STEP} on node 1", lambda event: event.kind == ev.HEARTBEAT
                           and event.node == 1 and (event.step or 0) >= KILL_AT_STEP)
    cluster.signal_host(1, signal.SIGKILL)
    code, output = cluster.wait(0)
    assert code == 0, output
    assert cluster.processes[1].wait(timeout=30) == -9
    assert cluster.wait(2, timeout=60)[0] == 0

    run = JobRun(code, output, cluster.run_dir(0), cluster.mark)
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run)
    [decision] = run.kinds(ev.DECISION)
    assert (decision.details["strategy"], decision.details["lost_ranks"]) == ("recover", [2, 3]), decision.details
    assert not run.kinds(ev.RESTART_BEGIN)
    assert [event.details["spare"] for event in run.kinds(ev.STANDBY_ADOPT)] == [2]


def test_an_annotation_turns_process_recovery_on_in_a_real_run(reference_run: JobRun, tmp_path: Path) -> None:
    """The job.yaml leaves recovery off (recover_strategy: exit, so a killed worker would restart the
    whole job); the pod's label process-recover-enable and annotation recover-strategy turn
    recover-in-place on: only the killed rank restarts, the digest is the fault-free one."""
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(yaml.safe_dump({"process_recover": False, "recover_strategy": ["exit"]}))
    labels, annotations = tmp_path / "labels", tmp_path / "annotations"
    labels.write_text(format_downward_api_file({"process-recover-enable": "on", "app": "llm"}))
    annotations.write_text(format_downward_api_file({"recover-strategy": "recover-in-place"}))
    run = run_job(tmp_path / "run", ["--config", str(job_yaml), "--pod-labels", str(labels),
                                     "--pod-annotations", str(annotations), "--inject", "kill:rank=1:step=12"])
    assert run.returncode == 0, run.output + run.logs()
    assert_ends_bitwise(run, reference_run)
    [decision] = run.kinds(ev.DECISION)
    assert decision.details["strategy"] == "recover-in-place", decision.details
    assert not run.kinds(ev.RESTART_BEGIN)
