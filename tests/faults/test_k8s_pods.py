"""Rendered pods run for real, without a cluster, for every engine (JobSet, PyTorchJob, Volcano):
the container command, arguments and environment of each pod the engine would create from the
rendered job object, started as one process group per "pod" on 127.0.0.1, with only what a
cluster provides substituted (the Service's host by 127.0.0.1, the Secret, ConfigMap and Downward
API mounts by files holding the same content, the hostPath volume by that path, the variables the
engine sets in each pod). The engine's part is played from the manifest: when a pod ends, what
the rendered policy makes the engine do (tests/k8s_engines.py: recreate the pod, restart the job,
fail it, or nothing) is done. A killed or drained node pod is taken over by the spare pod, its
replacement rejoins as a spare, and the job ends with the fault-free parameters; a drained node 0
stops the job, which the engine restarts and which resumes from the persisted step.

What this does not show: that a cluster schedules these objects, that the engine creates the pods
and sets the variables as ``engine_pods`` says, resolves the Service to node 0's pod, or acts on a
pod's end as tests/k8s_engines.py reads its policy. No API server was run (docs/kubernetes.md)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
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
from tests.k8s_engines import Action, PodEnd, engine_for
from undying import events as ev
from undying.agent.node_agent import EXIT_NODE_LEFT
from undying.config import validate_job_spec
from undying.events import Event, read_events
from undying.k8s import Flavor, RenderOptions, render_job
from undying.k8s.labels import format_downward_api_file
from undying.k8s.options import VolumeKind, VolumeSource
from undying.k8s.pod import controller_address

pytestmark = pytest.mark.faults

# tests/conftest.py's BASE_ARGS as a job.yaml, with pod-level recovery onto a spare.
JOB_YAML = {"nnodes": 2, "nproc_per_node": 2, "monitor_interval": 0.3, "heartbeat_interval": 0.5,
            "heartbeat_timeout": 4, "node_return_timeout": 60, "comm_timeout": 20, "warm_standby": False,
            "sample_log": True, "state_digests": True, "process_recover": True, "pod_rescheduling": "on",
            "recover_strategy": ["recover-in-place", "recover"]}
FAULT_AT_STEP = 8
# Each step sleeps (numbers unchanged, so the 30-step fault-free reference holds) so that the pod
# is killed while the job trains and its replacement says hello before the job ends. JobSet keeps
# the sleep it was first run with; the other engines, whose pods differ in what the engine sets
# rather than in how undying recovers, sleep less to keep the file short.
STEP_SLEEP = {Flavor.JOBSET: 0.3, Flavor.PYTORCHJOB: 0.15, Flavor.VOLCANO: 0.15}
# The training operator's default master port (its defaulting adds a container port
# `pytorchjob-port` when the template names none).
PYTORCHJOB_MASTER_PORT = 23456
# An engine's reaction to a pod's end before its replacement starts (it sees the end, deletes the
# pod, creates another, the scheduler binds it): seconds on a cluster, 1 s here.
REACTION_S = 1.0
# How long the engine waits for a pod it deletes to stop before it kills it (the pods' grace period
# is longer; these pods stop within a second or two).
DELETE_GRACE_S = 10.0


@dataclass(frozen=True)
class EnginePod:
    """One pod as the engine creates it: the template it comes from and the variables it sets."""

    template: dict[str, Any]
    engine_env: dict[str, str]


def engine_pods(job: dict[str, Any], flavor: Flavor) -> list[EnginePod]:
    """The pods the engine creates from its rendered job object, in node-rank order (docs/kubernetes.md's
    engine table): a JobSet's Indexed Job gives completion index i; a PyTorchJob's Master is rank 0
    and Worker i rank i + 1 (the operator also sets torchrun's variables); Volcano's env plugin
    gives each task's pods their index in the task (as VC_TASK_INDEX and VK_TASK_INDEX). The
    variable names are written out here, not taken from undying.k8s: a rendered script that read
    another one would fail here."""
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
    assert "env" in job["spec"]["plugins"]
    return [EnginePod(task["template"], {"VC_TASK_INDEX": str(i), "VK_TASK_INDEX": str(i)})
            for task in job["spec"]["tasks"] for i in range(task["replicas"])]


@dataclass
class PodRun:
    """One pod the engine created: its index (the node rank it starts as), name, process group."""

    index: int
    name: str
    process: subprocess.Popen
    log: Path
    mounts: dict[str, Path]
    disrupted: bool = False  # Kubernetes took it away (a drain): its DisruptionTarget condition


@dataclass
class Pods:
    """The pods of a rendered job as local process groups, and the engine's part from its manifest."""

    root: Path
    objects: list[dict[str, Any]]
    options: RenderOptions
    # pod index -> labels/annotations of that pod alone (the kubelet's Downward API files of one pod)
    metadata_override: dict[int, dict[str, dict[str, str]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        [job] = [item for item in self.objects if item["apiVersion"] != "v1"]
        self.engine = engine_for(job)
        self.pods = engine_pods(job, self.options.flavor)
        self.files = {item["kind"]: item for item in self.objects if item["apiVersion"] == "v1"}
        self.mark = uuid.uuid4().hex
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.service = controller_address(self.options)
        self.current: dict[int, PodRun] = {}
        self.every: list[PodRun] = []
        self.ends: list[tuple[int, int, Action]] = []  # (index, exit code as the kubelet reports it, what the engine did)

    # ------------------------------------------------------------ a pod, as the kubelet runs it

    def _mounts(self, pod: EnginePod, index: int, name: str) -> dict[str, Path]:
        """Each volume mount of the container as a local path holding what the cluster would put there."""
        spec = pod.template["spec"]
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        [container] = spec["containers"]
        mounts = {}
        for mount in container["volumeMounts"]:
            volume = volumes[mount["name"]]
            local = self.root / "pods" / name / mount["name"]
            if "configMap" in volume:
                files = self.files["ConfigMap"]["data"]
            elif "secret" in volume:
                files = self.files["Secret"]["stringData"]
            elif "downwardAPI" in volume:
                metadata = pod.template["metadata"]
                override = self.metadata_override.get(index, {})
                files = {"labels": format_downward_api_file({**metadata["labels"], **override.get("labels", {})}),
                         "annotations": format_downward_api_file({**metadata["annotations"],
                                                                  **override.get("annotations", {})})}
            elif "hostPath" in volume:
                local = Path(volume["hostPath"]["path"]) / mount.get("subPathExpr", "").replace("$(POD_NAME)", name)
                files = {}
            elif mount["mountPath"] == "/dev/shm":
                continue  # this machine's own
            else:
                files = {}
            local.mkdir(parents=True, exist_ok=True)
            for file_name, text in files.items():
                (local / file_name).write_text(text)
            mounts[mount["mountPath"]] = local
        return mounts

    def start(self, index: int) -> None:
        """Create pod ``index`` (anew: a replacement is a new pod with a name and run directory of its own)."""
        pod = self.pods[index]
        name = f"{self.options.name}-{index}-{len(self.every)}"
        [container] = pod.template["spec"]["containers"]
        mounts = self._mounts(pod, index, name)
        environment = dict(os.environ, **{item["name"]: item["value"] for item in container["env"] if "value" in item})
        environment.update({**pod.engine_env, MARK_ENV: self.mark, "POD_NAME": name, "POD_IP": "127.0.0.1",
                            # the image's `undying` is this checkout's
                            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
        command = [*container["command"], *(self._localize(argument, mounts) for argument in container["args"])]
        log = self.root / "pods" / f"{name}.log"
        with open(log, "w") as output:
            process = subprocess.Popen(command, env=environment, stdout=output, stderr=subprocess.STDOUT, text=True,
                                       cwd=REPO, start_new_session=True)
        run = PodRun(index, name, process, log, mounts)
        self.current[index] = run
        self.every.append(run)

    def _localize(self, argument: str, mounts: dict[str, Path]) -> str:
        """An argument as this machine runs it: the Service is node 0 on 127.0.0.1, mounts are local paths."""
        if argument == self.service:
            return f"127.0.0.1:{self.port}"
        for mount_path in sorted(mounts, key=len, reverse=True):
            if argument == mount_path or argument.startswith(mount_path + "/"):
                return str(mounts[mount_path]) + argument[len(mount_path):]
        return argument

    def run_dir(self, index: int) -> Path:
        """The run directory of pod ``index``'s latest incarnation."""
        return next(run for run in reversed(self.every) if run.index == index).mounts["/var/lib/undying/run"]

    def output(self, index: int) -> str:
        return "".join(f"--- {run.name}\n{run.log.read_text()}" for run in self.every if run.index == index)

    # ------------------------------------------------------------ faults, and the engine's part

    def drain(self, index: int) -> None:
        """`kubectl drain` of the pod's node: the pod gets DisruptionTarget and its container SIGTERM."""
        run = self.current[index]
        run.disrupted = True
        run.process.send_signal(signal.SIGTERM)

    def kill(self, index: int) -> None:
        """The pod's node dies: every process of the pod at once."""
        os.killpg(self.current[index].process.pid, signal.SIGKILL)

    def events(self) -> list[Event]:
        path = self.run_dir(0) / ev.EVENTS_FILE
        return read_events(path) if path.exists() else []

    def wait_for_event(self, what: str, found: Callable[[Event], bool], timeout: float = 120) -> Event:
        deadline = time.time() + timeout
        while time.time() < deadline:
            match = next((event for event in self.events() if found(event)), None)
            if match is not None:
                return match
            time.sleep(0.1)
        raise AssertionError(f"no {what} within {timeout} s; events: {[e.kind for e in self.events()]}")

    def play_engine(self, timeout: float = 240) -> None:
        """Until the job is complete or failed: each pod that ends is answered as its engine would."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for index, run in list(self.current.items()):
                code = run.process.poll()
                if code is None:
                    continue
                del self.current[index]
                self._stop(run)  # the container's other processes go with its first one
                exit_code = 128 - code if code < 0 else code
                action = self.engine.pod_ended(PodEnd(index, exit_code, run.disrupted))
                self.ends.append((index, exit_code, action))
                if self.engine.complete or action == Action.FAIL_JOB:
                    self._delete_all()
                    return
                if action == Action.RECREATE_POD:
                    time.sleep(REACTION_S)
                    self.start(index)
                elif action == Action.RESTART_JOB:
                    self._delete_all()
                    time.sleep(REACTION_S)
                    for every_index in range(len(self.pods)):
                        self.start(every_index)
            time.sleep(0.1)
        raise AssertionError(f"the job neither completed nor failed within {timeout} s; ends: {self.ends}")

    def _stop(self, run: PodRun, grace: float = 0.0) -> None:
        if grace and run.process.poll() is None:
            run.process.send_signal(signal.SIGTERM)
            try:
                run.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(run.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        run.process.wait()

    def _delete_all(self) -> None:
        """The engine deletes the pods still running (SIGTERM, then SIGKILL after the grace)."""
        for run in self.current.values():
            self._stop(run, grace=DELETE_GRACE_S)
        self.current.clear()

    def close(self) -> None:
        for run in self.every:
            self._stop(run)


@pytest.fixture
def pods(tmp_path: Path):
    made: list[Pods] = []

    def make(flavor: Flavor, standby: int, **overrides: Any) -> Pods:
        # The checkpoint volume: a host path every "pod" of this machine shares, as every node of a
        # cluster shares its PVC; the run directories go there too (runs/POD_NAME).
        checkpoints = tmp_path / "checkpoints"
        spec = validate_job_spec({**JOB_YAML, "checkpoint": {"dir": str(checkpoints), "interval": 10}})
        script = [str(EXAMPLE), "--steps", str(STEPS), "--step-sleep", str(STEP_SLEEP[flavor])]
        options = RenderOptions(name="llm", flavor=flavor, image="local", script=script, standby=standby,
                                checkpoint_volume=VolumeSource(VolumeKind.HOSTPATH, host_path=str(checkpoints)))
        made.append(Pods(tmp_path, render_job(spec, options), options, **overrides))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()
        assert wait_no_processes(cluster.mark) == []


def at_step(step: int, node: int | None = None) -> Callable[[Event], bool]:
    return lambda event: (event.kind == ev.HEARTBEAT and (event.step or 0) >= step
                          and (node is None or event.node == node))


def returned_as_spare(run: JobRun, node: int) -> list[Event]:
    return [event for event in run.kinds(ev.AGENT_REGISTERED) if event.details.get("returned_node") == node]


@pytest.mark.parametrize("flavor", list(Flavor), ids=[flavor.value for flavor in Flavor])
def test_rendered_pods_train_and_a_killed_pod_is_replaced_by_the_spare_pod(reference_run: JobRun, pods,
                                                                           flavor: Flavor) -> None:
    """Three rendered pods (2 nodes + 1 spare); node 1's pod is SIGKILLed (its whole process group)
    mid-run: the engine, as its rendered policy says, recreates it, and it rejoins as a spare; the
    spare pod has taken its place, the survivors keep their processes, no job restart, and the
    final parameters equal the fault-free run's."""
    cluster = pods(flavor, standby=1)
    assert len(cluster.pods) == 3
    for node in (0, 1, 2):
        cluster.start(node)
    cluster.wait_for_event(f"step {FAULT_AT_STEP} on node 1", at_step(FAULT_AT_STEP, node=1))
    cluster.kill(1)
    cluster.play_engine()
    assert cluster.ends[0] == (1, 128 + signal.SIGKILL, Action.RECREATE_POD), cluster.ends
    assert cluster.ends[-1] == (0, 0, Action.DONE) and cluster.engine.complete, cluster.ends

    run = JobRun(0, cluster.output(0), cluster.run_dir(0), cluster.mark)
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run)
    [decision] = run.kinds(ev.DECISION)
    assert (decision.details["strategy"], decision.details["lost_ranks"]) == ("recover", [2, 3]), decision.details
    assert not run.kinds(ev.RESTART_BEGIN)
    assert [event.details["spare"] for event in run.kinds(ev.STANDBY_ADOPT)] == [2]
    assert returned_as_spare(run, 1), cluster.output(1)


def test_a_drained_node_pod_is_recreated_and_rejoins_as_a_spare(reference_run: JobRun, pods) -> None:
    """`kubectl drain` of node 1's host: its pod (DisruptionTarget) gets SIGTERM, its `undying run`
    tells the controller it leaves and exits 143; the JobSet's pod failure policy recreates it
    without counting a failure, and it rejoins as a spare while the spare pod serves node 1; the
    job ends bitwise equal to the fault-free run. (Exiting 0, the pod would count as done and
    never come back: tests/unit/test_k8s_policies.py.)"""
    cluster = pods(Flavor.JOBSET, standby=1)
    for node in (0, 1, 2):
        cluster.start(node)
    cluster.wait_for_event(f"step {FAULT_AT_STEP} on node 1", at_step(FAULT_AT_STEP, node=1))
    cluster.drain(1)
    cluster.play_engine()
    assert cluster.ends[0] == (1, EXIT_NODE_LEFT, Action.RECREATE_POD), cluster.ends
    assert cluster.ends[-1] == (0, 0, Action.DONE) and cluster.engine.complete, cluster.ends

    run = JobRun(0, cluster.output(0), cluster.run_dir(0), cluster.mark)
    assert_ends_bitwise(run, reference_run)
    [lost] = run.kinds(ev.AGENT_LOST)
    assert lost.node == 1 and lost.details["planned"], lost.details
    [decision] = run.kinds(ev.DECISION)
    assert (decision.details["strategy"], decision.details["lost_ranks"]) == ("recover", [2, 3]), decision.details
    assert [event.details["spare"] for event in run.kinds(ev.STANDBY_ADOPT)] == [2]
    assert not run.kinds(ev.RESTART_BEGIN)
    assert returned_as_spare(run, 1), cluster.output(1)


def test_a_drained_node_0_stops_the_job_and_the_engine_restarts_it_from_the_persisted_step(
        reference_run: JobRun, pods) -> None:
    """A drain of node 0's host (Volcano): node 0 stops the job once every rank persisted the newest
    committed step and every pod exits 75, the job's outcome. The job's exitCode policy restarts every
    pod at the first of them, the new controller resumes from that step, and the job ends bitwise equal
    to the fault-free run."""
    cluster = pods(Flavor.VOLCANO, standby=0)
    for node in (0, 1):
        cluster.start(node)
    cluster.wait_for_event("step 13", at_step(13))
    first_run_dir = cluster.run_dir(0)
    cluster.drain(0)
    cluster.play_engine()
    assert cluster.ends[0][1:] == (75, Action.RESTART_JOB) and len(cluster.ends) == 3, cluster.ends
    assert cluster.ends[-1] == (0, 0, Action.DONE) and cluster.engine.complete, cluster.ends

    persisted = [event.step for event in read_events(first_run_dir) if event.kind == ev.CHECKPOINT_SAVE
                 and event.step % 10]
    assert len(persisted) == 1 and persisted[0] >= 13, persisted
    run = JobRun(0, cluster.output(0), cluster.run_dir(0), cluster.mark)
    assert run.run_dir != first_run_dir  # a new pod, a run directory of its own on the volume
    loads = [event for event in run.kinds(ev.CHECKPOINT_LOAD) if event.rank == 0]
    assert [(event.step, event.details["source"]) for event in loads] == [(persisted[0], "storage")]
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference_run)


def test_a_pod_refused_at_start_fails_the_job_and_is_not_recreated(pods) -> None:
    """Node 1's pod carries a bad annotation: its `undying run` refuses it (exit 2, one line) and the
    PyTorchJob fails (ExitCode: below 128), with no pod recreated."""
    cluster = pods(Flavor.PYTORCHJOB, standby=0,
                   metadata_override={1: {"annotations": {"recover-strategy": "recover,teleport"}}})
    for node in (0, 1):
        cluster.start(node)
    cluster.play_engine(timeout=120)
    assert cluster.ends == [(1, 2, Action.FAIL_JOB)], cluster.ends
    assert len(cluster.every) == 2
    assert "pod annotation recover-strategy: unknown strategy" in cluster.output(1)


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
